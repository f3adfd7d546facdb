"""--torch-compile: the compiled trainer computes what the eager one does (CPU, small model); the compiled
layers share one graph across token counts, and their activation recompute does not depend on the process's
Dynamo recompile limit (those cases each run in a spawned process: Dynamo's caches and settings are
process-wide)."""
import pytest
import torch
import torch.multiprocessing as mp

from furlong.config import Config
from furlong.models.hf_io import load_pretrained
from furlong.config_map import actor_config, batching_config
from furlong.trainer.actor import Actor
from furlong.launch.distributed import destroy_distributed, free_port, init_distributed
from furlong.types import TrainSample
from tiny_checkpoints import write_tiny_checkpoint


def _samples(seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(6):
        p, r = int(torch.randint(5, 30, (1,), generator=g)), int(torch.randint(3, 20, (1,), generator=g))
        out.append(TrainSample(token_ids=torch.randint(0, 100, (p + r,), generator=g), num_prompt_tokens=p,
                               advantages=torch.randn(r, generator=g), rollout_log_probs=-torch.rand(r, generator=g)))
    return out


def test_compiled_layers_match_eager(tmp_path):
    """Each decoder layer compiles into one graph, attention included (no graph breaks), and trains
    as the eager layers do."""
    from torch._dynamo.utils import counters
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family="qwen3")
    ctx = init_distributed("cpu")
    try:
        results = {}
        for mode in ("off", "on"):
            cfg = Config()
            cfg.batch.use_dynamic_batch_size, cfg.batch.max_tokens_per_gpu = True, "96"
            cfg.optim.lr, cfg.algo.entropy_coef = 1e-3, 0.01
            cfg.parallel.torch_compile = mode
            counters.clear()
            actor = Actor(load_pretrained(ckpt, dtype=torch.float32, device="cpu"), actor_config(cfg), ctx)
            # two steps with different token counts: the second exercises dynamic shapes
            metrics = [actor.train_step(_samples(s), batching_config(cfg)) for s in range(2)]
            results[mode] = [(m.loss, m.grad_norm, m.entropy) for m in metrics]
            if mode == "on":
                assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters)
        for eager, compiled in zip(results["off"], results["on"]):
            for a, b in zip(eager, compiled):
                assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (results["off"], results["on"])
    finally:
        destroy_distributed()


HIDDEN = 64


def _tiny_model():
    from furlong.models.decoder import Transformer
    from furlong.models.hf_config import ModelArgs
    torch.manual_seed(0)
    args = ModelArgs(model_type="qwen3", vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    return Transformer(args).train()


def _micro_batch(model, num_tokens: int, grad: bool) -> None:
    """One packed one-sample micro-batch through the layers, as the memory probes run it: a training
    forward and backward, or a no-grad forward."""
    ids = torch.randint(0, 128, (num_tokens,))
    cu = torch.tensor([0, num_tokens], dtype=torch.int32)
    with torch.set_grad_enabled(grad):
        hidden = model.forward_packed(ids, torch.arange(num_tokens), cu, num_tokens)
        if grad:
            hidden.float().pow(2).mean().backward()


def _num_graphs() -> int:
    from furlong.models.decoder import DecoderLayer
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(DecoderLayer.forward.__code__))


def _worker(rank: int, port: int, case: str, results) -> None:
    import torch.distributed as dist
    from furlong.trainer.fsdp import compile_layers, prepare_trainer_model, reshard_all
    from furlong.trainer.trainer_config import ShardConfig
    from furlong.types import DistContext
    try:
        model = _tiny_model()
        if case == "sizes":
            compile_layers(model)
            _micro_batch(model, HIDDEN, grad=True)       # a token count equal to the hidden size first
            _micro_batch(model, 50, grad=True)
            results["num_graphs"] = _num_graphs()
            return
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        # a process whose other compiled code has left Dynamo little room: the layers must not depend on it
        torch._dynamo.config.recompile_limit = 4
        prepare_trainer_model(model, DistContext(0, 1, 0, torch.device("cpu"), "gloo"),
                              ShardConfig(dtype="bf16", torch_compile="on", gradient_checkpointing=False,
                                          reshard_after_forward=False, cpu_offload=False, optimizer_offload=False))
        # the memory plan's sequence: per size, each recompute mode, a warm-up and a measured training
        # micro-batch and a no-grad forward
        for num_tokens in (HIDDEN, 16, 128):
            for recompute in (False, True):
                model.gradient_checkpointing = recompute
                for grad in (True, True, False):
                    _micro_batch(model, num_tokens, grad)
                reshard_all(model)
        results["error"] = None
        dist.destroy_process_group()
    except Exception as e:           # reported to the test, which names it
        results["error"] = f"{type(e).__name__}: {str(e)[:200]}"


def _run(case: str) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(free_port(), case, results), nprocs=1, join=True)
        return dict(results)


def test_token_count_equal_to_a_model_dimension_compiles_the_shared_dynamic_graph():
    # with duck shaping, 64 tokens on a 64-wide model shared the hidden size's symbol and compiled a
    # graph specialised to 64 tokens; every other count then compiled a second one
    assert _run("sizes")["num_graphs"] == 1


@pytest.mark.timeout(600)
def test_recompute_runs_when_the_process_recompile_limit_is_low():
    # past the limit Dynamo ran a layer's recompute eagerly where its forward had run compiled, and
    # torch.utils.checkpoint raised CheckpointError (seen on the GPU with Qwen3-8B's probes)
    assert _run("probes")["error"] is None

"""--torch-compile: the compiled trainer computes what the eager one does (CPU, small model)."""
import torch

from furlong.config import Config
from furlong.models.hf_io import load_pretrained
from furlong.config_map import actor_config, batching_config
from furlong.trainer.actor import Actor
from furlong.launch.distributed import destroy_distributed, init_distributed
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

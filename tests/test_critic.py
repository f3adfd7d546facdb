"""PPO's critic: the value loss and explained variance against direct loops, the value model's
packed forward, training on a fixed batch, two gloo ranks = one process, and `furlong train
--advantage-estimator ppo` end to end (critic-only warm-up, exact resume, a learning check)."""
from __future__ import annotations

import dataclasses
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import synthetic_samples, tiny_ckpt, tiny_config  # noqa: E402,F401 (tiny_ckpt: fixture)
from test_e2e import _resume_flags, assets, read_metrics  # noqa: E402,F401 (assets: fixture)

from furlong.cli import main, parse_config  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.models.value_model import ValueModel  # noqa: E402
from furlong.config_map import batching_config, critic_config  # noqa: E402
from furlong.trainer.batching import step_loss_weights  # noqa: E402
from furlong.trainer.critic import Critic  # noqa: E402
from furlong.launch.distributed import init_distributed, launch_local  # noqa: E402
from furlong.algorithms.value_loss import explained_variance, value_loss  # noqa: E402
from furlong.types import TrainSample  # noqa: E402


# ---------------------------------------------------------------- value loss and explained variance

def _ragged(seed: int) -> tuple[list[list[float]], ...]:
    """Per-sample lists: values, old values (half within 0.2 of the values, half beyond), returns,
    masks (all ones, a masked head, random, all zero), for 9 samples of 1-7 tokens."""
    rng = random.Random(seed)
    vals, olds, rets, masks = [], [], [], []
    for i in range(9):
        r = rng.randint(1, 7)
        v = [rng.uniform(-1, 1) for _ in range(r)]
        vals.append(v)
        olds.append([x + rng.choice([-1, 1]) * rng.choice([rng.uniform(0, 0.15), rng.uniform(0.3, 1.0)]) for x in v])
        rets.append([rng.uniform(-1.5, 1.5) for _ in range(r)])
        kind = i % 4
        masks.append([1.0] * r if kind == 0 else [0.0] * (r // 2) + [1.0] * (r - r // 2) if kind == 1
                     else [float(rng.random() < 0.6) for _ in range(r)] if kind == 2 else [0.0] * r)
    return vals, olds, rets, masks


def _ref_value_loss(vals, olds, rets, masks, clip, per_token):
    """miles' value loss by hand: per-sample token means averaged over samples, or a token mean."""
    per_sample, clipped, all_tokens, all_clipped = [], [], [], []
    for v, o, r, m in zip(vals, olds, rets, masks):
        losses, flags = [], []
        for vt, ot, rt, mt in zip(v, o, r, m):
            if mt == 0:
                continue
            vc = ot + max(-clip, min(clip, vt - ot))
            losses.append(max((vc - rt) ** 2, (vt - rt) ** 2))
            flags.append(float(abs(vt - ot) > clip))
        per_sample.append(sum(losses) / max(len(losses), 1))
        clipped.append(sum(flags) / max(len(flags), 1))
        all_tokens += losses
        all_clipped += flags
    if per_token:
        return sum(all_tokens) / len(all_tokens), sum(all_clipped) / len(all_clipped)
    return sum(per_sample) / len(vals), sum(clipped) / len(vals)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_loss_matches_loops(seed, mode):
    vals, olds, rets, masks = _ragged(seed)
    samples = [TrainSample(token_ids=torch.zeros(len(v) + 1, dtype=torch.long), num_prompt_tokens=1,
                           advantages=torch.zeros(len(v)), rollout_log_probs=torch.zeros(len(v)),
                           loss_mask=torch.tensor(m)) for v, m in zip(vals, masks)]
    weights = torch.cat(step_loss_weights(samples, mode, False, 1024)).double()
    flat = lambda rows: torch.tensor([x for row in rows for x in row], dtype=torch.float64)  # noqa: E731
    v = flat(vals).requires_grad_(True)
    old, ret = flat(olds), flat(rets)
    old[weights == 0] = float("nan")      # garbage off the trained tokens must not leak in
    loss, m = value_loss(v, old, ret, weights, 0.2)
    want, want_clip = _ref_value_loss(vals, olds, rets, masks, 0.2, mode == "token-mean")
    assert loss.item() == pytest.approx(want, rel=1e-6)   # the weights are float32
    assert m.value_loss.item() == pytest.approx(want, rel=1e-6)
    assert m.value_clipfrac.item() == pytest.approx(want_clip, rel=1e-6)
    assert 0 < want_clip < 1                # both regions present
    # gradient: 2 (v - R) w on the unclipped branch; 0 where the clipped branch is larger and v is clipped
    loss.backward()
    for k in range(len(v)):
        w, vk, ok, rk = weights[k].item(), v[k].item(), old[k].item(), ret[k].item()
        if w == 0:
            assert v.grad[k] == 0
            continue
        vc = ok + max(-0.2, min(0.2, vk - ok))
        uses_clipped = (vc - rk) ** 2 > (vk - rk) ** 2 and abs(vk - ok) > 0.2
        assert v.grad[k].item() == pytest.approx(0.0 if uses_clipped else 2 * (vk - rk) * w, abs=1e-12)


def test_explained_variance_matches_direct():
    vals, _, rets, masks = _ragged(3)
    pairs = [(v, r) for vs, rs, ms in zip(vals, rets, masks) for v, r, m in zip(vs, rs, ms) if m]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: mean([(x - mean(xs)) ** 2 for x in xs])  # noqa: E731
    want = 1 - var([r - v for v, r in pairs]) / var([r for _, r in pairs])
    t = lambda rows: [torch.tensor(x) for x in rows]  # noqa: E731
    assert explained_variance(t(vals), t(rets), t(masks)) == pytest.approx(want, rel=1e-6)
    assert explained_variance(t(rets), t(rets), t(masks)) == 1.0
    const = [[1.0] * len(r) for r in rets]
    assert explained_variance(t(vals), t(const), t(masks)) != explained_variance(t(vals), t(const), t(masks))   # NaN


# ---------------------------------------------------------------- the value model and the Critic

def _critic(ckpt, cfg) -> Critic:
    return Critic(ValueModel(load_pretrained(ckpt), torch.Generator().manual_seed(0)), critic_config(cfg),
                  init_distributed("cpu"))


def test_compute_values_match_unpacked_forward(tiny_ckpt):
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="30")
    critic = _critic(tiny_ckpt, cfg)
    samples = synthetic_samples([17, 9, 25, 6, 12])
    got = critic.compute_values(samples, batching_config(cfg))
    plain = ValueModel(load_pretrained(tiny_ckpt), torch.Generator().manual_seed(0))
    assert plain.decoder.lm_head is None and "value_head.weight" in dict(plain.named_parameters())
    with torch.no_grad():
        for s, v in zip(samples, got):
            want = plain(s.token_ids[None])[0][s.num_prompt_tokens - 1:-1]   # the state before each response token
            assert v.shape == (s.num_response_tokens,) and v.dtype == torch.float32
            torch.testing.assert_close(v, want, rtol=1e-5, atol=1e-6)
    assert got[0].std() > 0


def _with_targets(critic: Critic, cfg, samples: list[TrainSample], seed: int = 0) -> list[TrainSample]:
    """Samples with the critic's current values and a fixed return per sample (a terminal reward, gamma = 1)."""
    g = torch.Generator().manual_seed(seed)
    values = critic.compute_values(samples, batching_config(cfg))
    return [dataclasses.replace(s, values=v, returns=torch.full_like(v, float(torch.rand((), generator=g) * 2 - 1)))
            for s, v in zip(samples, values)]


def test_value_loss_falls_on_a_fixed_batch(tiny_ckpt):
    cfg = tiny_config(critic_lr=3e-3, micro_batch_size=2)
    critic = _critic(tiny_ckpt, cfg)
    base = synthetic_samples([14, 9, 20, 7, 11, 16])
    losses = []
    for _ in range(15):
        m = critic.train_step(_with_targets(critic, cfg, base), batching_config(cfg))
        losses.append(m.value_loss)
    assert m.lr == pytest.approx(3e-3) and m.num_steps == 1
    assert losses[-1] < 0.2 * losses[0], losses


# ---------------------------------------------------------------- two gloo ranks = one process

LENGTHS = [40, 20, 12, 10, 9, 8, 7, 6, 5, 4]
MAX_TOKENS = 24
# two optimizer steps: the second is clipped around values the first step moved (--value-clip 0.01)
SCENARIOS = {"default_agg": {"num_steps_per_rollout": 2, "value_clip": 0.01, "clip_grad": 0.0},
             "per_token": {"calculate_per_token_loss": True, "clip_grad": 1.0}}


def run_scenario(ckpt: str, name: str, distributed: bool) -> dict:
    overrides = SCENARIOS[name]
    if distributed:
        cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu=str(MAX_TOKENS), **overrides)
    else:
        cfg = tiny_config(micro_batch_size=1, **overrides)
    critic = _critic(ckpt, cfg)
    samples = _with_targets(critic, cfg, synthetic_samples(LENGTHS))
    metrics = critic.train_step(samples, batching_config(cfg))
    weights = {n: p.full_tensor().detach().clone() for n, p in critic.model.named_parameters()}
    return {"values": [s.values for s in samples], "metrics": metrics, "weights": weights}


def _worker(ckpt: str, out: str) -> None:
    results = {name: run_scenario(ckpt, name, distributed=True) for name in SCENARIOS}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def two_rank_results(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("critic_fsdp") / "results.pt"
    launch_local(_worker, 2, str(tiny_ckpt), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_match_one_process(name, tiny_ckpt, two_rank_results):
    ref, got = run_scenario(str(tiny_ckpt), name, distributed=False), two_rank_results[name]
    for a, b in zip(got["values"], ref["values"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for field in ("value_loss", "value_clipfrac", "explained_variance", "grad_norm"):
        assert getattr(got["metrics"], field) == pytest.approx(getattr(ref["metrics"], field), rel=1e-5, abs=1e-7), field
    if name == "default_agg":
        assert ref["metrics"].value_clipfrac > 0 and ref["metrics"].num_steps == 2
    # atol 1e-6: the sharded sum differs from the single one in float order, which a clip coefficient of
    # ~1/560 and AdamW's normalisation can lift to ~1.4e-7 on one weight (an AMD EPYC CI machine); one
    # AdamW update at lr 1e-3 moves a weight ~1e-3, so a real mismatch is still 1000x over this
    for n, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][n], w, rtol=1e-5, atol=1e-6, msg=n)


# ---------------------------------------------------------------- flags

@pytest.mark.parametrize("flags,needle", [
    (["--value-clip", "0"], "--value-clip"),
    (["--advantage-estimator", "grpo", "--num-critic-only-steps", "1"], "--num-critic-only-steps"),
    (["--critic-load", "x"], "--critic-load"),
    (["--kl-coef", "0.1"], "--kl-coef"),
])
def test_bad_critic_flags_name_the_flag(flags, needle):
    argv = ["--hf-checkpoint", "c", "--prompt-data", "d", "--rm-type", "math", "--advantage-estimator", "ppo", *flags]
    with pytest.raises(ValueError, match=f"^{needle}:"):
        parse_config(argv)


# ---------------------------------------------------------------- furlong train --advantage-estimator ppo

def _ppo(a: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    return _resume_flags(a, out, num_rollout, "--advantage-estimator", "ppo", "--critic-lr", "1e-3",
                         "--num-critic-only-steps", "1", *extra)


def test_ppo_end_to_end_warm_up_and_exact_resume(assets, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(_ppo(assets, tmp_path / "fresh", 3, "--save", str(tmp_path / "fresh_ck"))) == 0
    assert main(_ppo(assets, tmp_path / "first", 2, "--save", str(ck), "--save-interval", "1")) == 0
    assert sorted(p.name for p in (tmp_path / "ck_critic").iterdir()) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt", "run_id.txt"]
    assert main(_ppo(assets, tmp_path / "resumed", 3, "--load", str(ck))) == 0
    fresh, resumed = read_metrics(tmp_path / "fresh"), read_metrics(tmp_path / "resumed")
    for r in fresh:
        assert isinstance(r["critic/value_loss"], float) and r["critic/value_loss"] > 0
        assert "critic/explained_variance" in r and r["critic/lr"] == pytest.approx(1e-3)
    assert "train/loss" not in fresh[0] and "train/loss" in fresh[1]    # rollout 1 trains the critic only
    # the actor did not move in rollout 1: rollout 2's engine log-probs come from the initial weights too,
    # and with the critic's checkpoint restored a resumed run repeats the step exactly (bit-identical on CPU)
    assert [r["step"] for r in resumed] == [2]
    for key in ("critic/value_loss", "critic/explained_variance", "critic/grad_norm", "train/loss",
                "train/grad_norm", "rollout/rollout_log_probs"):
        assert fresh[2][key] == resumed[0][key], key
    # a resume whose critic checkpoint is missing is one line naming --critic-load (nothing trained)
    shutil.rmtree(tmp_path / "ck_critic" / "iter_0000002")
    capsys.readouterr()
    assert main(_ppo(assets, tmp_path / "again", 3, "--load", str(ck))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("furlong: error: --critic-load:") and len(err.splitlines()) == 1, err


def test_ppo_learns(assets, tmp_path, capsys):
    """The learning check of the other estimators (test_e2e.py), for ppo with a critic trained from
    scratch alongside: eight rollouts must raise the share of 'e' in the responses several-fold."""
    out = tmp_path / "run"
    argv = _resume_flags(assets, out, 8, "--advantage-estimator", "ppo", "--normalize-advantages",
                         "--rollout-batch-size", "8", "--n-samples-per-prompt", "8")
    argv[argv.index("--custom-rm-path") + 1] = "tests.rewards_for_tests.letter_reward"
    argv[argv.index("--lr") + 1] = "1e-2"
    argv[argv.index("--rollout-max-response-len") + 1] = "8"
    assert main(argv) == 0, capsys.readouterr().err
    rows = read_metrics(out)
    rewards = [r["rollout/raw_reward"] for r in rows]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > 0.2 and last > 4 * first, rewards

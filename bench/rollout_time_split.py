"""Where a rollout's time goes (device): every engine step timed, fitted as fixed + per-row + per-token costs.

The bench's rollout part (forced lengths, random weights), after a warm-up at 1/16 of its lengths that
captures every batch bucket's graphs (those of split counts only longer contexts use excepted), run
with each engine step's counters read around it (EngineStats: decode steps, rows,
attended context tokens, seconds; every step ends in a host sync, so its wall time is its device time
plus the host's scheduling). The decode windows are fitted by least squares as

    seconds per decode step = a + b * padded rows + c * attended tokens

a: the step's fixed cost (kernel launches and latencies of 28 layers, the host's share); b: what each
(bucket-padded) row adds (matmul rows, sampler, KV write); c: attention, whose implied bandwidth is
the KV bytes per token / c. Summed over the run's steps they split its seconds three ways. A fit, not
a profile, and over the long rollout a loose one: its rows and contexts fall together, so fixed and
attention costs trade off between fits of equal quality (fp8 on an H100: 62.7 s = ~11 s fixed + ~50 s
attention at an implied 2.67 TB/s, R^2 0.97; the same rollout under the other split rule fitted as 17 +
42 s).

    python3 bench/rollout_time_split.py [--workload bench/long_workload.json] [--kv-dtype fp8_e4m3,bf16]
        [--split-rule waves,programs] [--fp8-kernel padded,transposed,transposed-all] [--overlap-rows 0,64]
        [--out DIR]
        -> rollout_time_split.json, rollout_time_split.png
"""
from __future__ import annotations

import argparse
import bisect
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class StepSample:
    """One engine step that ran a decode window (a prefill mixed behind it included)."""
    num_steps: int          # decode steps in the window
    num_rows: int           # running rows
    padded_rows: int        # the batch bucket the window's graphs ran at
    context_tokens: int     # tokens attended per step, summed over rows (mean over the window)
    seconds: float          # the engine step's wall time
    prefill: bool           # a prefill ran in the same step
    captured: bool = False  # a CUDA graph was captured in it (a bucket the warm-up missed): not fitted


@dataclass
class TimeSplit:
    fixed_ms_per_step: float
    ms_per_row: float
    ns_per_context_token: float
    implied_attention_tb_s: float | None    # None: the fit gave attention no positive cost
    r2: float
    seconds: float          # all steps' seconds (prefill-only steps included)
    fixed_s: float
    rows_s: float
    attention_s: float
    residual_s: float       # seconds - the three terms (prefill-only steps, misfit)
    steady_seconds: float   # seconds with each window that captured a graph counted at its fit instead:
                            # the rollout as later ones run it (graphs are kept between rollouts)


def fit_time_split(samples: list[StepSample], kv_bytes_per_token: float, other_seconds: float = 0.0) -> TimeSplit:
    """Least squares over the decode windows (those without a graph capture), each weighted by its
    number of steps; the other steps' seconds are the residual's."""
    dec = [s for s in samples if s.num_steps > 0 and not s.captured]
    if len(dec) < 3:
        raise ValueError(f"rollout_time_split: {len(dec)} decode windows, need at least 3 to fit three costs")
    w = torch.tensor([s.num_steps for s in dec], dtype=torch.float64)
    x = torch.tensor([[1.0, s.padded_rows, s.context_tokens] for s in dec], dtype=torch.float64)
    y = torch.tensor([s.seconds / s.num_steps for s in dec], dtype=torch.float64)
    sw = w.sqrt()[:, None]
    coef = torch.linalg.lstsq(x * sw, y[:, None] * sw).solution[:, 0]
    pred = x @ coef
    mean = (w * y).sum() / w.sum()
    r2 = 1 - float((w * (y - pred) ** 2).sum() / (w * (y - mean) ** 2).sum().clamp_min(1e-30))
    a, b, c = (float(v) for v in coef)
    steps = float(w.sum())
    fixed_s, rows_s = a * steps, b * float((w * x[:, 1]).sum())
    attention_s = c * float((w * x[:, 2]).sum())
    total = sum(s.seconds for s in samples) + other_seconds
    captured = [s for s in samples if s.num_steps > 0 and s.captured]
    steady = total - sum(s.seconds - s.num_steps * (a + b * s.padded_rows + c * s.context_tokens) for s in captured)
    return TimeSplit(fixed_ms_per_step=a * 1e3, ms_per_row=b * 1e3, ns_per_context_token=c * 1e9,
                     implied_attention_tb_s=kv_bytes_per_token / c / 1e12 if c > 0 else None, r2=r2,
                     seconds=total, fixed_s=fixed_s, rows_s=rows_s, attention_s=attention_s,
                     residual_s=total - fixed_s - rows_s - attention_s, steady_seconds=steady)


def traced_generate(engine, requests) -> list[StepSample]:
    """engine.generate's loop with each step's counters read around it."""
    for r in requests:
        engine.add(r)
    buckets = engine.runner.buckets
    out = []
    while engine.has_work():
        st = engine.stats
        before = (st.num_decode_steps, st.num_decode_rows, st.num_context_tokens, st.seconds, st.num_prefill_steps)
        graphs = len(engine.runner.graphs)
        engine.step()
        steps, rows, ctx = (st.num_decode_steps - before[0], st.num_decode_rows - before[1],
                            st.num_context_tokens - before[2])
        num_rows = rows // steps if steps else 0
        padded = buckets[bisect.bisect_left(buckets, num_rows)] if engine.runner.use_cuda_graphs and steps else num_rows
        out.append(StepSample(num_steps=steps, num_rows=num_rows, padded_rows=padded,
                              context_tokens=ctx // steps if steps else 0, seconds=st.seconds - before[3],
                              prefill=st.num_prefill_steps > before[4],
                              captured=len(engine.runner.graphs) > graphs))
    return out


def tb_s(f: TimeSplit) -> str:
    return "n/a TB/s" if f.implied_attention_tb_s is None else f"{f.implied_attention_tb_s:.2f} TB/s"


def plot(samples_by_run: dict[str, list[StepSample]], fits: dict[str, TimeSplit], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run, samples in samples_by_run.items():
        f = fits[run]
        t, xs, ys, fit = 0, [], [], []
        for s in samples:
            if s.num_steps:
                xs.append(t)
                ys.append(s.seconds / s.num_steps * 1e3)
                fit.append(f.fixed_ms_per_step + f.ms_per_row * s.padded_rows + f.ns_per_context_token * 1e-6 * s.context_tokens)
            t += s.num_steps
        line, = ax.plot(xs, ys, lw=0.8, label=f"{run}: measured ({f.seconds:.1f} s)")
        ax.plot(xs, fit, lw=1.5, ls="--", color=line.get_color(),
                label=f"{run}: fit {f.fixed_ms_per_step:.2f} ms + rows + attention at {tb_s(f)}")
    ax.set_xlabel("decode step")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Rollout: time per decode step and its fit (fixed + per row + per attended token)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from furlong.bench.generation_parts import _rollout_requests, make_engine
    from furlong.bench.state import Bench
    from furlong.bench.workload import load_workload
    from furlong.engine.kv_cache import FP8_KERNELS
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="bench/long_workload.json")
    ap.add_argument("--kv-dtype", default="fp8_e4m3,bf16")
    ap.add_argument("--split-rule", default="programs",
                    help="the decode kernel's split rules to run, each on the same engine (splits.py): waves,programs")
    ap.add_argument("--fp8-kernel", default="transposed-all",
                    help="an fp8 cache's decode kernels to run, each on the same engine (kv_cache.FP8_KERNELS): "
                         "padded, transposed, transposed-all (the engine's); bf16 runs the padded one")
    ap.add_argument("--overlap-rows", default="0",
                    help="ModelRunner.overlap_min_rows values to run, each on the same engine (overlap.py; 0: off, "
                         "the engine's default): windows with at least that many rows run as two halves on two "
                         "streams")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    try:
        overlaps = [int(x) for x in a.overlap_rows.split(",")]
        if min(overlaps) < 0:
            raise ValueError
    except ValueError:
        ap.error(f"--overlap-rows: a comma-separated list of integers >= 0, got {a.overlap_rows!r}")
    if set(a.fp8_kernel.split(",")) - set(FP8_KERNELS):
        ap.error(f"--fp8-kernel: a comma-separated list of {', '.join(FP8_KERNELS)}, got {a.fp8_kernel!r}")
    w = load_workload(a.workload)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # keyed by run: '<kv dtype> <split rule>[ <fp8 kernel>][ halves>=<rows>]'
    samples_by_run, fits, report = {}, {}, {}
    for kv in a.kv_dtype.split(","):
        b = Bench(w, kv_dtype=kv)
        g = torch.Generator().manual_seed(b.seed + 2)
        prompts = [torch.randint(0, b.args.vocab_size, (p,), generator=g).tolist() for p in w.prompt_lens]
        engine = make_engine(b, max(w.prompt_lens) + max(w.response_lens))
        kernels = a.fp8_kernel.split(",") if kv == "fp8_e4m3" else ["padded"]
        for rule, kernel, overlap in ((r, k, o) for r in a.split_rule.split(",") for k in kernels for o in overlaps):
            name = (f"{kv} {rule}" + ("" if kernel == "padded" else f" {kernel}")
                    + (f" halves>={overlap}" if overlap else ""))
            engine.runner.split_rule = rule
            engine.runner.fp8_kernel = kernel          # in the graph key: each kernel's graphs
            engine.runner.overlap_min_rows = overlap   # so is whether a window runs as halves
            # warm-up: the same rows at 1/16 of their lengths finish in the same order, so the batch passes
            # through the same buckets and captures most graphs the timed rollout replays (not those of
            # split counts only longer contexts pick: their windows are left out of the fit)
            warm = _rollout_requests(b, prompts, seed=1)
            for r in warm:
                r.sample_max_new_tokens = [max(1, x // 16) for x in r.sample_max_new_tokens]
            started = time.perf_counter()
            engine.generate(warm)
            engine.release()
            print(f"{name}: warm-up rollout {time.perf_counter() - started:.1f} s (graph captures)", flush=True)
            engine.reset_stats()
            samples = traced_generate(engine, _rollout_requests(b, prompts, seed=0))
            engine.release()
            per_token = engine.runner.page_bytes() / engine.runner.page_size
            split = fit_time_split(samples, per_token)
            samples_by_run[name], fits[name] = samples, split
            report[name] = dict(split=asdict(split), kv_bytes_per_token=per_token, steps=[asdict(s) for s in samples])
            print(f"{name}: {split.seconds:.1f} s (steady {split.steady_seconds:.1f} s) = fixed {split.fixed_s:.1f} "
                  f"({split.fixed_ms_per_step:.3f} ms/step) + rows {split.rows_s:.1f} ({split.ms_per_row * 1e3:.2f} "
                  f"us/row) + attention {split.attention_s:.1f} (at {tb_s(split)}) + residual {split.residual_s:.1f}; "
                  f"R^2 {split.r2:.3f}; {sum(x.captured for x in samples)} windows with a graph capture left out "
                  f"of the fit", flush=True)
        del engine, b
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    (out / "rollout_time_split.json").write_text(json.dumps(report))
    plot(samples_by_run, fits, out / "rollout_time_split.png")
    print(f"wrote {out / 'rollout_time_split.json'} and {out / 'rollout_time_split.png'}")


if __name__ == "__main__":
    main()

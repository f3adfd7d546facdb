"""`furlong bench --workload FILE`: one RL step of a workload, timed part by part (docs/design.md §9).

The workload file (bench/seed_workload.json) fixes the model config, prompt
lengths, forced response lengths, train settings and a decode probe. Weights are
random (seeded, std 0.02) and token ids are random: this measures speed only.
Parts, run in this order: train, hf, rollout, decode, eval, trl, budget (each in
try/except under a time guard, so one call always ends with a table and a JSON,
rewritten after every part):
  train, budget, hf      train_parts.py (actor step, budget sweep, HF fwd+bwd)
  rollout, decode, eval  generation_parts.py (engine rollout, decode probe vs. HF, eval probe)
  trl                    trl_part.py (TRL's GRPOTrainer step vs. furlong's, one fixed response length)
One concept per module:
  workload.py   the workload file: parsing, validation, part names
  measure.py    synchronized timing, peak memory, time guards (PartTimeout)
  state.py      the run's shared state (device, seeded models, Config, samples)
  report.py     result dataclasses, step summary, table, JSON
  runner.py     run_bench: the part registry PARTS, guards, the time budget
"""
from furlong.bench.measure import PartTimeout, time_guard, timed
from furlong.bench.report import (BudgetResult, BudgetRow, DecodeResult, HfTrainResult, PartReport, RolloutResult,
                                  StepSummary, TrainResult, TrlResult, format_table, step_summary)
from furlong.bench.runner import PART_GUARD_S, PARTS, run_bench
from furlong.bench.state import Bench, NullTokenizer, build_hf_model
from furlong.bench.train_parts import hf_micro_batches
from furlong.bench.workload import DEFAULT_BUDGETS, PART_ORDER, Workload, load_workload, parse_parts

__all__ = [
    "DEFAULT_BUDGETS", "PARTS", "PART_GUARD_S", "PART_ORDER", "Bench", "BudgetResult", "BudgetRow", "DecodeResult",
    "HfTrainResult", "NullTokenizer", "PartReport", "PartTimeout", "RolloutResult", "StepSummary", "TrainResult",
    "TrlResult", "Workload", "build_hf_model", "format_table", "hf_micro_batches", "load_workload", "parse_parts",
    "run_bench", "step_summary", "time_guard", "timed",
]

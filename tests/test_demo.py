"""`furlong demo --quick`: the whole pipeline (data, tokenizer, model, SFT, GRPO, eval) runs and reports.

The full-size demo (accuracy rising under GRPO, ~7 minutes on 2 cores) is measured by hand
and quoted in the closing notes; this checks the plumbing at a scale CI can afford.
"""
import re
import subprocess
import sys


def test_quick_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "furlong", "demo", "--quick", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"demo: held-out accuracy \d+\.\d% -> \d+\.\d% \(\d+s\)", last), last
    assert (out / "sft_model" / "model.safetensors").is_file()
    assert (out / "grpo" / "metrics.jsonl").is_file()
    assert "[sft " in proc.stdout and "[rollout 2/2]" in proc.stdout

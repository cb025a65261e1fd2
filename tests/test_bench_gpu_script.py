"""bench/kernels_gpu.py --smoke: the whole GPU-benchmark script path, on CPU under the Triton interpreter.

The cases run the script's ``main([...])`` in ONE fresh subprocess (module fixture ``runs``), because
TRITON_INTERPRET must be set before triton is first imported (another test may already have imported it in
this process): the smoke run first, then each planted bug, each restored before the next run, each run's
exit status and stdout/stderr captured on its own (one interpreter instead of four: ≈ 2 s of imports each).
The smoke mode checks every variant's output and gradients against a float64 reference and exits
non-zero past 1e-4; ``test_smoke_fails_on_wrong_fused_op`` and ``test_smoke_fails_on_wrong_multi_op`` show
that check bites (the latter for the multi-client ``lora_linear_multi`` measurement). The same check decides
the exit status of a GPU run (``check_results``, tested here on fabricated rows: a wrong result, a NaN
error or a NaN timing must fail it).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "kernels_gpu.py"

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
              pytest.mark.xdist_group("kernels_gpu_script")]  # one worker computes the module fixture `runs`

# loads the script as a module and calls main(argv) once per job, in order; each job's patch (optional)
# runs first, with `kernels` imported, and is undone (the two ops restored) after its run
_RUNNER = """
import contextlib, importlib.util, io, json, sys, time
spec = importlib.util.spec_from_file_location("kernels_gpu", {script!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
from fedlora import kernels
results = {{}}
for name, patch, argv in json.loads({jobs!r}):
    saved = (kernels.lora_linear_triton, kernels.lora_linear_multi)
    exec(patch, {{"kernels": kernels}})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = mod.main(argv)
    finally:
        kernels.lora_linear_triton, kernels.lora_linear_multi = saved
    results[name] = {{"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "end": time.time()}}
print(json.dumps(results))
"""

NUMERIC = ("ms", "TB/s", "TFLOP/s", "%HBM", "%peak", "fused_vs_eager_rel_err", "rel_err", "grad_rel_err")


class _Proc:
    """One main() call's exit status and output, as subprocess.run gave them."""

    def __init__(self, res: dict):
        self.returncode, self.stdout, self.stderr = res["rc"], res["stdout"], res["stderr"]


def _run_all(jobs, timeout=300) -> tuple[dict, float, dict]:
    """Runs ``jobs`` [(name, patch, argv)] in one fresh interpreter; returns ({name: _Proc}, its start time, {name: raw result})."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "FEDLORA_KERNELS": "triton", "FEDLORA_KERNELS_POISON": "1",
           "OMP_NUM_THREADS": "1"}
    code = _RUNNER.format(script=str(SCRIPT), jobs=json.dumps([[n, p, [str(a) for a in argv]] for n, p, argv in jobs]))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"the runner failed: rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.splitlines()[-1])
    return {name: _Proc(res) for name, res in results.items()}, t0, results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The smoke run, then each planted bug (``_WRONG_*`` below) on the small case: {name: (_Proc, out dir, s)}."""
    root = tmp_path_factory.mktemp("kernels_gpu")
    small = ["--smoke", "--M", "17", "--ranks", "4+2"]
    jobs = [("smoke", "", ["--smoke", "--out", root / "smoke"]),
            ("fwd", _WRONG_FWD, [*small, "--out", root / "fwd"]),
            ("grad", _WRONG_GRAD, [*small, "--out", root / "grad"]),
            ("multi", _WRONG_MULTI, [*small, "--out", root / "multi"])]
    procs, t0, raw = _run_all(jobs)
    return {name: (procs[name], root / name, raw[name]["end"] - t0) for name in procs}


@pytest.mark.long
def test_smoke_runs_whole_script_on_cpu_interpreter(runs):
    proc, out, elapsed = runs["smoke"]  # elapsed: from the interpreter's start to the end of this run
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # its time is printed, not asserted: speed goals live in bench/, and a timed test fails on a loaded machine

    jsons, mds = sorted(out.glob("kernels_gpu_*.json")), sorted(out.glob("kernels_gpu_*.md"))
    assert len(jsons) == 1 and len(mds) == 1, sorted(p.name for p in out.iterdir())
    meta = json.loads(jsons[0].read_text())
    assert meta["device"] == "CPU interpreter smoke" and meta["smoke"] is True
    assert meta["dtype"] == "fp32" and "timings meaningless" in meta["note"]
    assert meta["failures"] == []
    assert math.isfinite(meta["ceiling_hbm_TBps"]) and math.isfinite(meta["ceiling_fp32_TFLOPs"])

    # one row per (M, d, ranks, variant, pass); compile baseline skipped in smoke mode
    expected = set(itertools.product([1, 17], [32], [(4, 2), (8, 0)], ["fused", "cublas", "eager", "base"],
                                     ["fwd", "fwd+bwd"]))
    keys = [(r["M"], r["d"], (r["r"], r["r_client"]), r["variant"], r["pass"]) for r in meta["rows"]]
    assert len(keys) == len(set(keys)) and set(keys) == expected, sorted(set(keys) ^ expected)
    for row in meta["rows"]:
        assert row["device"] == "CPU interpreter smoke"
        for k in NUMERIC:
            assert isinstance(row[k], float) and math.isfinite(row[k]), (k, row)
        assert row["ms"] > 0
        assert row["rel_err"] <= 1e-4 and row["grad_rel_err"] <= 1e-4, row

    # multi-client: K = 2 segments, only where r̃ > 0 and M ≥ K → (M=17, 4+2), both passes, both variants
    assert meta["multi_K"] == 2 and meta["multi_goal_ratio"] == 1.2
    multi = meta["multi_rows"]
    assert sorted((r["variant"], r["M"], r["d"], r["r"], r["r_client"], r["pass"]) for r in multi) == [
        (v, 17, 32, 4, 2, p) for v in ("multi", "multi_cublas") for p in ("fwd", "fwd+bwd")], multi
    for row in multi:
        assert row["K"] == 2 and row["seg_offsets"] == [0, 8, 17], row
        single_variant = {"multi": "fused", "multi_cublas": "cublas"}[row["variant"]]
        for k in ("ms", "single_ms", "multi_over_single", "rel_err", "grad_rel_err"):
            assert isinstance(row[k], float) and math.isfinite(row[k]), (k, row)
        assert row["ms"] > 0 and row["single_ms"] > 0
        assert math.isclose(row["multi_over_single"], row["ms"] / row["single_ms"])
        fused_ms = [f["ms"] for f in meta["rows"] if f["variant"] == single_variant and f["pass"] == row["pass"]
                    and (f["M"], f["d"], f["r"], f["r_client"]) == (row["M"], row["d"], row["r"], row["r_client"])]
        assert fused_ms == [row["single_ms"]], (fused_ms, row)  # one client's fused op, same M rows
        assert row["rel_err"] <= 1e-4 and row["grad_rel_err"] <= 1e-4, row

    md = mds[0].read_text()
    assert md.startswith("# fused LoRA linear — CPU interpreter smoke")
    assert "smoke: CPU interpreter, timings meaningless" in md
    main_md, _, multi_md = md.partition("## multi-client")
    table = [ln for ln in main_md.splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| pass | M | d | r+r̃ | fused ms | cublas ms |")
    assert len(table) == 1 + 2 * 2 * 2  # header + pass × M × ranks (d fixed)
    m_table = [ln for ln in multi_md.splitlines() if ln.startswith("| ")]
    assert m_table[0].startswith("| pass | variant | M | d | r+r̃ | K | multi ms | single ms | multi/single |"), \
        multi_md
    assert len(m_table) == 1 + 4 and all(
        ln.startswith(tuple(f"| {p} | {v} | 17 | 32 | 4+2 | 2 |" for p in ("fwd", "fwd+bwd")
                            for v in ("triton", "cublas"))) for ln in m_table[1:])
    print(f"smoke run: {elapsed:.1f} s")


# the fused op with a plausible bug: forward drops the client adapter / backward scales dX by 1.001
_WRONG_FWD = """
def _wrong(x, w, bias, a, b, s1=1.0, c=None, d=None, s2=1.0, **kw):
    return kernels.lora_linear_reference(x, w, bias, a, b, s1)
kernels.lora_linear_triton = _wrong
"""
_WRONG_GRAD = """
_orig = kernels.lora_linear_triton
def _wrong(x, *args, **kw):
    x = x + (1e-3 * x - (1e-3 * x).detach())  # same values, dX scaled by 1.001
    return _orig(x, *args, **kw)
kernels.lora_linear_triton = _wrong
"""


@pytest.mark.parametrize("name,bad_passes", [("fwd", {"fwd", "fwd+bwd"}), ("grad", {"fwd+bwd"})],
                         ids=["fwd", "grad"])
@pytest.mark.long
def test_smoke_fails_on_wrong_fused_op(runs, name, bad_passes):
    proc, tmp_path, _ = runs[name]  # the smoke run on M=17, ranks 4+2 with _WRONG_FWD / _WRONG_GRAD
    assert proc.returncode == 1, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "check(s) FAILED" in proc.stderr, proc.stderr[-3000:]
    meta = json.loads(next(tmp_path.glob("kernels_gpu_*.json")).read_text())
    # only the broken op's variants (fused and cublas both call lora_linear_triton) are flagged, in exactly
    # the passes the bug affects
    flagged = {f.split()[1] for f in meta["failures"]}
    assert {f.split()[0] for f in meta["failures"]} == {"fused", "cublas"}, meta["failures"]
    assert flagged == bad_passes, meta["failures"]


# the multi-client op with a plausible bug: every segment uses client 0's adapter (C_0, D_0)
_WRONG_MULTI = """
_orig_multi = kernels.lora_linear_multi
def _wrong(x, weight, bias, a, b, c, d, seg_offsets, *args, **kw):
    K = c.shape[0]
    return _orig_multi(x, weight, bias, a, b, torch.cat([c[:1]] * K), torch.cat([d[:1]] * K), seg_offsets,
                       *args, **kw)
import torch
kernels.lora_linear_multi = _wrong
"""


@pytest.mark.long
def test_smoke_fails_on_wrong_multi_op(runs):
    proc, tmp_path, _ = runs["multi"]  # the smoke run on M=17, ranks 4+2 with _WRONG_MULTI
    assert proc.returncode == 1, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "check(s) FAILED" in proc.stderr, proc.stderr[-3000:]
    meta = json.loads(next(tmp_path.glob("kernels_gpu_*.json")).read_text())
    # only the multi-client measurement is flagged (output and gradients); the single-client variants pass
    flagged = {f.split()[1] for f in meta["failures"]}
    assert {f.split()[0] for f in meta["failures"]} == {"multi", "multi_cublas"}, meta["failures"]
    assert flagged == {"fwd", "fwd+bwd"}, meta["failures"]
    assert all(r["rel_err"] > 1e-4 and r["grad_rel_err"] > 1e-4 for r in meta["multi_rows"]), meta["multi_rows"]


def _load_script():
    from _run_helpers import load_script

    return load_script(str(SCRIPT.relative_to(ROOT)), "kernels_gpu_for_test")


def _row(variant="fused", p="fwd+bwd", ms=1.5, rel=1e-3, grad=2e-3, **extra):
    row = {"variant": variant, "pass": p, "M": 8192, "d": 4096, "r": 8, "r_client": 2, "ms": ms,
           "rel_err": rel, "grad_rel_err": grad}
    if variant.startswith("multi"):
        row["K"] = 8
    else:
        row.update({"TB/s": 1.0, "TFLOP/s": 100.0, "%HBM": 30.0, "%peak": 10.0})
    return {**row, **extra}


def test_check_results_fails_gpu_runs_on_wrong_results_and_nan_timings():
    """The exit decision of a GPU run (bf16 tolerance): fabricated rows, no GPU needed."""
    mod = _load_script()
    tol = mod.GPU_TOL
    good = [_row(), _row(p="fwd", grad=float("nan")), _row("multi_cublas", ms=2.0)]
    assert mod.check_results(good, [], tol) == [] and mod.check_results(good[:2], good[2:], tol) == []
    cases = {
        "wrong output": (_row(p="fwd", rel=0.3), "rel err 0.3"),
        "wrong gradient": (_row(grad=5 * tol), "rel err"),
        "error check raised (NaN error)": (_row(grad=float("nan")), "rel err nan"),
        "NaN timing": (_row(ms=float("nan")), "timing nan"),
        "NaN derived throughput": (_row(**{"TB/s": float("inf")}), "timing"),
        "zero time": (_row(ms=0.0), "timing 0.0"),
        "multi NaN timing": (_row("multi", ms=float("nan")), "multi fwd+bwd M=8192 d=4096 r=8+2 K=8"),
    }
    for name, (bad, msg) in cases.items():
        fails = mod.check_results(good + [bad], [], tol)
        assert len(fails) == 1 and msg in fails[0], (name, fails)
    # the forward row is judged on the output, the forward+backward row on the gradients
    assert mod.check_results([_row(p="fwd", rel=1e-3, grad=1.0)], [], tol) == []
    assert mod.check_results([_row(p="fwd+bwd", rel=1.0, grad=1e-3)], [], tol) == []

"""Ahead-of-time compile check for sm_90 (review issue 8, item 10): ``python -m fedlora.kernels.aot``.

``test_ci_subset_compiles_for_sm90`` runs the CI subset (the full sweep with FEDLORA_AOT_FULL=1) in a
fresh process without the interpreter: the real op, forward and backward, on meta tensors; with
``--each-config-once`` every config the autotuner keeps is compiled for GPUTarget('cuda', 90, 32) with the
bundled ptxas for one launch per (kernel, dtype, precision), and every launch (flag set) compiles at least
one config, until one fits (≈ 2/3 of the compiles of every (launch, config) pair, which
``python -m fedlora.kernels.aot`` without the flag does). It must exit 0 and write a table with registers,
spills and shared memory for every compiled config. The other
tests show the check bites: a shared-memory limit nothing fits, a config that fails to compile, and a
triton too old for the tool (a clear message and exit 2, not a traceback).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest


pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _triton_version():
    import importlib.metadata

    return tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2])


needs_39 = pytest.mark.skipif(importlib.util.find_spec("triton") is None or _triton_version() < (3, 9),
                              reason="fedlora.kernels.aot compiles through triton >= 3.9 APIs")


def _aot(args, timeout):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FEDLORA_KERNELS_POISON")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    # not from the repo root: `-m` puts the current folder first on sys.path (issue 18 §2)
    proc = subprocess.run([sys.executable, "-m", "fedlora.kernels.aot", *map(str, args)], cwd=tempfile.gettempdir(), env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


@needs_39
@pytest.mark.long
def test_ci_subset_compiles_for_sm90(tmp_path):
    from fedlora.kernels import aot

    full = os.environ.get("FEDLORA_AOT_FULL", "0") == "1"
    proc, elapsed = _aot(["--jobs", "2", "--each-config-once", "--out", tmp_path], timeout=7200 if full else 900)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((tmp_path / "aot_sm90.json").read_text())
    s = report["summary"]
    assert report["failures"] == [] and s["failed"] == 0
    cases = aot.full_cases() if full else aot.CI_CASES
    assert report["cases"] == len(cases) and report["mode"] == ("full sweep" if full else "CI subset")
    assert {r["case"] for r in report["rows"]} == {c.name for c in cases}
    # both kernels, every flavour the CI cases exercise, each launch with a config that fits
    flags = {(r["kernel"], r["flags"]) for r in report["rows"]}
    for kernel, flag in [("_lowrank_mm_kernel", "FUSE_SHRINK"), ("_lowrank_mm_kernel", "ACC_OUT"),
                         ("_lowrank_mm_kernel", "X_3D"), ("_lowrank_mm_kernel", "HAS_L"),
                         ("_seg_tn_kernel", "ATOMIC"), ("_seg_tn_kernel", "V_3D")]:
        assert any(k == kernel and flag in f.split(",") for k, f in flags), (kernel, flag)
    assert any(k == "_lowrank_mm_kernel" and "EQUAL_SEGS" not in f.split(",") for k, f in flags)  # offset scan
    assert any(k == "_seg_tn_kernel" and "ATOMIC" not in f.split(",") for k, f in flags)  # deterministic
    assert all(la["fit"] >= 1 for la in report["launches"])
    assert report["each_config_once"] is True and all(la["compiled"] >= 1 for la in report["launches"])
    for r in report["rows"]:
        assert 0 < r["regs"] <= 255 and r["shared"] > 0 and r["spill_stores"] >= 0, r
        assert r["fits"] == (r["shared"] <= aot.SMEM_LIMIT_H100)
    assert s["compiled_configs"] == len(report["rows"]) and s["max_regs"] == max(r["regs"] for r in report["rows"])
    md = (tmp_path / "aot_sm90.md").read_text()
    assert "| kernel | configs | binaries | max regs | configs with spills |" in md
    assert md.count("\n| ") >= len(report["rows"]) + 3
    print(f"AOT {report['mode']}: {s['compiled_configs']} configs in {elapsed:.0f} s; max regs {s['max_regs']}, "
          f"spilling {s['configs_with_spills']}, max shared {s['max_shared']} B")


@pytest.mark.long
@needs_39
def test_fails_when_no_config_fits_shared_memory(tmp_path):
    proc, _ = _aot(["--only", "fp16 M=1 d=1000", "--smem-limit", "4096", "--out", tmp_path], timeout=600)
    assert proc.returncode == 1, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "fits 4096 bytes of shared memory" in proc.stderr
    report = json.loads((tmp_path / "aot_sm90.json").read_text())
    assert report["failures"] and all(la["fit"] == 0 for la in report["launches"])


def test_compile_error_of_any_config_is_a_failure():
    """The hook compiles every pruned config and records each one that raises (no GPU, no ptxas needed)."""
    from fedlora.kernels import aot

    class Cfg:
        def __init__(self, bm):
            self.kwargs, self.num_warps, self.num_stages = {"BLOCK_M": bm}, 4, 3

        def all_kwargs(self):
            return {**self.kwargs, "num_warps": 4, "num_stages": 3}

    class Compiled:
        def __init__(self, bm):
            self.hash = f"h{bm}"
            self.metadata = type("Meta", (), {"shared": 1024 * bm})()

    class FakeJIT:
        def warmup(self, *args, grid, **kw):
            if kw["BLOCK_M"] == 64:
                raise RuntimeError("PassManager::run failed")
            print("ptxas info    : Used 40 registers, used 1 barriers\n"
                  "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads")
            return Compiled(kw["BLOCK_M"])

    class FakeAutotuner:
        arg_names = ["x_ptr", "M"]
        base_fn = type("F", (), {"__name__": "_fake_kernel"})
        fn = FakeJIT()
        nargs = None

        def prune_configs(self, kwargs):
            assert self.nargs == {"x_ptr": "X", "M": 7}  # pruning sees the launch's own arguments
            return [Cfg(16), Cfg(64), Cfg(300)]

    comp = aot.Compiler(90, smem_limit=100_000)
    comp.case = aot.CI_CASES[0]
    comp.hook(FakeAutotuner(), None, ("X", 7), {"HAS_W": True})
    assert len(comp.failures) == 1 and "compile error: RuntimeError: PassManager::run failed" in comp.failures[0]
    ok = [r for r in comp.rows if "error" not in r]
    assert [(r["BLOCK_M"], r["regs"], r["spill_stores"], r["fits"]) for r in ok] == [(16, 40, 8, True),
                                                                                      (300, 40, 8, False)]
    assert comp.launches[0]["fit"] == 1
    comp.smem_limit = 1  # same launch, but now no config fits
    comp.hook(FakeAutotuner(), None, ("X", 7), {})
    assert any("none of the 3 pruned configs fits 1 bytes" in f for f in comp.failures)


def test_each_config_once_compiles_new_configs_then_others_until_one_fits():
    """--each-config-once: a second launch of the same kernel and dtype compiles only its new configs, or,
    when it has none, the first config that fits; a launch none of whose configs fits still fails."""
    from fedlora.kernels import aot

    class Cfg:
        def __init__(self, bm):
            self.kwargs, self.num_warps, self.num_stages = {"BLOCK_M": bm}, 4, 3

        def all_kwargs(self):
            return {**self.kwargs, "num_warps": 4, "num_stages": 3}

    compiled = []

    class FakeJIT:
        def warmup(self, *args, grid, **kw):
            compiled.append(kw["BLOCK_M"])
            print("ptxas info    : Used 40 registers\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
            return type("C", (), {"hash": f"h{kw['BLOCK_M']}{sorted(kw)}", "metadata": type("M", (), {"shared": 100 * kw["BLOCK_M"]})()})()

    def autotuner(bms):
        return type("AT", (), {"arg_names": ["M"], "base_fn": type("F", (), {"__name__": "_k"}), "fn": FakeJIT(),
                               "nargs": None, "prune_configs": lambda self, kw: [Cfg(b) for b in bms]})()

    comp = aot.Compiler(90, smem_limit=10_000, each_config_once=True)  # shared = 100 × BLOCK_M
    comp.case = aot.CI_CASES[0]
    comp.hook(autotuner([16, 32, 64]), None, (7,), {"HAS_W": True})
    assert compiled == [16, 32, 64] and comp.launches[-1]["fit"] == 3
    compiled.clear()
    comp.hook(autotuner([64, 32, 8]), None, (7,), {"HAS_L": True})  # 8 is new and fits: only 8
    assert compiled == [8] and comp.launches[-1]["compiled"] == 1 and comp.launches[-1]["fit"] == 1
    compiled.clear()
    comp.hook(autotuner([16, 64, 128]), None, (7,), {})  # new 128 does not fit: then the others until one fits
    assert compiled == [128, 16] and comp.launches[-1]["fit"] == 1 and comp.failures == []
    compiled.clear()
    comp.hook(autotuner([128, 256]), None, (7,), {})  # none fits: the same failure as without the mode
    assert compiled == [256, 128] and any("none of the 2 pruned configs fits 10000 bytes" in f for f in comp.failures)
    comp.case = aot.CI_CASES[3]  # another dtype: every config again
    compiled.clear()
    comp.hook(autotuner([16, 32]), None, (7,), {"HAS_W": True})
    assert compiled == [16, 32]


def test_parse_ptxas_log():
    from fedlora.kernels.aot import parse_ptxas

    log = ("ptxas info    : Compiling entry function '_lowrank_mm_kernel' for 'sm_90a'\n"
           "ptxas info    : Function properties for _lowrank_mm_kernel\n"
           "    16 bytes stack frame, 148 bytes spill stores, 108 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert parse_ptxas(log) == {"regs": 255, "stack": 16, "spill_stores": 148, "spill_loads": 108}
    assert parse_ptxas("nothing here") is None


def test_old_triton_gets_a_message_not_a_traceback(monkeypatch, capsys):
    import triton

    from fedlora.kernels import aot

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    with pytest.raises(aot.AOTUnavailable, match=r"needs triton >= 3\.9 .* found triton 3\.6\.0"):
        aot.check_environment()
    assert aot.main(["--only", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora.kernels.aot: cannot compile ahead of time: needs triton >= 3.9") and "Traceback" not in err

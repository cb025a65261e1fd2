"""Choices the Triton path makes per call (review issue 8, items 7, 8, 11), tested on CPU.

* fp32 dot precision follows torch's CUDA matmul setting (item 7): ``select_precision``.
* Under ``torch.use_deterministic_algorithms(True)`` the split reductions of dA, dB write per-split
  partial sums summed in a fixed order instead of fp32 atomics (item 8); checked under the interpreter
  through the launches actually made, and against float64.
* Base-GEMM variant (item 11): 'triton' (GEMM in the Triton kernel) or 'cublas' (torch GEMM + Triton
  low-rank path), forced by argument or ``FEDLORA_KERNELS_BASE_GEMM``, or 'auto' timed once per shape
  bucket (``fedlora.kernels.base_gemm.Chooser``), here with a fake timer.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _kernel_helpers import _compare, _make, _oracle, recorded_launches

from fedlora.kernels import base_gemm as bg
from fedlora.kernels import lora_linear, lora_linear_multi, select_precision

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

LL = importlib.import_module("fedlora.kernels.lora_linear")  # the package attribute `lora_linear` is the op


# ------------------------------------------------------------------------------------------------
# item 7: fp32 precision
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def matmul_precision():
    old = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(old)


def test_precision_follows_torch_float32_matmul_setting(matmul_precision):
    f32, bf16 = torch.float32, torch.bfloat16
    torch.set_float32_matmul_precision("highest")  # torch's default: IEEE fp32 for cuBLAS too
    assert select_precision(f32, "cuda") == "ieee"
    for allowed in ("high", "medium"):
        torch.set_float32_matmul_precision(allowed)
        assert select_precision(f32, "cuda") == "tf32", allowed
        assert select_precision(f32, "cpu") == "ieee"  # the interpreter computes IEEE anyway
    assert select_precision(bf16, "cuda") == "tf32" and select_precision(bf16, "cpu") == "tf32"
    assert select_precision(f32, "cuda", "ieee") == "ieee"  # explicit argument wins
    torch.set_float32_matmul_precision("highest")
    assert select_precision(f32, "cuda", "tf32") == "tf32"
    with pytest.raises(ValueError, match="precision must be 'ieee' or 'tf32'"):
        select_precision(f32, "cuda", "fp64")


_NEW_API = textwrap.dedent("""
    import torch
    from fedlora.kernels import select_precision
    m = torch.backends.cuda.matmul
    out = []
    for setting in {settings!r}:
        torch.backends.fp32_precision = "none"  # back to the defaults, then one setting
        m.fp32_precision = "none"
        exec(setting)
        out.append(select_precision(torch.float32, "cuda"))
    print(",".join(out))
""")


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="torch < 2.9 has no fp32_precision API")
def test_precision_follows_torch_new_fp32_precision_api():
    """torch ≥ 2.9: after the new API is used, reading the legacy allow_tf32 raises; we must not."""
    settings = ["m.fp32_precision = 'tf32'", "m.fp32_precision = 'ieee'", "torch.backends.fp32_precision = 'tf32'",
                "torch.backends.fp32_precision = 'tf32'; m.fp32_precision = 'ieee'", "pass"]
    proc = subprocess.run([sys.executable, "-c", _NEW_API.format(settings=settings)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "tf32,ieee,tf32,ieee,ieee", proc.stdout


def test_launches_use_the_selected_precision():
    x, w, bb, a, b, c, d = _make(5, 12, 10, 2, 1)
    for prec, want in ((None, "ieee"), ("tf32", "tf32"), ("ieee", "ieee")):  # CPU: IEEE unless asked
        with recorded_launches() as seen:
            lora_linear(x, w, bb, a, b, 0.5, c, d, 2.0, backend="triton", precision=prec).sum().backward()
        assert seen and {kw["PRECISION"] for _, kw, _ in seen} == {want}, (prec, seen)


# ------------------------------------------------------------------------------------------------
# item 8: deterministic reductions
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def deterministic():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(old)


def _grads_recorded(fn, leaves):
    with recorded_launches() as seen:
        y = fn()
        g = torch.autograd.grad(y, leaves, torch.ones_like(y))
    return g, [kw for name, kw, _ in seen if name == "_seg_tn_kernel"]


@pytest.mark.parametrize("base_gemm", ["triton", "cublas"])
@pytest.mark.parametrize("op", ["single", "stacked", "multi"])
def test_deterministic_mode_takes_partial_sums_and_is_exact(op, base_gemm, deterministic):
    gen = torch.Generator().manual_seed(21)
    if op == "stacked":
        x, w, bb, a, b, c, d = _make(70, 30, 20, 4, 2, stack=2, gen=gen)
        fn = lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 2.0, backend="triton", base_gemm=base_gemm)  # noqa
        ref = lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0)  # noqa: E731
    elif op == "single":
        x, w, bb, a, b, c, d = _make(150, 30, 20, 4, 2, gen=gen)  # 150 rows: both of the 2 splits busy
        fn = lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 2.0, backend="triton", base_gemm=base_gemm)  # noqa
        ref = lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0)  # noqa: E731
    else:
        x, w, bb, a, b, _, _ = _make(90, 30, 20, 4, 0, gen=gen)
        c = torch.randn(3, 2, 30, generator=gen).requires_grad_()
        d = torch.randn(3, 20, 2, generator=gen).requires_grad_()
        offs = [0, 70, 70, 90]
        fn = lambda *t: lora_linear_multi(*t, offs, 0.5, 2.0, backend="triton", base_gemm=base_gemm)  # noqa
        ref = lambda *t: torch.cat([_oracle(t[0][offs[k]:offs[k + 1]], *t[1:5], 0.5, t[5][k], t[6][k], 2.0)  # noqa
                                    for k in range(3)])
    _compare(fn, ref, (x, w, bb, a, b, c, d))  # correct under deterministic mode (forward + every grad)
    leaves = [x, a, b, c, d]
    g1, tn1 = _grads_recorded(lambda: fn(x, w, bb, a, b, c, d), leaves)
    g2, _ = _grads_recorded(lambda: fn(x, w, bb, a, b, c, d), leaves)
    assert len(tn1) == 2 and all(kw["ATOMIC"] is False for kw in tn1), tn1  # dA and dB: partial sums
    assert all(torch.equal(p, q) for p, q in zip(g1, g2))  # bitwise run to run
    torch.use_deterministic_algorithms(False)
    _, tn3 = _grads_recorded(lambda: fn(x, w, bb, a, b, c, d), leaves)
    assert len(tn3) == 2 and all(kw["ATOMIC"] is True for kw in tn3), tn3  # default: fp32 atomics


def test_deterministic_pruning_keeps_split_within_the_partial_sum_buffer():
    """GPU config list: every config kept for ATOMIC=False has SPLIT ≤ DET_MAX_SPLIT (buffer slices)."""
    tk = LL._load_triton()
    import triton

    cfgs = [triton.Config({"BLOCK_P": bp, "BLOCK_Q": bq, "BLOCK_M": bm, "SPLIT": s}, num_warps=4)
            for bp, bq, bm, s in ((16, 128, 64, 1), (16, 128, 64, 4), (16, 128, 64, 16), (16, 256, 64, 8),
                                  (128, 16, 64, 8), (128, 16, 128, 16), (64, 64, 128, 1))]
    for P, Q, mb in ((10, 4096, 16384), (4096, 10, 16384), (10, 4096, 16), (4096, 10, 16), (1, 1, 16)):
        det = tk._prune_tn(cfgs, {"P": P, "Q": Q, "M_BUCKET": mb, "ATOMIC": False, "PRECISION": "tf32"})
        assert det and all(c.kwargs["SPLIT"] <= tk.DET_MAX_SPLIT for c in det), (P, Q, mb, det)
    big = tk._prune_tn(cfgs, {"P": 10, "Q": 4096, "M_BUCKET": 16384, "ATOMIC": True, "PRECISION": "tf32"})
    assert any(c.kwargs["SPLIT"] > tk.DET_MAX_SPLIT for c in big)  # the atomic path keeps its wide splits


# ------------------------------------------------------------------------------------------------
# item 11: base-GEMM variants and their choice
# ------------------------------------------------------------------------------------------------

def test_requested_base_gemm_argument_env_and_errors(monkeypatch):
    monkeypatch.delenv(bg.ENV_VAR, raising=False)
    assert bg.requested_base_gemm(None) == "auto"
    monkeypatch.setenv(bg.ENV_VAR, "cuBLAS")
    assert bg.requested_base_gemm(None) == "cublas"
    assert bg.requested_base_gemm("triton") == "triton"  # the argument beats the environment
    monkeypatch.setenv(bg.ENV_VAR, "cutlass")
    with pytest.raises(ValueError, match="FEDLORA_KERNELS_BASE_GEMM must be one of"):
        bg.requested_base_gemm(None)
    x, w, bb, a, b, _, _ = _make(3, 8, 6, 2, 0)
    with pytest.raises(ValueError, match="base_gemm"):
        lora_linear(x, w, bb, a, b, backend="triton", base_gemm="fast")


class FakeTimer:
    """Runs the variant once (it must work) and returns a preset time in ms."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, name, fn):
        fn()
        self.calls.append(name)
        t = self.times[name]
        if isinstance(t, Exception):
            raise t
        return t


def test_chooser_times_once_per_key_and_keeps_the_fastest():
    timer = FakeTimer({"triton": 2.0, "cublas": 1.5})
    ch = bg.Chooser(timer)
    runs = []
    runners = {"triton": lambda: runs.append("t"), "cublas": lambda: runs.append("c")}
    key = bg.shape_key(1000, 4096, 4096, 10, torch.bfloat16, "cuda:0", True)
    assert ch.choose(key, runners) == "cublas"
    assert ch.choose(key, runners) == "cublas" and timer.calls == ["triton", "cublas"] and runs == ["t", "c"]
    assert bg.shape_key(600, 4096, 4096, 10, torch.bfloat16, "cuda:0", True) == key  # same M bucket (1024)
    other = bg.shape_key(2048, 4096, 4096, 10, torch.bfloat16, "cuda:0", True)
    timer.times = {"triton": 1.0, "cublas": 1.5}
    assert ch.choose(other, runners) == "triton" and len(timer.calls) == 4
    assert ch.choose(key, runners) == "cublas"  # the first bucket's choice is kept
    for nan_or_error in (float("nan"), RuntimeError("out of resources")):
        timer.times = {"triton": 3.0, "cublas": nan_or_error}
        k = bg.shape_key(16, 64, 64, 2, torch.float16, "cuda:0", False)
        ch.clear()
        assert ch.choose(k, runners) == "triton" and math.isinf(ch.timings[k]["cublas"])


@pytest.fixture
def fake_timed_auto(monkeypatch):
    """'auto' times on CPU too (interpreter), with a fake timer; the env var is cleared."""
    monkeypatch.delenv(bg.ENV_VAR, raising=False)
    timer = FakeTimer({"triton": 1.0, "cublas": 0.5})
    monkeypatch.setattr(LL, "_CHOOSER", bg.Chooser(timer))
    monkeypatch.setattr(LL, "_TIMED_DEVICES", ("cuda", "cpu"))
    return timer


def _variant_of(seen) -> str:
    return "cublas" if any(kw["ACC_OUT"] for name, kw, _ in seen if name == "_lowrank_mm_kernel") else "triton"


@pytest.mark.parametrize("faster", ["triton", "cublas"])
def test_auto_runs_the_timed_choice_and_is_correct(fake_timed_auto, faster):
    timer = fake_timed_auto
    timer.times = {"triton": 1.0 if faster == "triton" else 2.0, "cublas": 1.0 if faster == "cublas" else 2.0}
    gen = torch.Generator().manual_seed(31)
    x, w, bb, a, b, c, d = _make(20, 24, 18, 3, 2, gen=gen)
    with recorded_launches() as seen:
        _compare(lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 2.0, backend="triton"),
                 lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0), (x, w, bb, a, b, c, d))
    assert timer.calls == ["triton", "cublas"]  # both timed once (forward + backward each) …
    n_timed = len(seen)
    assert _variant_of(seen) == "cublas"  # the timing run executed the cuBLAS variant too
    with recorded_launches() as seen2:
        y = lora_linear(x, w, bb, a, b, 0.5, c, d, 2.0, backend="triton")
        y.sum().backward()
    assert timer.calls == ["triton", "cublas"], timer.calls  # … then cached for the bucket
    assert _variant_of(seen2) == faster and n_timed > len(seen2)
    with recorded_launches() as seen3:  # M = 25: same bucket (32), no new timing
        lora_linear(x.detach()[:15].repeat(2, 1)[:25], w, bb, a, b, 0.5, c, d, 2.0, backend="triton").sum()
    assert timer.calls == ["triton", "cublas"] and _variant_of(seen3) == faster


@pytest.mark.parametrize("forced", ["triton", "cublas"])
def test_forced_variant_skips_timing(fake_timed_auto, monkeypatch, forced):
    timer = fake_timed_auto
    x, w, bb, a, b, c, d = _make(9, 16, 12, 2, 1)
    for how in ("argument", "env"):
        if how == "env":
            monkeypatch.setenv(bg.ENV_VAR, forced)
            kw = {}
        else:
            kw = {"base_gemm": forced}
        with recorded_launches() as seen:
            lora_linear(x, w, bb, a, b, 0.5, c, d, 2.0, backend="triton", **kw).sum().backward()
        assert timer.calls == [] and _variant_of(seen) == forced, (how, seen)


def test_auto_is_untimed_triton_in_deterministic_mode(fake_timed_auto, deterministic):
    x, w, bb, a, b, c, d = _make(9, 16, 12, 2, 1)
    with recorded_launches() as seen:
        lora_linear(x, w, bb, a, b, 0.5, c, d, 2.0, backend="triton").sum().backward()
    assert fake_timed_auto.calls == [] and _variant_of(seen) == "triton"


def test_no_base_weight_needs_no_choice(fake_timed_auto):
    x, _, bb, a, b, c, d = _make(9, 16, 12, 2, 1)
    with recorded_launches() as seen:
        lora_linear(x, None, bb, a, b, 0.5, c, d, 2.0, backend="triton").sum().backward()
    assert fake_timed_auto.calls == [] and _variant_of(seen) == "triton"


@pytest.mark.cpu_tensors
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton path on CPU tensors needs the interpreter (a FEDLORA_TEST_DEVICE=cuda run)")
def test_cpu_auto_without_timing_takes_triton(monkeypatch):
    monkeypatch.delenv(bg.ENV_VAR, raising=False)
    x, w, bb, a, b, c, d = _make(9, 16, 12, 2, 1)
    with recorded_launches() as seen:
        lora_linear(x, w, bb, a, b, 0.5, c, d, 2.0, backend="triton").sum().backward()
    assert _variant_of(seen) == "triton"


# ------------------------------------------------------------------------------------------------
# autotuning must not corrupt accumulating launches (ACC_OUT in place, TN reductions)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base_gemm", ["triton", "cublas"])
def test_autotuner_benchmark_runs_leave_accumulating_outputs_intact(monkeypatch, base_gemm):
    """Two configs and a benchmark that runs each twice, through triton's own Autotuner with the
    kernels' own reset_to_zero / restore_value lists: the in-place Y += S Bᵀ (cuBLAS variant) and the
    zeroed fp32 reductions of dA, dB (atomics and deterministic partial sums) must still be exact."""
    from triton.runtime.autotuner import Autotuner

    import triton

    tk = LL._load_triton()

    def bench(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        return [1.0, 1.0, 1.0]

    def retuned(real, configs):
        return Autotuner(real.fn, real.arg_names, configs, real.keys, real.reset_to_zero, real.restore_value,
                         do_bench=bench)

    mm_cfgs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=1)
               for bm in (16, 32)]
    tn_cfgs = [triton.Config({"BLOCK_P": 32, "BLOCK_Q": 64, "BLOCK_M": 32, "SPLIT": s}, num_warps=4, num_stages=1)
               for s in (1, 2)]
    monkeypatch.setattr(tk, "_lowrank_mm_kernel", retuned(tk._lowrank_mm_kernel, mm_cfgs))
    monkeypatch.setattr(tk, "_seg_tn_kernel", retuned(tk._seg_tn_kernel, tn_cfgs))
    gen = torch.Generator().manual_seed(41)
    x, w, bb, a, b, c, d = _make(70, 30, 20, 4, 2, gen=gen)
    fn = lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 2.0, backend="triton", fuse=False,  # noqa: E731
                                base_gemm=base_gemm)
    _compare(fn, lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0), (x, w, bb, a, b, c, d))
    old = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        x2, w2, bb2, a2, b2, c2, d2 = _make(71, 30, 20, 4, 2, gen=gen)  # new shapes: tuned again
        _compare(fn, lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0), (x2, w2, bb2, a2, b2, c2, d2))
    finally:
        torch.use_deterministic_algorithms(old)


def test_fp32_ieee_pruning_drops_the_tiles_that_spill():
    """GPU config list: under IEEE fp32 the tiles measured to spill on sm_90 (fedlora.kernels.aot) are never tried;
    under TF32 / 16-bit (tensor cores, operands in shared memory) they stay."""
    tk = LL._load_triton()
    import triton

    cfgs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=3)
            for bm, bn, bk, w in ((128, 256, 64, 8), (256, 128, 64, 8), (64, 128, 64, 4), (128, 16, 128, 4),
                                  (64, 64, 64, 4), (32, 128, 64, 4), (16, 64, 64, 4))]
    spill_free_r16 = {(64, 64), (32, 128), (16, 64)}  # measured: no spills with BLOCK_R = 16

    def kept(prec, **flags):
        args = {"N": 4096, "M_BUCKET": 8192, "PRECISION": prec, **flags}
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in tk._prune_mm(cfgs, args)}

    assert kept("ieee", HAS_L=True, BLOCK_R=16) == spill_free_r16
    assert kept("ieee", HAS_L=True, BLOCK_R=128) == {(16, 64)}  # 64×64, 32×128 spill with R = 128
    assert kept("tf32", HAS_L=True, BLOCK_R=16) == {(bm, bn) for bm, bn in
                                                   [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in cfgs]}

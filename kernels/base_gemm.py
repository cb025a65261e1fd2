"""Which base GEMM the Triton path runs: X W0ᵀ inside the Triton kernel, or cuBLAS.

Two variants of the same op (``fedlora.kernels.lora_linear_triton``, ``fedlora.kernels.lora_linear_multi``):

* ``'triton'`` — the base GEMM X W0ᵀ (and dY W0) runs inside the Triton kernel whose accumulator
  also takes the low-rank product (one pass writes Y); for small M even the shrink X A_catᵀ shares
  its K loop.
* ``'cublas'`` — the base GEMM is ``torch.nn.functional.linear`` / ``torch.mm`` (cuBLAS, bias in its
  epilogue); Triton only runs the low-rank path: S = X A_catᵀ, then Y += S B_catᵀ in place (and
  dS = dY B_cat, dX += dS A_cat, dA, dB in the backward). It costs an extra read + write of Y (and
  of dX) but uses the vendor GEMM.

``'auto'`` (the default; ``FEDLORA_KERNELS_BASE_GEMM`` or the ``base_gemm=`` argument override it)
picks per shape bucket by timing both on first use on CUDA (``Chooser``): key (M bucket, N, K,
R, dtype, device, backward needed), each variant warmed up (which also runs Triton's autotuning)
then timed, the faster one cached for the process. Off CUDA (the CPU interpreter) and while a CUDA
graph is being captured no timing happens: 'triton' (or the cached choice) is used; under
``torch.use_deterministic_algorithms(True)`` 'auto' is always 'triton' (a timed choice would make the
rounding depend on timing noise).
"""
from __future__ import annotations

import math
import os
import statistics

import torch

__all__ = ["BASE_GEMMS", "ENV_VAR", "requested_base_gemm", "Chooser", "cuda_event_timer", "m_bucket",
           "shape_key"]

BASE_GEMMS = ("auto", "triton", "cublas")
ENV_VAR = "FEDLORA_KERNELS_BASE_GEMM"


def requested_base_gemm(base_gemm: str | None) -> str:
    """The requested variant: ``base_gemm`` if given, else env ``FEDLORA_KERNELS_BASE_GEMM``, else 'auto'."""
    mode = (base_gemm or os.environ.get(ENV_VAR, "auto") or "auto").lower()
    if mode not in BASE_GEMMS:
        raise ValueError(f"lora_linear: base_gemm / {ENV_VAR} must be one of {BASE_GEMMS}, got {mode!r}")
    return mode


def m_bucket(n: int) -> int:
    """Token-count bucket (autotune keys, variant cache): next power of two, clipped to [16, 16384]."""
    n = max(int(n), 1)
    return min(max(16, 1 << (n - 1).bit_length()), 16384)


def shape_key(M, N, K, R, dtype, device, grad: bool) -> tuple:
    """Cache key of a variant choice: (M bucket, N, K, R, dtype, device, backward needed)."""
    return (m_bucket(M), int(N), int(K), int(R), str(dtype), str(device), bool(grad))


def cuda_event_timer(name, fn, warmup: int = 2, rep: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (after ``warmup`` untimed calls,
    the first of which runs Triton's autotuning); ``name`` is the variant (unused here)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


class Chooser:
    """First-use timing of the variants, cached per shape key.

    ``timer(name, fn) -> milliseconds`` (default ``cuda_event_timer``); a variant whose time is not
    finite (it failed, or the timer says NaN) never wins unless all do, then the first listed wins.
    """

    def __init__(self, timer=None):
        self.timer = timer or cuda_event_timer
        self.choices: dict[tuple, str] = {}
        self.timings: dict[tuple, dict[str, float]] = {}

    def choose(self, key: tuple, runners: dict) -> str:
        """The cached choice for ``key``, or time every ``runners[name]()`` once and cache the fastest."""
        hit = self.choices.get(key)
        if hit is not None:
            return hit
        times = {}
        for name, fn in runners.items():
            try:
                t = float(self.timer(name, fn))
            except Exception:  # a variant that cannot run at this shape simply loses
                t = math.inf
            times[name] = t if math.isfinite(t) else math.inf
        best = min(times, key=lambda n: times[n])  # ties and all-inf: first listed (dict order)
        self.choices[key] = best
        self.timings[key] = times
        return best

    def clear(self) -> None:
        self.choices.clear()
        self.timings.clear()

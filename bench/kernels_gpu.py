"""GPU benchmark of the fused LoRA linear (docs/design.md §7) — needs a CUDA device.

    python bench/kernels_gpu.py                 # full grid (bf16)
    python bench/kernels_gpu.py --quick         # M ∈ {16, 2048}, d = 4096
    python bench/kernels_gpu.py --M 1 128 --d 4096 --ranks 8+2
    python bench/kernels_gpu.py --smoke --out /tmp/smoke   # CPU, Triton interpreter, no GPU needed

For every (tokens M, d_in = d_out = d, rank r+r̃) it times, with ``triton.testing.do_bench``
(warm-up, median), forward and forward+backward of:

* ``fused``   — ``fedlora.kernels.lora_linear_triton`` with ``base_gemm='triton'`` (X W0ᵀ inside this package's
  Triton kernel, together with the low-rank path),
* ``cublas``  — ``fedlora.kernels.lora_linear_triton`` with ``base_gemm='cublas'`` (X W0ᵀ + b by cuBLAS, the
  low-rank path by Triton, added into Y in place): the other variant ``base_gemm='auto'`` may pick,
* ``eager``   — PEFT-style eager LoRA: F.linear(x, W0) + s·F.linear(F.linear(x, A), B) (+ client),
* ``compile`` — ``torch.compile`` of the eager function,
* ``base``    — the frozen base alone: X W0ᵀ forward, dX = dY W0 backward (the floor to beat).

Multi-client (``--K``, default 8; 2 with ``--smoke``): for every configuration with r̃ > 0 and M ≥ K,
``fedlora.kernels.lora_linear_multi`` (backend 'triton', one launch) on the same M rows split into K equal
segments (rows k·M//K … (k+1)·M//K − 1 use client k's own C_k, D_k; A, B and W0 shared; sizes
differ by one row when K ∤ M) is timed forward and forward+backward. ``multi/single`` is its time
over the single-client op's on the same M rows with the same base-GEMM variant (the ``fused`` or
``cublas`` row: ``lora_linear_triton`` with one client's C, D); both variants are measured
(``multi`` / ``multi_cublas``); the goal is ≤ 1.2 at K = 8, M = 8192, d = 4096, r = 8+2, bf16 (in
the default sweep). Its output and gradients (X, A, B, every C_k, D_k) are checked against a float64
reference made of K separate ``lora_linear_reference`` calls, one per segment. JSON: ``multi_rows``;
markdown: a second table, "multi-client".

Achieved TB/s (minimum-traffic byte model) and TFLOP/s are reported next to the device ceilings
measured here: peak HBM bandwidth from a large device-to-device copy, peak bf16 matmul TFLOP/s
from an 8192³ matmul. Every variant's forward output and gradients are also compared once (outside
the timing) with a float64 eager reference (``rel_err``, ``grad_rel_err``: max |got − ref| / max |ref|).
Results: printed, and written as JSON + markdown to bench/results/.

Exit status (every mode): 1 when any variant's output or gradient is off the float64 reference by
more than the tolerance (``--tol``; default 2e-2 for the bf16 GPU run — a few bf16 roundings (2⁻⁹
relative each) of operands, S and Y, with fp32 accumulation, stay below 1e-2 — and 1e-4 for the
fp32 smoke run), an error is NaN (its check raised), or a timing is not a finite positive number
(``check_results``); 2 when the benchmark cannot run here.

``--smoke`` runs the same code path on CPU under the Triton interpreter (TRITON_INTERPRET=1, set by
the script when triton is not imported yet) at tiny sizes (M ∈ {1, 17}, d = 32, ranks 4+2 and 8),
float32, no torch.compile baseline, a wall-clock median timer in place of ``do_bench`` and of the
device ceilings — timings are meaningless; the same checks and exit status as on the GPU (tolerance
1e-4). Files go to ``--out`` (default: a fresh temporary directory, never bench/results unless asked).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]  # results go to ROOT/bench/results; fedlora is imported
# as installed (`make env` or `pip install -e .`): the repo root is not put on sys.path, where its folder
# kernels/ would shadow HuggingFace's `kernels`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

M_ALL = [1, 16, 128, 2048, 8192]
D_ALL = [1024, 4096, 8192]
RANKS_ALL = [(8, 2), (16, 4), (64, 0)]  # (8, 2) × M = 8192 × d = 4096: the multi-client goal's configuration
K_GPU = 8  # clients in the multi-client measurement
MULTI_GOAL = 1.2  # multi-client (K = 8) time ≤ 1.2 × one client's op on the same total rows

SMOKE_M = [1, 17]
SMOKE_D = [32]
SMOKE_RANKS = ["4+2", "8"]
SMOKE_K = 2
SMOKE_TOL = 1e-4  # relative, float32 kernels vs float64 reference
GPU_TOL = 2e-2  # relative, bf16 (see the module docstring)
SMOKE_DEVICE = "CPU interpreter smoke"
SMOKE_NOTE = "smoke: CPU interpreter, timings meaningless"


def check_results(rows, multi_rows, tol: float) -> list[str]:
    """One message per failed check: error above ``tol`` or NaN, timing not finite and positive.

    ``rows``/``multi_rows`` as written to the JSON (``rel_err`` checks the forward rows,
    ``grad_rel_err`` the forward+backward rows). Used by every mode: a GPU run with a wrong result
    or a failed timing exits non-zero like the smoke run.
    """
    failures = []
    for row in list(rows) + list(multi_rows):
        what = (f"{row['variant']} {row['pass']} M={row['M']} d={row['d']} r={row['r']}+{row['r_client']}"
                + (f" K={row['K']}" if "K" in row else ""))
        err = row["grad_rel_err"] if row["pass"] == "fwd+bwd" else row["rel_err"]
        if not err <= tol:  # catches NaN too
            failures.append(f"{what}: rel err {err:.3g} > {tol:g}")
        timed = [row["ms"]] + [row[k] for k in ("TB/s", "TFLOP/s", "%HBM", "%peak") if k in row]
        if not (all(isinstance(t, (int, float)) and math.isfinite(t) for t in timed) and row["ms"] > 0):
            failures.append(f"{what}: non-finite or non-positive timing {row['ms']!r}")
    return failures


def _parse_rank(s: str):
    r, _, rc = s.partition("+")
    return int(r), int(rc or 0)


def measure_ceilings(do_bench):
    """Peak HBM TB/s (copy of 4 GiB: read + write) and peak bf16 matmul TFLOP/s (8192³)."""
    n = 1 << 30  # 1 Gi fp32 elements = 4 GiB
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda dst=dst, src=src: dst.copy_(src), warmup=10, rep=50, return_mode="median") * 1e-3
    hbm = 2 * src.numel() * src.element_size() / t / 1e12
    del src, dst
    k = 8192
    a = torch.randn(k, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, k, dtype=torch.bfloat16, device="cuda")
    t = do_bench(lambda a=a, b=b: a @ b, warmup=10, rep=50, return_mode="median") * 1e-3
    tflops = 2 * k ** 3 / t / 1e12
    del a, b
    torch.cuda.empty_cache()
    return hbm, tflops


def wall_median_ms(fn, warmup=1, rep=3):
    """Smoke-mode timer: plain wall-clock median (ms) of ``rep`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def smoke_ceilings():
    """Smoke-mode stand-ins for the device ceilings (small CPU copy and matmul; meaningless)."""
    src = torch.randn(1 << 20)
    dst = torch.empty_like(src)
    t = wall_median_ms(lambda: dst.copy_(src)) * 1e-3
    hbm = 2 * src.numel() * src.element_size() / t / 1e12
    k = 128
    a, b = torch.randn(k, k), torch.randn(k, k)
    t = wall_median_ms(lambda: a @ b) * 1e-3
    return hbm, 2 * k ** 3 / t / 1e12


def rel_err(got, ref) -> float:
    """max |got − ref| / max |ref| (inf when got has non-finite entries)."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape or not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def cost_model(M, d_in, d_out, R, esize, bwd):
    """(bytes, flops) of the minimum work: each operand read once, each result written once."""
    lora_params = R * (d_in + d_out)
    if not bwd:
        byts = (M * d_in + d_in * d_out + M * d_out + lora_params) * esize
        flops = 2 * M * d_in * d_out + 2 * M * R * (d_in + d_out)
    else:
        # fwd (X, W0, Y) + bwd (dY, W0 again, X again for dA, dX out, factor grads out)
        byts = (2 * M * d_in + 2 * d_in * d_out + M * d_out + M * d_out + M * d_in + 3 * lora_params) * esize
        flops = 4 * M * d_in * d_out + 6 * M * R * (d_in + d_out)
    return byts, flops


def base_cost(M, d_in, d_out, esize, bwd):
    if not bwd:
        return (M * d_in + d_in * d_out + M * d_out) * esize, 2 * M * d_in * d_out
    return (M * d_in + 2 * d_in * d_out + 2 * M * d_out + M * d_in) * esize, 4 * M * d_in * d_out


def make_call(fn, fn_args, inputs, gy, bwd):
    """The timed closure: ``fn(*fn_args)`` without autograd, or forward + ``autograd.grad`` wrt ``inputs``."""
    if not bwd:
        def call():
            with torch.no_grad():
                return fn(*fn_args)
    else:
        def call():
            return torch.autograd.grad(fn(*fn_args), inputs, gy)
    return call


def _prepare_smoke_env() -> str | None:
    """Smoke mode: the interpreter must be on before triton is first imported. Returns an error or None."""
    if "triton" in sys.modules:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return ("--smoke needs TRITON_INTERPRET=1 before triton is imported, and triton is already "
                    "imported in this process without it; run the script in a fresh process")
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("FEDLORA_KERNELS_POISON", "1")  # unwritten kernel outputs show up as NaN
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=None, help=f"default {M_ALL} ({SMOKE_M} with --smoke)")
    ap.add_argument("--d", type=int, nargs="+", default=None, help=f"default {D_ALL} ({SMOKE_D} with --smoke)")
    ap.add_argument("--ranks", nargs="+", default=None,
                    help=f"r+r̃ each; default {[f'{r}+{rc}' for r, rc in RANKS_ALL]} ({SMOKE_RANKS} with --smoke)")
    ap.add_argument("--quick", action="store_true", help="M ∈ {16, 2048}, d = 4096")
    ap.add_argument("--K", type=int, default=None,
                    help=f"clients in the multi-client measurement (default {K_GPU}; {SMOKE_K} with --smoke)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU + Triton interpreter, tiny sizes, float32, checks every variant against a float64 "
                         "reference (exit 1 past 1e-4); timings meaningless")
    ap.add_argument("--tol", type=float, default=None,
                    help=f"relative error tolerance (default {GPU_TOL:g} on the GPU in bf16, {SMOKE_TOL:g} with --smoke)")
    ap.add_argument("--out", default=None,
                    help="output directory (default bench/results; with --smoke a fresh temporary directory)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if smoke and args.quick:
        ap.error("--quick and --smoke exclude each other")

    if smoke:
        msg = _prepare_smoke_env()
        if msg:
            print(f"kernels_gpu.py: {msg}", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("kernels_gpu.py: no CUDA device available — this benchmark needs a GPU "
              "(run `pytest bench/ --benchmark-only` for the CPU reference microbenchmarks, or "
              "`python bench/kernels_gpu.py --smoke` for a CPU check of this script).", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.testing import do_bench
    except Exception as exc:  # pragma: no cover
        print(f"kernels_gpu.py: triton is not importable ({exc!r}); cannot benchmark the fused kernels.",
              file=sys.stderr)
        return 2

    from fedlora import kernels

    if smoke:
        from fedlora.kernels.lora_linear import _load_triton

        try:
            interp = _load_triton().INTERPRET
        except ValueError as exc:
            print(f"kernels_gpu.py: {exc}", file=sys.stderr)
            return 2
        if not interp:
            print("kernels_gpu.py: --smoke: the Triton kernels were loaded without the interpreter in this "
                  "process; run the script in a fresh process", file=sys.stderr)
            return 2

    if args.quick:
        args.M, args.d = [16, 2048], [4096]
    if args.M is None:
        args.M = SMOKE_M if smoke else M_ALL
    if args.d is None:
        args.d = SMOKE_D if smoke else D_ALL
    if args.ranks is None:
        args.ranks = SMOKE_RANKS if smoke else [f"{r}+{rc}" for r, rc in RANKS_ALL]
    ranks = [_parse_rank(s) for s in args.ranks]
    K = args.K if args.K is not None else (SMOKE_K if smoke else K_GPU)
    if K < 1:
        ap.error("--K must be ≥ 1")
    use_compile = not (args.no_compile or smoke)
    if use_compile:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    if smoke:
        torch.set_num_threads(1)  # tiny problems: thread spin-up costs more than it saves
        device, dtype, esize, dtype_name = "cpu", torch.float32, 4, "fp32"
        dev = SMOKE_DEVICE
        out = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="kernels_gpu_smoke_"))

        def timer(fn):
            return wall_median_ms(fn)

        timer_name = f"wall-clock median ({SMOKE_NOTE})"
        print(f"device: {dev} ({SMOKE_NOTE}); torch {torch.__version__}; triton {triton.__version__}; "
              f"dtype {dtype_name}")
        hbm, peak = smoke_ceilings()
        print(f"stand-in ceilings ({SMOKE_NOTE}): copy {hbm:.4f} TB/s, fp32 matmul {peak:.4f} TFLOP/s")
    else:
        device, dtype, esize, dtype_name = "cuda", torch.bfloat16, 2, "bf16"
        dev = torch.cuda.get_device_name()
        out = pathlib.Path(args.out) if args.out else ROOT / "bench" / "results"

        def timer(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")

        timer_name = "triton.testing.do_bench median"
        print(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; dtype {dtype_name}")
        hbm, peak = measure_ceilings(do_bench)
        print(f"measured ceilings: HBM {hbm:.2f} TB/s (copy), bf16 matmul {peak:.1f} TFLOP/s (8192³)")

    def errors(fn, fn_args, inputs, gy, y_ref, g_ref, label: str) -> tuple[float, float]:
        """Relative errors of ``fn(*fn_args)`` and of its gradients (cotangent ``gy``) wrt ``inputs``
        against the float64 references; a failure is reported and scored NaN (then exit 1)."""
        try:
            with torch.no_grad():
                v_err = rel_err(fn(*fn_args), y_ref)
            grads = torch.autograd.grad(fn(*fn_args), inputs, gy)
            return v_err, max(rel_err(gt, gr) for gt, gr in zip(grads, g_ref, strict=True))
        except Exception as exc:  # report, keep going
            print(f"  {label}: error check FAILED {exc!r}")
            return float("nan"), float("nan")

    def timed(call, label: str) -> float:
        """Median ms of ``call``; a failure is reported and timed as NaN (the run goes on, then exits 1)."""
        try:
            return timer(call)
        except Exception as exc:  # report, keep going
            print(f"  {label}: FAILED {exc!r}")
            return float("nan")

    def eager(x, w, a, b, s1, c, d, s2):
        y = F.linear(x, w) + F.linear(F.linear(x, a), b) * s1
        if c is not None:
            y = y + F.linear(F.linear(x, c), d) * s2
        return y

    compiled = torch.compile(eager, dynamic=False) if use_compile else None

    def fused(x, w, a, b, s1, c, d, s2):
        return kernels.lora_linear_triton(x, w, None, a, b, s1, c, d, s2, base_gemm="triton")

    def fused_cublas(x, w, a, b, s1, c, d, s2):
        return kernels.lora_linear_triton(x, w, None, a, b, s1, c, d, s2, base_gemm="cublas")

    def base(x, w, a, b, s1, c, d, s2):
        return F.linear(x, w)

    def multi(x, w, a, b, s1, ck, dk, s2, offs, base_gemm="triton"):
        return kernels.lora_linear_multi(x, w, None, a, b, ck, dk, offs, s1, s2, backend="triton",
                                         base_gemm=base_gemm)

    variants = [("fused", fused), ("cublas", fused_cublas), ("eager", eager)] + (
        [("compile", compiled)] if compiled is not None else []) + [("base", base)]
    multi_variants = [("multi", "triton", "fused"), ("multi_cublas", "cublas", "cublas")]
    rows, multi_rows = [], []
    tol = args.tol if args.tol is not None else (SMOKE_TOL if smoke else GPU_TOL)
    g = torch.Generator(device=device).manual_seed(0)
    for d_ in args.d:
        w = (torch.randn(d_, d_, device=device, generator=g, dtype=torch.float32) / d_ ** 0.5).to(dtype)
        for r, rc in ranks:
            a = (torch.randn(r, d_, device=device, generator=g) / d_ ** 0.5).to(dtype).requires_grad_()
            b = (torch.randn(d_, r, device=device, generator=g) * 0.1).to(dtype).requires_grad_()
            c = dd = None
            if rc:
                c = (torch.randn(rc, d_, device=device, generator=g) / d_ ** 0.5).to(dtype).requires_grad_()
                dd = (torch.randn(d_, rc, device=device, generator=g) * 0.1).to(dtype).requires_grad_()
            ck = dk = None  # the K clients' own adapters, for the multi-client measurement
            if rc and any(M >= K for M in args.M):
                ck = (torch.randn(K, rc, d_, device=device, generator=g) / d_ ** 0.5).to(dtype).requires_grad_()
                dk = (torch.randn(K, d_, rc, device=device, generator=g) * 0.1).to(dtype).requires_grad_()
            R = r + rc
            for M in args.M:
                x = torch.randn(M, d_, device=device, generator=g, dtype=torch.float32).to(dtype).requires_grad_()
                gy = torch.randn(M, d_, device=device, generator=g, dtype=torch.float32).to(dtype)
                with torch.no_grad():  # sanity: fused vs eager in the benchmark dtype
                    ref = eager(x, w, a, b, 0.5, c, dd, 2.0).float()
                    got = fused(x, w, a, b, 0.5, c, dd, 2.0).float()
                    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                # float64 oracle (same operands, upcast): outputs and gradients, for every variant
                lora_in = [t for t in (x, a, b, c, dd) if t is not None]
                x64, w64, a64, b64, gy64 = (t.detach().double().requires_grad_(t.requires_grad)
                                            for t in (x, w, a, b, gy))
                c64 = None if c is None else c.detach().double().requires_grad_()
                d64 = None if dd is None else dd.detach().double().requires_grad_()
                ref64 = {}
                for kind, y64, ins64 in (
                        ("lora", eager(x64, w64, a64, b64, 0.5, c64, d64, 2.0),
                         [t for t in (x64, a64, b64, c64, d64) if t is not None]),
                        ("base", F.linear(x64, w64), [x64])):
                    ref64[kind] = (y64.detach(), torch.autograd.grad(y64, ins64, gy64))
                for name, fn in variants:
                    inputs = [x] if name == "base" else lora_in
                    y_ref, g_ref = ref64["base" if name == "base" else "lora"]
                    v_err, g_err = errors(fn, (x, w, a, b, 0.5, c, dd, 2.0), inputs, gy, y_ref, g_ref,
                                          f"{name} M={M} d={d_} r={r}+{rc}")
                    for bwd in (False, True):
                        ms = timed(make_call(fn, (x, w, a, b, 0.5, c, dd, 2.0), inputs, gy, bwd),
                                   f"{name} M={M} d={d_} r={r}+{rc} bwd={bwd}")
                        byts, flops = (base_cost(M, d_, d_, esize, bwd) if name == "base"
                                       else cost_model(M, d_, d_, R, esize, bwd))
                        t = ms * 1e-3
                        row = {"device": dev, "variant": name, "pass": "fwd+bwd" if bwd else "fwd",
                               "M": M, "d": d_, "r": r, "r_client": rc, "ms": ms,
                               "TB/s": byts / t / 1e12, "TFLOP/s": flops / t / 1e12,
                               "%HBM": 100 * byts / t / 1e12 / hbm, "%peak": 100 * flops / t / 1e12 / peak,
                               "fused_vs_eager_rel_err": err, "rel_err": v_err,
                               "grad_rel_err": g_err}
                        rows.append(row)
                        e_row = g_err if bwd else v_err
                        print(f"{name:8s} {row['pass']:8s} M={M:5d} d={d_:5d} r={r}+{rc}: {ms:8.4f} ms "
                              f"{row['TB/s']:6.2f} TB/s ({row['%HBM']:5.1f}%) {row['TFLOP/s']:7.1f} TFLOP/s "
                              f"({row['%peak']:5.1f}%)  err={e_row:.1e}")
                if ck is not None and M >= K:
                    offs = [k * M // K for k in range(K + 1)]
                    ck64, dk64 = (t.detach().double().requires_grad_() for t in (ck, dk))
                    m_in, m_in64 = [x, a, b, ck, dk], [x64, a64, b64, ck64, dk64]
                    y64 = torch.cat([kernels.lora_linear_reference(x64[offs[k]:offs[k + 1]], w64, None, a64, b64,
                                                                   0.5, ck64[k], dk64[k], 2.0) for k in range(K)])
                    g64 = torch.autograd.grad(y64, m_in64, gy64)
                    m_args = (x, w, a, b, 0.5, ck, dk, 2.0, offs)
                    for m_name, m_bg, single_name in multi_variants:
                        m_fn = (lambda *t, _bg=m_bg: multi(*t, base_gemm=_bg))
                        m_err, m_gerr = errors(m_fn, m_args, m_in, gy, y64, g64, f"{m_name} M={M} d={d_} r={r}+{rc} K={K}")
                        for bwd in (False, True):
                            p_name = "fwd+bwd" if bwd else "fwd"
                            ms = timed(make_call(m_fn, m_args, m_in, gy, bwd),
                                       f"{m_name} M={M} d={d_} r={r}+{rc} K={K} bwd={bwd}")
                            # one client's op on the same M rows, same base-GEMM variant = the row timed above
                            # (same operands); a broken single op is flagged by its own rows, here it only
                            # makes the ratio NaN
                            single = next(rw["ms"] for rw in rows if rw["variant"] == single_name
                                          and rw["pass"] == p_name
                                          and (rw["M"], rw["d"], rw["r"], rw["r_client"]) == (M, d_, r, rc))
                            ratio = ms / single if single else float("nan")
                            row = {"device": dev, "variant": m_name, "base_gemm": m_bg, "pass": p_name,
                                   "M": M, "d": d_, "r": r, "r_client": rc, "K": K, "seg_offsets": offs,
                                   "ms": ms, "single_ms": single, "multi_over_single": ratio,
                                   "rel_err": m_err, "grad_rel_err": m_gerr}
                            multi_rows.append(row)
                            e_row = m_gerr if bwd else m_err
                            print(f"{m_name:12s} {p_name:8s} M={M:5d} d={d_:5d} r={r}+{rc} K={K}: {ms:8.4f} ms vs "
                                  f"single client {single:8.4f} ms = {ratio:5.2f}×  err={e_row:.1e}")
                    del y64, g64
                    del ck64, dk64, m_in, m_in64, m_args
                del x, gy, x64, w64, a64, b64, c64, d64, gy64, ref64
            if not smoke:
                torch.cuda.empty_cache()

    out.mkdir(parents=True, exist_ok=True)
    failures = check_results(rows, multi_rows, tol)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", dev).strip("_").lower()
    stamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    meta = {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "dtype": dtype_name,
            "ceiling_hbm_TBps": hbm, f"ceiling_{dtype_name}_TFLOPs": peak, "timer": timer_name,
            "smoke": smoke, "rows": rows, "multi_K": K, "multi_goal_ratio": MULTI_GOAL, "multi_rows": multi_rows,
            "tolerance": tol, "failures": failures}
    if smoke:
        meta.update(note=SMOKE_NOTE)
    (out / f"kernels_gpu_{slug}_{stamp}.json").write_text(json.dumps(meta, indent=1))
    verdict = (f"Errors vs a float64 reference, tolerance {tol:g}: "
               f"{'all within' if not failures else f'{len(failures)} FAILED'}.")
    if smoke:
        intro = (f"**{SMOKE_NOTE}.** torch {torch.__version__}, triton {triton.__version__} (TRITON_INTERPRET=1), "
                 f"fp32, d_in = d_out = d; stand-in ceilings (small CPU copy / matmul): {hbm:.4f} TB/s, "
                 f"{peak:.4f} TFLOP/s. Times: wall-clock median (ms). {verdict}")
    else:
        intro = (f"torch {torch.__version__}, triton {triton.__version__}, bf16, d_in = d_out = d; ceilings measured "
                 f"here: HBM {hbm:.2f} TB/s (copy), bf16 matmul {peak:.1f} TFLOP/s. Times: do_bench median (ms). "
                 f"{verdict}")
    lines = [f"# fused LoRA linear — {dev}", "", intro, "",
             "fused: base GEMM inside the Triton kernel; cublas: cuBLAS base GEMM + Triton low-rank path "
             "(`base_gemm=`).", "",
             ("| pass | M | d | r+r̃ | fused ms | cublas ms | eager ms | compile ms | base ms | fused/base | "
              "cublas/base | fused TB/s (%HBM) | fused TFLOP/s (%peak) | max rel err |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = {}
    for row in rows:
        key.setdefault((row["pass"], row["M"], row["d"], row["r"], row["r_client"]), {})[row["variant"]] = row
    for (p, M, d_, r, rc), v in key.items():
        f_, u_, e_, c_, b_ = (v.get(n, {}).get("ms", float("nan"))
                              for n in ("fused", "cublas", "eager", "compile", "base"))
        fr = v.get("fused", {})
        errs = [(row["grad_rel_err"] if p == "fwd+bwd" else row["rel_err"]) for row in v.values()]
        max_err = max(errs, key=lambda e: float("inf") if math.isnan(e) else e)  # NaN ranks highest
        ratio = f_ / b_ if b_ else float("nan")
        ratio_u = u_ / b_ if b_ else float("nan")
        lines.append(f"| {p} | {M} | {d_} | {r}+{rc} | {f_:.4f} | {u_:.4f} | {e_:.4f} | {c_:.4f} | {b_:.4f} | "
                     f"{ratio:.2f} | {ratio_u:.2f} | "
                     f"{fr.get('TB/s', float('nan')):.2f} ({fr.get('%HBM', float('nan')):.0f}%) | "
                     f"{fr.get('TFLOP/s', float('nan')):.1f} ({fr.get('%peak', float('nan')):.0f}%) | "
                     f"{max_err:.1e} |")
    lines += ["", "## multi-client", "",
              (f"`lora_linear_multi`, K = {K} equal (±1) row segments (own C_k, D_k each; shared A, B, W0; one launch) "
               f"vs the single-client op with the same base-GEMM variant on the same M rows. Goal: multi/single ≤ "
               f"{MULTI_GOAL:g} at K = 8, M = 8192, d = 4096, r = 8+2 (bf16). Max rel err: output (fwd) or "
               f"gradients (fwd+bwd) vs K float64 reference calls."), ""]
    if multi_rows:
        lines += ["| pass | variant | M | d | r+r̃ | K | multi ms | single ms | multi/single | max rel err |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in multi_rows:
            e_row = row["grad_rel_err"] if row["pass"] == "fwd+bwd" else row["rel_err"]
            lines.append(f"| {row['pass']} | {row['base_gemm']} | {row['M']} | {row['d']} | {row['r']}+{row['r_client']} | "
                         f"{row['K']} | {row['ms']:.4f} | {row['single_ms']:.4f} | {row['multi_over_single']:.2f} | "
                         f"{e_row:.1e} |")
    else:
        lines.append(f"(no configuration with r̃ > 0 and M ≥ K = {K})")
    md = "\n".join(lines) + "\n"
    (out / f"kernels_gpu_{slug}_{stamp}.md").write_text(md)
    print()
    print(md)
    print(f"written: {out}/kernels_gpu_{slug}_{stamp}.{{json,md}}")
    if failures:
        print(f"kernels_gpu.py{' --smoke' if smoke else ''}: {len(failures)} check(s) FAILED (tolerance {tol:g}):",
              file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark of the fused LoRA linear (SPEC §7) — needs a CUDA device.

    python bench/kernels_gpu.py                 # full grid (bf16)
    python bench/kernels_gpu.py --quick         # M ∈ {16, 2048}, d = 4096
    python bench/kernels_gpu.py --M 1 128 --d 4096 --ranks 8+2

For every (tokens M, d_in = d_out = d, rank r+r̃) it times, with ``triton.testing.do_bench``
(warm-up, median), forward and forward+backward of:

* ``fused``   — ``kernels.lora_linear_triton`` (this package's Triton kernels),
* ``eager``   — PEFT-style eager LoRA: F.linear(x, W0) + s·F.linear(F.linear(x, A), B) (+ client),
* ``compile`` — ``torch.compile`` of the eager function,
* ``base``    — the frozen base alone: X W0ᵀ forward, dX = dY W0 backward (the floor to beat).

Achieved TB/s (minimum-traffic byte model) and TFLOP/s are reported next to the device ceilings
measured here: peak HBM bandwidth from a large device-to-device copy, peak bf16 matmul TFLOP/s
from an 8192³ matmul. Results: printed, and written as JSON + markdown to bench/results/.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

M_ALL = [1, 16, 128, 2048, 8192]
D_ALL = [1024, 4096, 8192]
RANKS_ALL = [(8, 2), (16, 4), (64, 0)]


def _parse_rank(s: str):
    r, _, rc = s.partition("+")
    return int(r), int(rc or 0)


def measure_ceilings(do_bench):
    """Peak HBM TB/s (copy of 4 GiB: read + write) and peak bf16 matmul TFLOP/s (8192³)."""
    n = 1 << 30  # 1 Gi fp32 elements = 4 GiB
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median") * 1e-3
    hbm = 2 * src.numel() * src.element_size() / t / 1e12
    del src, dst
    k = 8192
    a = torch.randn(k, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, k, dtype=torch.bfloat16, device="cuda")
    t = do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median") * 1e-3
    tflops = 2 * k ** 3 / t / 1e12
    del a, b
    torch.cuda.empty_cache()
    return hbm, tflops


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=M_ALL)
    ap.add_argument("--d", type=int, nargs="+", default=D_ALL)
    ap.add_argument("--ranks", nargs="+", default=[f"{r}+{rc}" for r, rc in RANKS_ALL])
    ap.add_argument("--quick", action="store_true", help="M ∈ {16, 2048}, d = 4096")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("kernels_gpu.py: no CUDA device available — this benchmark needs a GPU "
              "(run `pytest bench/ --benchmark-only` for the CPU reference microbenchmarks).", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.testing import do_bench
    except Exception as exc:  # pragma: no cover
        print(f"kernels_gpu.py: triton is not importable ({exc!r}); cannot benchmark the fused kernels.",
              file=sys.stderr)
        return 2

    import kernels

    if args.quick:
        args.M, args.d = [16, 2048], [4096]
    ranks = [_parse_rank(s) for s in args.ranks]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    dev = torch.cuda.get_device_name()
    dtype = torch.bfloat16
    esize = 2
    print(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; dtype bf16")
    hbm, peak = measure_ceilings(do_bench)
    print(f"measured ceilings: HBM {hbm:.2f} TB/s (copy), bf16 matmul {peak:.1f} TFLOP/s (8192³)")

    def eager(x, w, a, b, s1, c, d, s2):
        y = F.linear(x, w) + F.linear(F.linear(x, a), b) * s1
        if c is not None:
            y = y + F.linear(F.linear(x, c), d) * s2
        return y

    compiled = None if args.no_compile else torch.compile(eager, dynamic=False)

    def fused(x, w, a, b, s1, c, d, s2):
        return kernels.lora_linear_triton(x, w, None, a, b, s1, c, d, s2)

    def base(x, w, a, b, s1, c, d, s2):
        return F.linear(x, w)

    variants = [("fused", fused), ("eager", eager)] + ([("compile", compiled)] if compiled else []) + [
        ("base", base)]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for d_ in args.d:
        w = (torch.randn(d_, d_, device="cuda", generator=g, dtype=torch.float32) / d_ ** 0.5).to(dtype)
        for r, rc in ranks:
            a = (torch.randn(r, d_, device="cuda", generator=g) / d_ ** 0.5).to(dtype).requires_grad_()
            b = (torch.randn(d_, r, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()
            c = dd = None
            if rc:
                c = (torch.randn(rc, d_, device="cuda", generator=g) / d_ ** 0.5).to(dtype).requires_grad_()
                dd = (torch.randn(d_, rc, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()
            R = r + rc
            for M in args.M:
                x = torch.randn(M, d_, device="cuda", generator=g, dtype=torch.float32).to(dtype).requires_grad_()
                gy = torch.randn(M, d_, device="cuda", generator=g, dtype=torch.float32).to(dtype)
                with torch.no_grad():  # sanity: fused vs eager in bf16
                    ref = eager(x, w, a, b, 0.5, c, dd, 2.0).float()
                    got = fused(x, w, a, b, 0.5, c, dd, 2.0).float()
                    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                for name, fn in variants:
                    for bwd in (False, True):
                        if not bwd:
                            def call(fn=fn):
                                with torch.no_grad():
                                    return fn(x, w, a, b, 0.5, c, dd, 2.0)
                        else:
                            inputs = [x] if name == "base" else [t for t in (x, a, b, c, dd) if t is not None]

                            def call(fn=fn, inputs=inputs):
                                y = fn(x, w, a, b, 0.5, c, dd, 2.0)
                                return torch.autograd.grad(y, inputs, gy)
                        try:
                            ms = do_bench(call, warmup=25, rep=100, return_mode="median")
                        except Exception as exc:  # report, keep going
                            print(f"  {name} M={M} d={d_} r={r}+{rc} bwd={bwd}: FAILED {exc!r}")
                            ms = float("nan")
                        byts, flops = (base_cost(M, d_, d_, esize, bwd) if name == "base"
                                       else cost_model(M, d_, d_, R, esize, bwd))
                        t = ms * 1e-3
                        row = {"device": dev, "variant": name, "pass": "fwd+bwd" if bwd else "fwd",
                               "M": M, "d": d_, "r": r, "r_client": rc, "ms": ms,
                               "TB/s": byts / t / 1e12, "TFLOP/s": flops / t / 1e12,
                               "%HBM": 100 * byts / t / 1e12 / hbm, "%peak": 100 * flops / t / 1e12 / peak,
                               "fused_vs_eager_rel_err": err}
                        rows.append(row)
                        print(f"{name:8s} {row['pass']:8s} M={M:5d} d={d_:5d} r={r}+{rc}: {ms:8.4f} ms "
                              f"{row['TB/s']:6.2f} TB/s ({row['%HBM']:5.1f}%) {row['TFLOP/s']:7.1f} TFLOP/s "
                              f"({row['%peak']:5.1f}%)  err={err:.1e}")
                del x, gy
            torch.cuda.empty_cache()

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", dev).strip("_").lower()
    stamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    meta = {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "dtype": "bf16",
            "ceiling_hbm_TBps": hbm, "ceiling_bf16_TFLOPs": peak, "timer": "triton.testing.do_bench median",
            "rows": rows}
    (out / f"kernels_gpu_{slug}_{stamp}.json").write_text(json.dumps(meta, indent=1))
    lines = [f"# fused LoRA linear — {dev}", "",
             f"torch {torch.__version__}, triton {triton.__version__}, bf16, d_in = d_out = d; ceilings measured "
             f"here: HBM {hbm:.2f} TB/s (copy), bf16 matmul {peak:.1f} TFLOP/s. Times: do_bench median (ms).", "",
             "| pass | M | d | r+r̃ | fused ms | eager ms | compile ms | base ms | fused/base | fused TB/s (%HBM) "
             "| fused TFLOP/s (%peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    key = {}
    for row in rows:
        key.setdefault((row["pass"], row["M"], row["d"], row["r"], row["r_client"]), {})[row["variant"]] = row
    for (p, M, d_, r, rc), v in key.items():
        f_, e_, c_, b_ = (v.get(n, {}).get("ms", float("nan")) for n in ("fused", "eager", "compile", "base"))
        fr = v.get("fused", {})
        lines.append(f"| {p} | {M} | {d_} | {r}+{rc} | {f_:.4f} | {e_:.4f} | {c_:.4f} | {b_:.4f} | {f_ / b_:.2f} | "
                     f"{fr.get('TB/s', float('nan')):.2f} ({fr.get('%HBM', float('nan')):.0f}%) | "
                     f"{fr.get('TFLOP/s', float('nan')):.1f} ({fr.get('%peak', float('nan')):.0f}%) |")
    md = "\n".join(lines) + "\n"
    (out / f"kernels_gpu_{slug}_{stamp}.md").write_text(md)
    print()
    print(md)
    print(f"written: {out}/kernels_gpu_{slug}_{stamp}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of per-sample LoRA gradients (issue 29 item 2): our rank-r einsums (``per_sample_lora_grads``) against
ghost clipping's per-example norms (Li, Tramèr, Liang, Hashimoto, ICLR 2022: ‖Σ_t g_tᵀ x_t‖² = Σ_{t,t'} (x_t·x_t')
(g_t·g_t'), two (n, T, T) Gram matrices per linear map; for LoRA the two maps x→h = xAᵀ and h→sBᵀh) and against
materialising the per-example full-weight gradient (n, d_out, d_in). Numbers, not assertions.

    python bench/dp_persample_memory.py [--n 8] [--T 128 512 2048] [--d 768] [--r 8] [--device cpu|cuda]

Each measurement runs in a fresh process. CPU: the peak resident set (ru_maxrss) above the one after the inputs x, g,
A, B exist; CUDA: ``torch.cuda.max_memory_allocated`` above the inputs. The result is what the computation itself
allocates, in MiB (float32).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _measure(kind: str, n: int, T: int, d: int, r: int, device: str) -> float:
    import resource

    import torch

    from fedlora.privacy.clipping import per_sample_lora_grads  # imported before the baseline

    torch.set_num_threads(1)
    dev = torch.device(device)
    g0 = torch.Generator().manual_seed(0)
    x = torch.randn(n, T, d, generator=g0).to(dev)
    g = torch.randn(n, T, d, generator=g0).to(dev)
    A = torch.randn(r, d, generator=g0).to(dev)
    B = torch.randn(d, r, generator=g0).to(dev)
    # warm up the kernels the three use on tiny inputs, so that their one-time set-up is in the baseline
    per_sample_lora_grads(x[:1, :2], g[:1, :2], A, B, 2.0)
    torch.bmm(x[:1, :2], x[:1, :2].transpose(1, 2)).sum()
    torch.einsum("nto,ntd->nod", g[:1, :2], x[:1, :2]).sum()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "rank-r":
        da, db = per_sample_lora_grads(x, g, A, B, 2.0)
        norms = (da.pow(2).sum((1, 2)) + db.pow(2).sum((1, 2))).sqrt()
    elif kind == "ghost":  # per-example norms of both factors' gradients from Gram matrices (no per-example grad)
        h = torch.einsum("ntd,rd->ntr", x, A)
        gh = 2.0 * torch.einsum("nto,or->ntr", g, B)
        sq_a = (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(gh, gh.transpose(1, 2))).sum((1, 2))
        sq_b = (torch.bmm(h, h.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2)) * 4.0
        norms = (sq_a + sq_b).sqrt()
    else:  # "full": the per-example gradient of the whole d_out × d_in weight
        norms = torch.einsum("nto,ntd->nod", g, x).pow(2).sum((1, 2)).sqrt()
    float(norms.sum())
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--T", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", nargs=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(_measure(a.one[0], a.n, a.T[0], a.d, a.r, a.device))
        return
    rows = []
    for T in a.T:
        row = {"n": a.n, "T": T, "d": a.d, "r": a.r, "device": a.device}
        for kind in ("rank-r", "ghost", "full"):
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--n", str(a.n), "--T", str(T), "--d",
                                  str(a.d), "--r", str(a.r), "--device", a.device],
                                 capture_output=True, text=True, check=True).stdout
            row[f"{kind}_MiB"] = round(float(out), 1)
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()

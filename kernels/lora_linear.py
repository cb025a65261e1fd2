"""Fused two-level LoRA linear on Triton (SPEC §7, ops 1–5), with the adapter folding shared by
the reference path.

Public pieces (re-exported by ``kernels``):

* ``lora_linear_triton(x, weight, bias, a, b, scale, c, d, client_scale, *, rank_mask, client_rank_mask,
  middle, middle_phi, middle_mask, precision, fuse)`` — the Triton path of ``kernels.lora_linear``.
* ``lora_linear_multi(x, weight, bias, a, b, c, d, seg_offsets, ...)`` — multi-client op: rows of X
  grouped by client (``seg_offsets``, length K+1), shared W0 and common adapter (A, B), client
  adapter (C_k, D_k) per segment; forward and backward each one set of launches for all clients.
* ``fold_adapters`` — the (differentiable) folding of scales, rank masks and the H²Tune middle
  matrix into one concatenated adapter (A_cat, B_cat); used by both backends.

Maths. With per-rank scale vectors the op is one LoRA of rank R = r + r̃ per segment g::

    A_cat_g = [A_eff; C_g]          (R, d_in)
    B_cat_g = [B_eff, s₂·D_g·m₂]    (d_out, R)
    Y = X W0ᵀ + b + (X A_cat_gᵀ) B_cat_gᵀ

with ΔW = s₁·B·M·diag(m₁)·A, M = I + (Φ⊙Ω)⊙R the middle matrix (Ω its 0/1 support), so the rank
mask m₁ zeroes rank j's contribution and its A-row gradient. M is folded into whichever factor is
cheaper (B when d_out ≤ d_in, else A). The folding is plain autograd-tracked torch on r×r / d×r
tensors, so dB, dR, dΦ, dC, dD follow from dA_cat, dB_cat by the chain rule (dR and dΦ vanish off
the support automatically). The custom ``autograd.Function`` below only sees (X, W0, b, A_cat,
B_cat) and the segment offsets.

Kernels (``_triton_kernels``): forward S = X A_catᵀ then Y = X W0ᵀ + S B_catᵀ + b (accumulator
starts from S B_catᵀ), or for small M one launch doing both in the same K loop (``fuse``);
backward dS = dY B_cat, dX = dY W0 + dS A_cat (fused likewise), dA_cat = dSᵀ X, dB_cat = dYᵀ S
(split-M, atomics into fp32). Double backward (``create_graph=True``, PF2LoRA's HVP) runs the
backward as differentiable torch matmuls instead of kernels.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .reference import check_lora_shapes, lora_linear_reference

# triton is imported lazily (first Triton-path call): importing ``kernels`` never imports triton, so
# TRITON_INTERPRET may still be set afterwards (tests), and CPU-only users never pay for it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
_TRITON_IMPORT_ERROR: Exception | None = None if HAS_TRITON else ModuleNotFoundError("triton")
_tk = None
triton = None


def _load_triton():
    """Import triton and the kernels module once; raise ValueError (clear message) when impossible."""
    global _tk, triton, HAS_TRITON, _TRITON_IMPORT_ERROR
    if _tk is None:
        if not HAS_TRITON:
            raise ValueError(f"lora_linear: the Triton path needs `triton` importable ({_TRITON_IMPORT_ERROR!r})")
        try:
            import triton as _triton

            from . import _triton_kernels
        except Exception as exc:  # broken install
            HAS_TRITON, _TRITON_IMPORT_ERROR = False, exc
            raise ValueError(f"lora_linear: importing triton failed: {exc!r}") from exc
        triton, _tk = _triton, _triton_kernels
    return _tk


__all__ = ["lora_linear_triton", "lora_linear_multi", "fold_adapters", "MAX_RANK", "HAS_TRITON",
           "FUSE_MAX_M", "interpreter_active"]

MAX_RANK = 128  # r + r̃ (padded to a power of two ≥ 16 inside the kernels)
FUSE_MAX_M = 512  # tokens up to which the shrink runs in the same K loop as the base GEMM
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _poison() -> bool:
    return os.environ.get("FEDLORA_KERNELS_POISON", "0") == "1"


def _alloc(shape, dtype, device):
    """Kernel outputs: NaN-poisoned under FEDLORA_KERNELS_POISON=1 so unwritten elements show."""
    if _poison():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _shape(t) -> str:
    return "None" if t is None else str(tuple(t.shape))


# ----------------------------------------------------------------------------------------------
# validation (before any launch)
# ----------------------------------------------------------------------------------------------

def _check_triton_operands(x: torch.Tensor, named: dict) -> None:
    _load_triton()
    if x.device.type == "cpu":
        if not interpreter_active():
            raise ValueError("lora_linear: the Triton path on CPU tensors needs TRITON_INTERPRET=1 (set before "
                             "the first Triton-path call); use the reference path (FEDLORA_KERNELS=reference)")
        if not _tk.INTERPRET:
            raise ValueError("lora_linear: the Triton kernels were compiled for GPU (TRITON_INTERPRET was not 1 when "
                             "they were first loaded); CPU tensors cannot use them in this process")
        if x.dtype != torch.float32:
            raise ValueError(f"lora_linear: under the Triton interpreter only float32 is supported, X is {x.dtype}")
    elif x.device.type != "cuda":
        raise ValueError(f"lora_linear: the Triton path runs on CUDA (or CPU under the interpreter), "
                         f"X is on {x.device}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"lora_linear: X dtype must be one of float32/float16/bfloat16, got {x.dtype}")
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"lora_linear: {name} must be a tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"lora_linear: {name} is on {t.device} but X is on {x.device}; all operands "
                             f"must be on one device")
        if t.is_floating_point() and t.dtype != x.dtype and name not in ("rank_mask", "client_rank_mask",
                                                                            "middle_mask"):
            raise ValueError(f"lora_linear: {name} has dtype {t.dtype} but X has {x.dtype}; the Triton path "
                             f"needs one dtype for X, W0, bias and the factors")


def _check_extras(a, rank_mask, middle, middle_phi, middle_mask, c, client_rank_mask, stack_shape):
    r = a.shape[-2]
    if rank_mask is not None and tuple(rank_mask.shape[-1:]) != (r,):
        raise ValueError(f"lora_linear: rank_mask must be ([G,] r={r}), got {_shape(rank_mask)}")
    if rank_mask is not None and rank_mask.dim() > 1 and tuple(rank_mask.shape[:-1]) != tuple(stack_shape):
        raise ValueError(f"lora_linear: rank_mask stack {_shape(rank_mask)} does not match factors' stack "
                         f"{tuple(stack_shape)}")
    for name, t in (("middle", middle), ("middle_phi", middle_phi), ("middle_mask", middle_mask)):
        if t is None:
            continue
        if tuple(t.shape[-2:]) != (r, r) or (t.dim() > 2 and tuple(t.shape[:-2]) != tuple(stack_shape)):
            raise ValueError(f"lora_linear: {name} must be ([G,] r={r}, r={r}) matching the factors' stack, "
                             f"got {_shape(t)}")
    if middle is None and (middle_phi is not None or middle_mask is not None):
        raise ValueError("lora_linear: middle_phi / middle_mask need the middle matrix R (`middle`)")
    if client_rank_mask is not None:
        if c is None:
            raise ValueError("lora_linear: client_rank_mask given without a client adapter (C, D)")
        rc = c.shape[-2]
        if tuple(client_rank_mask.shape[-1:]) != (rc,):
            raise ValueError(f"lora_linear: client_rank_mask must be ([G,] r̃={rc}), got {_shape(client_rank_mask)}")


# ----------------------------------------------------------------------------------------------
# folding (differentiable torch, shared with the reference path)
# ----------------------------------------------------------------------------------------------

def fold_adapters(a, b, scale=1.0, c=None, d=None, client_scale=1.0, *, rank_mask=None,
                  client_rank_mask=None, middle=None, middle_phi=None, middle_mask=None):
    """Return (A_eff, B_eff, C, D_eff) with ΔW = B_eff A_eff + D_eff C (scales, masks, middle folded).

    ΔW_common = s₁·B·M·diag(m₁)·A with M = I + (Φ⊙Ω)⊙R (``middle``=R, ``middle_phi``=Φ (default 1),
    ``middle_mask``=Ω (default dense)); ΔW_client = s₂·D·diag(m₂)·C.
    """
    r = a.shape[-2]
    if middle is not None:
        eff = middle
        if middle_phi is not None:
            eff = eff * middle_phi
        if middle_mask is not None:
            eff = eff * middle_mask.to(eff.dtype)
        mid = torch.eye(r, dtype=eff.dtype, device=eff.device) + eff
        d_out, d_in = b.shape[-2], a.shape[-1]
        if d_out <= d_in:  # fold into B: d_out·r² flops
            b_eff = b @ mid
            if rank_mask is not None:
                b_eff = b_eff * rank_mask.to(b.dtype).unsqueeze(-2)
            a_eff = a
        else:  # fold into A: r²·d_in flops
            a_m = a if rank_mask is None else a * rank_mask.to(a.dtype).unsqueeze(-1)
            a_eff = mid @ a_m
            b_eff = b
        b_eff = b_eff * scale if scale != 1.0 else b_eff
    else:
        a_eff = a
        sv = scale if rank_mask is None else rank_mask.to(b.dtype) * scale
        b_eff = b * (sv.unsqueeze(-2) if isinstance(sv, torch.Tensor) else sv) if (
            isinstance(sv, torch.Tensor) or sv != 1.0) else b
    d_eff = d
    if d is not None:
        sv2 = client_scale if client_rank_mask is None else client_rank_mask.to(d.dtype) * client_scale
        if isinstance(sv2, torch.Tensor):
            d_eff = d * sv2.unsqueeze(-2)
        elif sv2 != 1.0:
            d_eff = d * sv2
    return a_eff, b_eff, c, d_eff


# ----------------------------------------------------------------------------------------------
# launches
# ----------------------------------------------------------------------------------------------

def _num_tiles(lens, block_m):
    return sum((n + block_m - 1) // block_m for n in lens)


def _launch_mm(x, out, seg_t, lens, R, precision, *, w=None, w_strides=(0, 0, 0), wl=None,
               wl_strides=(0, 0, 0), l=None, rt=None, rt_strides=(0, 0, 0), bias=None, s_out=None):
    """out[M, N] = x[M, K] @ w (+ (x @ wl_g) @ rt_g | + l @ rt_g) (+ bias); strides are (g, k, n)."""
    M, K = x.shape
    N = out.shape[1]
    G = len(lens)
    fuse = wl is not None
    dummy = x
    block_r = max(16, triton.next_power_of_2(R))

    def grid(meta):
        return (max(1, _num_tiles(lens, meta["BLOCK_M"])), triton.cdiv(N, meta["BLOCK_N"]))

    _tk._lowrank_mm_kernel[grid](
        x, w if w is not None else dummy, wl if fuse else dummy, l if l is not None else dummy,
        rt if rt is not None else dummy, bias if bias is not None else dummy, out,
        s_out if s_out is not None else dummy, seg_t,
        M, N, K, R, G, _tk._bucket(M), _tk._bucket(G),
        x.stride(0), x.stride(1),
        *w_strides, *wl_strides,
        (l.stride(0) if l is not None else 0), (l.stride(1) if l is not None else 0),
        *rt_strides,
        out.stride(0), out.stride(1),
        (s_out.stride(0) if s_out is not None else 0), (s_out.stride(1) if s_out is not None else 0),
        HAS_W=w is not None, FUSE_SHRINK=fuse, HAS_L=l is not None, HAS_BIAS=bias is not None,
        PRECISION=precision, BLOCK_R=block_r,
    )


def _launch_tn(u, v, seg_t, lens, G, precision):
    """out[g] = u[rows_g]ᵀ v[rows_g] in fp32; u (M, P), v (M, Q) → (G, P, Q)."""
    P, Q = u.shape[1], v.shape[1]
    out = torch.zeros((G, P, Q), dtype=torch.float32, device=u.device)

    def grid(meta):
        return (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(Q, meta["BLOCK_Q"]), G, meta["SPLIT"])

    _tk._seg_tn_kernel[grid](
        u, v, out, seg_t, P, Q, _tk._bucket(max(lens) if lens else 1), _tk._bucket(G),
        u.stride(0), u.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        PRECISION=precision,
    )
    return out


def _torch_grads(x, weight, a_cat, b_cat, dy, offsets, needs):
    """Differentiable backward (create_graph=True): same formulas as the kernels, torch matmuls."""
    need_x, need_a, need_b = needs
    lens = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    G = len(lens)
    if len(set(lens)) == 1:
        n = lens[0]
        xs, dys = x.reshape(G, n, -1), dy.reshape(G, n, -1)
        s = xs @ a_cat.transpose(-1, -2)
        ds = dys @ b_cat
        dx = (ds @ a_cat).reshape(x.shape) if need_x else None
        da = ds.transpose(-1, -2) @ xs if need_a else None
        db = dys.transpose(-1, -2) @ s if need_b else None
    else:
        dxs, das, dbs = [], [], []
        for g in range(G):
            xs, dys = x[offsets[g]:offsets[g + 1]], dy[offsets[g]:offsets[g + 1]]
            s = xs @ a_cat[g].transpose(-1, -2)
            ds = dys @ b_cat[g]
            dxs.append(ds @ a_cat[g])
            das.append(ds.transpose(-1, -2) @ xs)
            dbs.append(dys.transpose(-1, -2) @ s)
        dx = torch.cat(dxs) if need_x else None
        da = torch.stack(das) if need_a else None
        db = torch.stack(dbs) if need_b else None
    if need_x and weight is not None:
        dx = dx + dy @ weight
    return dx, da, db


class _SegLoRAFunction(torch.autograd.Function):
    """Y = X W0ᵀ + b + (X A_cat_gᵀ) B_cat_gᵀ on row segments g; grads for X, A_cat, B_cat only."""

    @staticmethod
    def forward(ctx, x, weight, bias, a_cat, b_cat, offsets, precision, fuse):
        M, K = x.shape
        G, R, _ = a_cat.shape
        N = b_cat.shape[1]
        lens = [offsets[i + 1] - offsets[i] for i in range(G)]
        seg_t = torch.tensor(offsets, dtype=torch.int32, device=x.device)
        s = _alloc((M, R), x.dtype, x.device)
        y = _alloc((M, N), x.dtype, x.device)
        a_t = (a_cat.stride(0), a_cat.stride(2), a_cat.stride(1))  # A_catᵀ as (g, k=d_in, n=R)
        b_t = (b_cat.stride(0), b_cat.stride(2), b_cat.stride(1))  # B_catᵀ as (g, r, n=d_out)
        w_t = None if weight is None else (0, weight.stride(1), weight.stride(0))  # W0ᵀ (k=d_in, n=d_out)
        if fuse:
            _launch_mm(x, y, seg_t, lens, R, precision, w=weight, w_strides=w_t or (0, 0, 0),
                       wl=a_cat, wl_strides=a_t, rt=b_cat, rt_strides=b_t, bias=bias, s_out=s)
        else:
            _launch_mm(x, s, seg_t, lens, R, precision, w=a_cat, w_strides=a_t)
            _launch_mm(x, y, seg_t, lens, R, precision, w=weight, w_strides=w_t or (0, 0, 0),
                       l=s, rt=b_cat, rt_strides=b_t, bias=bias)
        ctx.save_for_backward(x, weight, a_cat, b_cat, s)
        ctx.offsets, ctx.lens, ctx.precision, ctx.fuse = offsets, lens, precision, fuse
        ctx.seg_t = seg_t
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, a_cat, b_cat, s = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        need_a, need_b = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        none3 = (None, None, None)
        if torch.is_grad_enabled():  # create_graph=True: keep the backward differentiable
            dx, da, db = _torch_grads(x, weight, a_cat, b_cat, dy, ctx.offsets, (need_x, need_a, need_b))
            return (dx, None, None, da, db) + none3
        lens, precision, seg_t = ctx.lens, ctx.precision, ctx.seg_t
        M, K = x.shape
        G, R, _ = a_cat.shape
        dx = da = db = ds = None
        b_n = (b_cat.stride(0), b_cat.stride(1), b_cat.stride(2))  # B_cat as (g, k=d_out, n=R)
        a_n = (a_cat.stride(0), a_cat.stride(1), a_cat.stride(2))  # A_cat as (g, r, n=d_in)
        w_n = None if weight is None else (0, weight.stride(0), weight.stride(1))  # W0 (k=d_out, n=d_in)
        if need_x:
            dx = _alloc((M, K), x.dtype, x.device)
            ds = _alloc((M, R), dy.dtype, dy.device)
            if ctx.fuse:
                _launch_mm(dy, dx, seg_t, lens, R, precision, w=weight, w_strides=w_n or (0, 0, 0),
                           wl=b_cat, wl_strides=b_n, rt=a_cat, rt_strides=a_n, s_out=ds)
            else:
                _launch_mm(dy, ds, seg_t, lens, R, precision, w=b_cat, w_strides=b_n)
                _launch_mm(dy, dx, seg_t, lens, R, precision, w=weight, w_strides=w_n or (0, 0, 0),
                           l=ds, rt=a_cat, rt_strides=a_n)
        elif need_a:
            ds = _alloc((M, R), dy.dtype, dy.device)
            _launch_mm(dy, ds, seg_t, lens, R, precision, w=b_cat, w_strides=b_n)
        if need_a:
            da = _launch_tn(ds, x, seg_t, lens, G, precision).to(a_cat.dtype)
        if need_b:
            db = _launch_tn(dy, s, seg_t, lens, G, precision).to(b_cat.dtype)
        return (dx, None, None, da, db) + none3


def _precision(x: torch.Tensor, precision: str | None) -> str:
    if precision is not None:
        if precision not in ("ieee", "tf32"):
            raise ValueError(f"lora_linear: precision must be 'ieee' or 'tf32', got {precision!r}")
        return precision
    if x.dtype != torch.float32:
        return "tf32"  # ignored by tl.dot for 16-bit inputs
    if x.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _segmented_call(x2, weight, bias, a_cat, b_cat, offsets, precision, fuse):
    G, R, _ = a_cat.shape
    if R > MAX_RANK:
        raise ValueError(f"lora_linear: combined rank r + r̃ = {R} exceeds the Triton kernels' maximum "
                         f"{MAX_RANK}; use the reference path (FEDLORA_KERNELS=reference)")
    M = x2.shape[0]
    prec = _precision(x2, precision)
    if fuse is None:
        fuse = M <= FUSE_MAX_M
    if M == 0:
        return lora_linear_reference(x2, weight, bias, a_cat[0], b_cat[0])
    if weight is not None:
        weight = weight.detach()
    if bias is not None:
        bias = bias.detach()
    return _SegLoRAFunction.apply(x2, weight, bias, a_cat, b_cat, tuple(int(o) for o in offsets), prec,
                                  bool(fuse))


def lora_linear_triton(x, weight, bias, a, b, scale=1.0, c=None, d=None, client_scale=1.0, *,
                       rank_mask=None, client_rank_mask=None, middle=None, middle_phi=None, middle_mask=None,
                       precision=None, fuse=None):
    """Triton path of ``kernels.lora_linear`` (same maths as the reference; extras: see module doc).

    ``precision``: 'ieee' or 'tf32' for float32 dots (default: tf32 iff
    ``torch.backends.cuda.matmul.allow_tf32``); ``fuse``: one launch for shrink + base GEMM
    (default: M ≤ ``FUSE_MAX_M``).
    """
    check_lora_shapes(x, weight, bias, a, b, c, d)
    if weight is not None and weight.dim() == 3:
        raise ValueError("lora_linear: a per-replica W0 (G, d_out, d_in) runs on the reference path only "
                         "(FEDLORA_KERNELS=reference or auto)")
    _check_triton_operands(x, {"W0": weight, "bias": bias, "A": a, "B": b, "C": c, "D": d,
                               "rank_mask": rank_mask, "client_rank_mask": client_rank_mask,
                               "middle": middle, "middle_phi": middle_phi, "middle_mask": middle_mask})
    stacked = a.dim() == 3
    _check_extras(a, rank_mask, middle, middle_phi, middle_mask, c, client_rank_mask,
                  a.shape[:1] if stacked else ())
    a_e, b_e, c_e, d_e = fold_adapters(a, b, scale, c, d, client_scale, rank_mask=rank_mask,
                                       client_rank_mask=client_rank_mask, middle=middle,
                                       middle_phi=middle_phi, middle_mask=middle_mask)
    a_cat = a_e if c_e is None else torch.cat([a_e, c_e], dim=-2)
    b_cat = b_e if d_e is None else torch.cat([b_e, d_e], dim=-1)
    d_in = x.shape[-1]
    if stacked:
        G, n = x.shape[0], x.shape[1]
        x2 = x.reshape(G * n, d_in)
        offsets = [g * n for g in range(G + 1)]
    else:
        x2 = x.reshape(-1, d_in)
        a_cat, b_cat = a_cat.unsqueeze(0), b_cat.unsqueeze(0)
        offsets = [0, x2.shape[0]]
    y = _segmented_call(x2, weight, bias, a_cat.contiguous(), b_cat.contiguous(), offsets, precision, fuse)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _check_offsets(seg_offsets, M, K):
    if isinstance(seg_offsets, torch.Tensor):
        if seg_offsets.dim() != 1 or seg_offsets.is_floating_point():
            raise ValueError(f"lora_linear_multi: seg_offsets must be a 1-D integer tensor, got "
                             f"{seg_offsets.dtype} {_shape(seg_offsets)}")
        offs = [int(v) for v in seg_offsets.tolist()]
    else:
        offs = [int(v) for v in seg_offsets]
    if len(offs) != K + 1:
        raise ValueError(f"lora_linear_multi: seg_offsets must have K+1 = {K + 1} entries (one segment per "
                         f"client adapter), got {len(offs)}")
    if offs[0] != 0 or offs[-1] != M or any(offs[i] > offs[i + 1] for i in range(K)):
        raise ValueError(f"lora_linear_multi: seg_offsets must rise from 0 to M = {M} (rows grouped by "
                         f"client), got {offs}")
    return offs


def lora_linear_multi(x, weight, bias, a, b, c, d, seg_offsets, scale=1.0, client_scale=1.0, *,
                      rank_mask=None, client_rank_mask=None, backend=None, precision=None, fuse=None):
    """Multi-client two-level LoRA: rows ``seg_offsets[k]:seg_offsets[k+1]`` of X use client k's adapter.

    Shapes: X (M, d_in) (or (..., d_in), flattened, rows in client order), W0 (d_out, d_in) or None,
    A (r, d_in), B (d_out, r) shared, C (K, r̃, d_in), D (K, d_out, r̃), seg_offsets (K+1,) ints;
    ``rank_mask`` (r,), ``client_rank_mask`` (r̃,) or (K, r̃). Equals K separate ``lora_linear`` calls.
    ``backend``: 'triton' | 'reference' | None (= ``kernels`` dispatch rules).
    """
    from . import _use_triton  # local import: dispatch policy lives in the package

    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"lora_linear_multi: A, B must be 2-D (shared), got A {_shape(a)}, B {_shape(b)}")
    if c is None or d is None or c.dim() != 3 or d.dim() != 3:
        raise ValueError(f"lora_linear_multi: C, D must be stacked per client (K, r̃, d_in), (K, d_out, r̃); "
                         f"got C {_shape(c)}, D {_shape(d)}")
    K = c.shape[0]
    d_in = x.shape[-1]
    x2 = x.reshape(-1, d_in)
    check_lora_shapes(x2, weight, bias, a, b, None, None)
    check_lora_shapes(x2.unsqueeze(0).expand(K, -1, -1), weight, bias, c, d, None, None)
    offsets = _check_offsets(seg_offsets, x2.shape[0], K)
    if client_rank_mask is not None and client_rank_mask.dim() == 2 and client_rank_mask.shape[0] != K:
        raise ValueError(f"lora_linear_multi: client_rank_mask must be (r̃,) or (K={K}, r̃), got "
                         f"{_shape(client_rank_mask)}")
    _check_extras(a, rank_mask, None, None, None, c, client_rank_mask, ())
    a_e, b_e, c_e, d_e = fold_adapters(a, b, scale, c, d, client_scale, rank_mask=rank_mask,
                                       client_rank_mask=client_rank_mask)
    if _use_triton(x2, backend):
        _check_triton_operands(x2, {"W0": weight, "bias": bias, "A": a, "B": b, "C": c, "D": d,
                                    "rank_mask": rank_mask, "client_rank_mask": client_rank_mask})
        r = a.shape[0]
        a_cat = torch.cat([a_e.unsqueeze(0).expand(K, r, d_in), c_e], dim=1).contiguous()
        b_cat = torch.cat([b_e.unsqueeze(0).expand(K, *b_e.shape), d_e], dim=2).contiguous()
        y = _segmented_call(x2, weight, bias, a_cat, b_cat, offsets, precision, fuse)
    else:
        ys = [lora_linear_reference(x2[offsets[k]:offsets[k + 1]], weight, bias, a_e, b_e, 1.0, c_e[k], d_e[k])
              for k in range(K)]
        y = torch.cat(ys, dim=0)
    return y.reshape(*x.shape[:-1], y.shape[-1])


"""Fused two-level LoRA linear on Triton (docs/design.md §7, ops 1–5), with the adapter folding shared by
the reference path.

Public pieces (re-exported by ``fedlora.kernels``):

* ``lora_linear_triton(x, weight, bias, a, b, scale, c, d, client_scale, *, rank_mask, client_rank_mask,
  middle, middle_phi, middle_mask, precision, fuse)`` — the Triton path of ``fedlora.kernels.lora_linear``.
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
(split-M; fp32 atomics, or under ``torch.use_deterministic_algorithms(True)`` per-split partial
sums summed in a fixed order). ``base_gemm='cublas'`` runs X W0ᵀ + b and dY W0 with cuBLAS instead
and only the low-rank path in Triton (``fedlora.kernels.base_gemm``; 'auto' times both on first use).
Double backward (``create_graph=True``, PF2LoRA's HVP) runs the backward as differentiable torch
matmuls instead of kernels.

Hot path. No host↔device copy or sync per call: equal segments (single client, stacked factors,
equal client splits) pass the segment length as a scalar; other host-known offsets are uploaded
once and cached; device-tensor offsets (``lora_linear_multi``) are read by the kernels only (grid
sized by an upper bound, checked with ``torch._assert_async``). Every operand is addressed through
its strides (a transposed W0 such as GPT-2's ``Conv1D.weight.T``, a strided bias, 2-D or 3-D
strided X) — only the small concatenated factors are made contiguous.

fp32 precision (``precision=None``): TF32 dots when torch allows TF32 for CUDA matmuls
(``torch.backends.cuda.matmul.fp32_precision == 'tf32'`` on torch ≥ 2.9, else
``torch.backends.cuda.matmul.allow_tf32``, which ``torch.set_float32_matmul_precision('high'|'medium')``
sets), IEEE fp32 otherwise; see ``select_precision``.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import math
import os
import warnings

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from .base_gemm import Chooser, m_bucket, requested_base_gemm, shape_key
from .reference import check_lora_shapes, lora_linear_reference

# triton is imported lazily (first Triton-path call): importing ``fedlora.kernels`` never imports triton, so
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

            import fedlora.kernels._triton_kernels as _triton_kernels
        except Exception as exc:  # broken install
            HAS_TRITON, _TRITON_IMPORT_ERROR = False, exc
            raise ValueError(f"lora_linear: importing triton failed: {exc!r}") from exc
        triton, _tk = _triton, _triton_kernels
    return _tk


__all__ = ["lora_linear_triton", "lora_linear_multi", "fold_adapters", "backend_for", "MAX_RANK", "HAS_TRITON",
           "FUSE_MAX_M", "interpreter_active", "select_precision", "compile_only"]

# ---------------------------------------------------------------------------------------------
# the dispatch policy (``fedlora.kernels``' module docstring): Triton or the reference, per call

_BACKENDS = ("auto", "triton", "reference")


def _mode(backend: str | None) -> str:
    mode = (backend or os.environ.get("FEDLORA_KERNELS", "auto") or "auto").lower()
    if mode not in _BACKENDS:
        raise ValueError(f"kernels: backend / FEDLORA_KERNELS must be one of {_BACKENDS}, got {mode!r}")
    return mode


def _has_tangent(x: torch.Tensor, tensors) -> bool:
    """Whether forward-mode AD carries a tangent on any operand (PF2LoRA's private exact mixed term): the kernels'
    ``autograd.Function`` has no jvp, and the reference's torch ops propagate tangents through forward and backward."""
    if getattr(fwAD, "_current_level", 0) < 0:  # no dual level open: the hot path's one compare (a torch without
        return False                              # this private counter: every call checks its operands)
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in (x, *tensors))


def _auto_ok(x: torch.Tensor, tensors) -> bool:
    if not (HAS_TRITON and x.is_cuda) or torch.is_autocast_enabled():
        return False
    try:
        _load_triton()
    except ValueError:  # broken triton install: stay on the reference
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if tensors and tensors[0] is not None and tensors[0].dim() == 3:  # per-replica W0: reference only
        return False
    a, c = (tensors[i] if len(tensors) > i else None for i in (2, 4))  # (W0, bias, A, B, C, D, …)
    if a is not None and a.shape[-2] + (0 if c is None else c.shape[-2]) > MAX_RANK:
        return False  # wider than the kernels' rank tile (Fed-SB's rank-d_in gradient probe): the reference runs it
    return all(t is None or (t.device == x.device and t.dtype == x.dtype) for t in tensors)


def _use_triton(x: torch.Tensor, backend: str | None = None, tensors=()) -> bool:
    mode = _mode(backend)
    if mode == "reference" or _has_tangent(x, tensors):  # a tangent: the reference, even where 'triton' is forced
        return False
    if mode == "triton":
        return True
    return _auto_ok(x, tensors)


def backend_for(x: torch.Tensor, *tensors, backend: str | None = None) -> str:
    """'triton' or 'reference': what ``fedlora.kernels.lora_linear`` would run for these operands."""
    return "triton" if _use_triton(x, backend, tensors) else "reference"


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
    elif x.device.type == "meta" and _COMPILE_ONLY:
        pass  # fedlora.kernels.aot: launches are compiled, never run
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
# fp32 precision
# ----------------------------------------------------------------------------------------------

def _torch_allows_tf32() -> bool:
    """Whether torch lets CUDA float32 matmuls use TF32 (what cuBLAS does for ``x @ w`` right now).

    torch ≥ 2.9 keeps one effective setting, ``torch.backends.cuda.matmul.fp32_precision``
    ('tf32' | 'ieee' | 'none'), which the legacy ``allow_tf32`` and
    ``torch.set_float32_matmul_precision`` also write; reading the legacy ``allow_tf32`` there
    raises once the new API was used, so it is only the fallback for older torch.
    """
    matmul = torch.backends.cuda.matmul
    try:
        new = matmul.fp32_precision
    except (AttributeError, RuntimeError):
        new = None
    if new in ("tf32", "bf16"):
        return True
    if new == "ieee":
        return False
    try:  # older torch, or 'none' (no choice made through the new API)
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


def select_precision(dtype: torch.dtype, device_type: str, precision: str | None = None) -> str:
    """``tl.dot`` input precision: 'ieee' or 'tf32'.

    ``precision`` given: used as is (validated). Otherwise float32 operands on CUDA take TF32 exactly
    when torch allows it for its own CUDA matmuls (``_torch_allows_tf32``; default 'highest' → IEEE),
    so the fused op and cuBLAS round alike; anywhere else (CPU interpreter) IEEE. 16-bit operands:
    'tf32' (the argument is ignored by ``tl.dot`` for them).
    """
    if precision is not None:
        if precision not in ("ieee", "tf32"):
            raise ValueError(f"lora_linear: precision must be 'ieee' or 'tf32', got {precision!r}")
        return precision
    if dtype != torch.float32:
        return "tf32"
    if device_type == "cuda" and _torch_allows_tf32():
        return "tf32"
    return "ieee"


# ----------------------------------------------------------------------------------------------
# row segments and row layouts
# ----------------------------------------------------------------------------------------------

_OFFSETS_CACHE: collections.OrderedDict = collections.OrderedDict()
_OFFSETS_CACHE_SIZE = 256


def _offsets_tensor(offsets: tuple, device) -> torch.Tensor:
    """int32 device copy of host offsets, uploaded once per distinct (offsets, device) and cached."""
    key = (offsets, str(device))
    t = _OFFSETS_CACHE.get(key)
    if t is None:
        t = torch.tensor(offsets, dtype=torch.int32, device=device)
        _OFFSETS_CACHE[key] = t
        while len(_OFFSETS_CACHE) > _OFFSETS_CACHE_SIZE:
            _OFFSETS_CACHE.popitem(last=False)
    else:
        _OFFSETS_CACHE.move_to_end(key)
    return t


class _Segs:
    """How the M rows of X are grouped into G segments (one adapter each).

    Exactly one of: ``seg_len`` (G equal segments, nothing on the device), ``lens`` + ``offs_t``
    (host-known offsets, cached device copy), ``offs_t`` alone (device-only offsets).
    """

    __slots__ = ("G", "seg_len", "lens", "offs_t")

    def __init__(self, G, seg_len=None, lens=None, offs_t=None):
        self.G, self.seg_len, self.lens, self.offs_t = int(G), seg_len, lens, offs_t

    @classmethod
    def equal(cls, G, n):
        return cls(G, seg_len=int(n))

    @classmethod
    def from_host(cls, offsets, device):
        offsets = tuple(int(o) for o in offsets)
        lens = tuple(offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1))
        if lens and len(set(lens)) == 1:
            return cls.equal(len(lens), lens[0])
        return cls(len(lens), lens=lens, offs_t=_offsets_tensor(offsets, device))

    @classmethod
    def from_device(cls, offs_t):
        return cls(offs_t.shape[0] - 1, offs_t=offs_t)

    @property
    def is_equal(self) -> bool:
        return self.seg_len is not None

    def host_offsets(self) -> list:
        """Offsets as Python ints (device-only offsets: a sync; double backward only)."""
        if self.is_equal:
            return [g * self.seg_len for g in range(self.G + 1)]
        if self.lens is not None:
            out = [0]
            for n in self.lens:
                out.append(out[-1] + n)
            return out
        return [int(v) for v in self.offs_t.tolist()]

    def m_tiles(self, M: int, block_m: int) -> int:
        """Row tiles to launch: exact when the lengths are known on the host, else an upper bound."""
        if self.is_equal:
            return self.G * triton.cdiv(self.seg_len, block_m)
        if self.lens is not None:
            return sum(triton.cdiv(n, block_m) for n in self.lens)
        return triton.cdiv(M, block_m) + self.G  # each segment wastes < 1 tile; surplus tiles exit

    def rows_bucket(self, M: int) -> int:
        """Autotune bucket of a segment's row count (the TN kernel's reduction length)."""
        if self.is_equal:
            return m_bucket(self.seg_len)
        if self.lens is not None:
            return m_bucket(max(self.lens))
        return m_bucket(triton.cdiv(M, max(self.G, 1)))


def _collapsible(shape, strides) -> bool:
    """Whether dims ``shape`` (with ``strides``) can be viewed as one dim without a copy."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _rows(x: torch.Tensor):
    """X (..., K) as M rows for the kernels, without copying whenever strides allow.

    Returns (t, M, K, rows_inner, stride_o, stride_m, stride_k, split): element (m, k) sits at
    t + (m // rows_inner)·stride_o + (m % rows_inner)·stride_m + k·stride_k when ``split``, else at
    t + m·stride_m + k·stride_k. Any 2-D view and any 3-D strided view are read in place; only a
    ≥ 4-D X whose leading dims do not form two strided levels is copied.
    """
    K = x.shape[-1]
    lead, lstr = tuple(x.shape[:-1]), tuple(x.stride()[:-1])
    M = math.prod(lead)
    dims = [(n, s) for n, s in zip(lead, lstr) if n != 1]
    if len(dims) <= 1 or _collapsible(lead, lstr):
        stride_m = dims[-1][1] if dims else K
        return x, M, K, max(M, 1), 0, stride_m, x.stride(-1), False
    inner_n, inner_s = dims[-1]
    outer = dims[:-1]
    if _collapsible([n for n, _ in outer], [s for _, s in outer]):
        return x, M, K, inner_n, outer[-1][1], inner_s, x.stride(-1), True
    t = x.reshape(M, K)  # rare: a ≥ 4-D X with three independent row strides
    return t, M, K, max(M, 1), 0, t.stride(0), t.stride(1), False


# ----------------------------------------------------------------------------------------------
# launches
# ----------------------------------------------------------------------------------------------

_LAUNCH_HOOK = None  # callable(kernel, grid, args, kwargs) replacing the launch (compile_only, tests)
_COMPILE_ONLY = False


@contextlib.contextmanager
def launch_hook(fn):
    """Route every kernel launch through ``fn(kernel, grid, args, kwargs)`` (which may launch it)."""
    global _LAUNCH_HOOK
    old, _LAUNCH_HOOK = _LAUNCH_HOOK, fn
    try:
        yield
    finally:
        _LAUNCH_HOOK = old


@contextlib.contextmanager
def compile_only(fn):
    """``fedlora.kernels.aot``: accept meta-device operands and hand each launch to ``fn`` instead of running it.

    The op then executes its real host code (validation, folding, segment handling, variant, fuse
    and precision choice, launch arguments) on shapes only; ``fn(kernel, grid, args, kwargs)``
    typically compiles what the autotuner would try (``fedlora.kernels.aot``).
    """
    global _COMPILE_ONLY
    _load_triton()
    old = _COMPILE_ONLY
    _COMPILE_ONLY = True
    try:
        with launch_hook(fn):
            yield
    finally:
        _COMPILE_ONLY = old


def _launch(kernel, grid, args, kwargs):
    if _LAUNCH_HOOK is not None:
        return _LAUNCH_HOOK(kernel, grid, args, kwargs)
    kernel[grid](*args, **kwargs)


def _launch_mm(xr, out, segs, R, precision, *, w=None, w_strides=(0, 0, 0), wl=None, wl_strides=(0, 0, 0),
               l=None, rt=None, rt_strides=(0, 0, 0), bias=None, s_out=None, acc_out=False):
    """out[M, N] (+)= x[M, K] @ w (+ (x @ wl_g) @ rt_g | + l @ rt_g) (+ bias); strides are (g, k, n).

    ``xr``: ``_rows(x)``; ``acc_out``: add to what ``out`` holds (in place).
    """
    x, M, K, rows_inner, stride_xo, stride_xm, stride_xk, split = xr
    N = out.shape[1]
    G = segs.G
    fuse = wl is not None
    dummy = out  # never dereferenced where passed
    block_r = max(16, triton.next_power_of_2(R))

    def grid(meta):
        return (max(1, segs.m_tiles(M, meta["BLOCK_M"])), triton.cdiv(N, meta["BLOCK_N"]))

    args = (
        x, w if w is not None else dummy, wl if fuse else dummy, l if l is not None else dummy,
        rt if rt is not None else dummy, bias if bias is not None else dummy, out,
        s_out if s_out is not None else dummy, segs.offs_t if not segs.is_equal else dummy,
        M, N, K, R, G, segs.seg_len or 0, rows_inner, m_bucket(M), m_bucket(G),
        stride_xo, stride_xm, stride_xk,
        *w_strides, *wl_strides,
        (l.stride(0) if l is not None else 0), (l.stride(1) if l is not None else 0),
        *rt_strides,
        (bias.stride(0) if bias is not None else 0),
        out.stride(0), out.stride(1),
        (s_out.stride(0) if s_out is not None else 0), (s_out.stride(1) if s_out is not None else 0),
    )
    kwargs = dict(HAS_W=w is not None, FUSE_SHRINK=fuse, HAS_L=l is not None, HAS_BIAS=bias is not None,
                  ACC_OUT=bool(acc_out), EQUAL_SEGS=segs.is_equal, X_3D=bool(split), PRECISION=precision,
                  BLOCK_R=block_r)
    _launch(_tk._lowrank_mm_kernel, grid, args, kwargs)


def _launch_tn(u, vr, segs, precision, deterministic):
    """out[g] = u[rows_g]ᵀ v[rows_g] in fp32; u (M, P) 2-D, ``vr`` = ``_rows(v)`` with v (M, Q) → (G, P, Q).

    ``deterministic``: per-split partial sums in a (DET_MAX_SPLIT, G, P, Q) buffer, summed here in a
    fixed order, instead of fp32 atomics (whose order varies run to run).
    """
    v, M, Q, rows_inner, stride_vo, stride_vm, stride_vq, split = vr
    P = u.shape[1]
    G = segs.G
    if deterministic:
        buf = torch.zeros((_tk.DET_MAX_SPLIT, G, P, Q), dtype=torch.float32, device=u.device)
        stride_os, (stride_og, stride_op, stride_oq) = buf.stride(0), buf.stride()[1:]
    else:
        buf = torch.zeros((G, P, Q), dtype=torch.float32, device=u.device)
        stride_os, (stride_og, stride_op, stride_oq) = 0, buf.stride()

    def grid(meta):
        return (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(Q, meta["BLOCK_Q"]), G, meta["SPLIT"])

    args = (u, v, buf, segs.offs_t if not segs.is_equal else buf,
            P, Q, segs.seg_len or 0, rows_inner, segs.rows_bucket(M), m_bucket(G),
            u.stride(0), u.stride(1), stride_vo, stride_vm, stride_vq,
            stride_os, stride_og, stride_op, stride_oq)
    kwargs = dict(EQUAL_SEGS=segs.is_equal, V_3D=bool(split), ATOMIC=not deterministic, PRECISION=precision)
    _launch(_tk._seg_tn_kernel, grid, args, kwargs)
    return buf.sum(0) if deterministic else buf


def _fwd_impl(x, weight, bias, a_cat, b_cat, segs, precision, fuse, variant):
    """(Y (M, N), S (M, R)) for Y = X W0ᵀ + b + (X A_cat_gᵀ) B_cat_gᵀ (launches only, no autograd)."""
    xr = _rows(x)
    t, M = xr[0], xr[1]
    R = a_cat.shape[1]
    N = b_cat.shape[1]
    s = _alloc((M, R), x.dtype, x.device)
    a_t = (a_cat.stride(0), a_cat.stride(2), a_cat.stride(1))  # A_catᵀ as (g, k=d_in, n=R)
    b_t = (b_cat.stride(0), b_cat.stride(2), b_cat.stride(1))  # B_catᵀ as (g, r, n=d_out)
    if variant == "cublas":  # cuBLAS X W0ᵀ + b, then the Triton low-rank path adds into Y in place
        y = F.linear(t, weight, bias).reshape(M, N)
        _launch_mm(xr, s, segs, R, precision, w=a_cat, w_strides=a_t)
        _launch_mm(xr, y, segs, R, precision, l=s, rt=b_cat, rt_strides=b_t, acc_out=True)
        return y, s
    y = _alloc((M, N), x.dtype, x.device)
    w_t = (0, 0, 0) if weight is None else (0, weight.stride(1), weight.stride(0))  # W0ᵀ (k=d_in, n=d_out)
    if fuse:
        _launch_mm(xr, y, segs, R, precision, w=weight, w_strides=w_t, wl=a_cat, wl_strides=a_t,
                   rt=b_cat, rt_strides=b_t, bias=bias, s_out=s)
    else:
        _launch_mm(xr, s, segs, R, precision, w=a_cat, w_strides=a_t)
        _launch_mm(xr, y, segs, R, precision, w=weight, w_strides=w_t, l=s, rt=b_cat, rt_strides=b_t, bias=bias)
    return y, s


def _bwd_impl(x, weight, a_cat, b_cat, s, dy, segs, precision, fuse, variant, needs):
    """(dX shaped like X, dA_cat, dB_cat) from dY (M, N); entries not in ``needs`` are None."""
    need_x, need_a, need_b = needs
    xr = _rows(x)
    M, K = xr[1], xr[2]
    R = a_cat.shape[1]
    dyr = _rows(dy)
    dx = da = db = ds = None
    b_n = (b_cat.stride(0), b_cat.stride(1), b_cat.stride(2))  # B_cat as (g, k=d_out, n=R)
    a_n = (a_cat.stride(0), a_cat.stride(1), a_cat.stride(2))  # A_cat as (g, r, n=d_in)
    w_n = (0, 0, 0) if weight is None else (0, weight.stride(0), weight.stride(1))  # W0 (k=d_out, n=d_in)
    if need_x:
        ds = _alloc((M, R), dy.dtype, dy.device)
        if variant == "cublas":
            _launch_mm(dyr, ds, segs, R, precision, w=b_cat, w_strides=b_n)
            dx = torch.mm(dy, weight)
            _launch_mm(dyr, dx, segs, R, precision, l=ds, rt=a_cat, rt_strides=a_n, acc_out=True)
        elif fuse:
            dx = _alloc((M, K), x.dtype, x.device)
            _launch_mm(dyr, dx, segs, R, precision, w=weight, w_strides=w_n, wl=b_cat, wl_strides=b_n,
                       rt=a_cat, rt_strides=a_n, s_out=ds)
        else:
            dx = _alloc((M, K), x.dtype, x.device)
            _launch_mm(dyr, ds, segs, R, precision, w=b_cat, w_strides=b_n)
            _launch_mm(dyr, dx, segs, R, precision, w=weight, w_strides=w_n, l=ds, rt=a_cat, rt_strides=a_n)
        dx = dx.view(x.shape)
    elif need_a:
        ds = _alloc((M, R), dy.dtype, dy.device)
        _launch_mm(dyr, ds, segs, R, precision, w=b_cat, w_strides=b_n)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if need_a:
        da = _launch_tn(ds, xr, segs, precision, deterministic).to(a_cat.dtype)
    if need_b:
        db = _launch_tn(dy, _rows(s), segs, precision, deterministic).to(b_cat.dtype)
    return dx, da, db


def _torch_grads(x, weight, a_cat, b_cat, dy, segs, needs):
    """Differentiable backward (create_graph=True): same formulas as the kernels, torch matmuls."""
    need_x, need_a, need_b = needs
    x2 = x.reshape(-1, x.shape[-1])
    G = segs.G
    if segs.is_equal:
        n = segs.seg_len
        xs, dys = x2.reshape(G, n, -1), dy.reshape(G, n, -1)
        s = xs @ a_cat.transpose(-1, -2)
        ds = dys @ b_cat
        dx = (ds @ a_cat).reshape(x2.shape) if need_x else None
        da = ds.transpose(-1, -2) @ xs if need_a else None
        db = dys.transpose(-1, -2) @ s if need_b else None
    else:
        offsets = segs.host_offsets()
        dxs, das, dbs = [], [], []
        for g in range(G):
            xs, dys = x2[offsets[g]:offsets[g + 1]], dy[offsets[g]:offsets[g + 1]]
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
    if dx is not None:
        dx = dx.reshape(x.shape)
    return dx, da, db


class _SegLoRAFunction(torch.autograd.Function):
    """Y = X W0ᵀ + b + (X A_cat_gᵀ) B_cat_gᵀ on row segments g; grads for X, A_cat, B_cat only."""

    @staticmethod
    def forward(ctx, x, weight, bias, a_cat, b_cat, segs, precision, fuse, variant):
        y, s = _fwd_impl(x, weight, bias, a_cat, b_cat, segs, precision, fuse, variant)
        ctx.save_for_backward(x, weight, a_cat, b_cat, s)
        ctx.segs, ctx.precision, ctx.fuse, ctx.variant = segs, precision, fuse, variant
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, a_cat, b_cat, s = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4])
        none4 = (None, None, None, None)
        if torch.is_grad_enabled():  # create_graph=True: keep the backward differentiable
            dx, da, db = _torch_grads(x, weight, a_cat, b_cat, dy, ctx.segs, needs)
        else:
            dx, da, db = _bwd_impl(x, weight, a_cat, b_cat, s, dy, ctx.segs, ctx.precision, ctx.fuse,
                                   ctx.variant, needs)
        return (dx, None, None, da, db) + none4


# ----------------------------------------------------------------------------------------------
# base-GEMM variant (fedlora.kernels.base_gemm)
# ----------------------------------------------------------------------------------------------

_CHOOSER = Chooser()
_TIMED_DEVICES = ("cuda",)  # where 'auto' times the variants (tests add "cpu" with a fake timer)


def _resolve_variant(mode, x, weight, bias, a_cat, b_cat, segs, precision, fuse, M):
    """The base-GEMM variant of this call: ``mode`` ('auto' | 'triton' | 'cublas', validated) or, for
    'auto' on a timed device, the cached first-use timing winner of the shape bucket."""
    if weight is None:
        return "triton"  # no base GEMM at all: the variants coincide
    if mode != "auto":
        return mode
    if x.device.type not in _TIMED_DEVICES or torch.are_deterministic_algorithms_enabled():
        return "triton"  # deterministic mode: a choice made by timing noise would change the rounding
    needs = (x.requires_grad, a_cat.requires_grad, b_cat.requires_grad)
    grad = torch.is_grad_enabled() and any(needs)
    key = shape_key(M, b_cat.shape[1], x.shape[-1], a_cat.shape[1], x.dtype, x.device, grad)
    hit = _CHOOSER.choices.get(key)
    if hit is not None:  # the hot path: one dict lookup
        return hit
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "triton"  # no timing (sync) inside a CUDA graph capture

    def runner(variant):
        def run():
            with torch.no_grad():
                y, s = _fwd_impl(x, weight, bias, a_cat, b_cat, segs, precision, fuse, variant)
                if grad:
                    _bwd_impl(x, weight, a_cat, b_cat, s, y, segs, precision, fuse, variant, needs)
        return run

    choice = _CHOOSER.choose(key, {"triton": runner("triton"), "cublas": runner("cublas")})
    failed = [n for n, t in _CHOOSER.timings[key].items() if math.isinf(t)]
    if failed:  # once per bucket: the next call is a cache hit
        warnings.warn(f"lora_linear: base_gemm variant(s) {failed} failed to run at {key}; using {choice!r}",
                      RuntimeWarning, stacklevel=3)
    return choice


def _segmented_call(x, weight, bias, a_cat, b_cat, segs, precision, fuse, base_gemm):
    """The Triton op on X (..., d_in) whose M rows fall into ``segs``; returns Y (M, d_out)."""
    G, R, _ = a_cat.shape
    if R > MAX_RANK:
        raise ValueError(f"lora_linear: combined rank r + r̃ = {R} exceeds the Triton kernels' maximum "
                         f"{MAX_RANK}; use the reference path (FEDLORA_KERNELS=reference)")
    K = x.shape[-1]
    M = math.prod(x.shape[:-1])
    prec = select_precision(x.dtype, x.device.type, precision)
    if fuse is None:
        fuse = M <= FUSE_MAX_M
    mode = requested_base_gemm(base_gemm)  # validated even when it ends up unused
    if M == 0:
        return lora_linear_reference(x.reshape(0, K), weight, bias, a_cat[0], b_cat[0])
    if weight is not None:
        weight = weight.detach()
    if bias is not None:
        bias = bias.detach()
    variant = _resolve_variant(mode, x, weight, bias, a_cat, b_cat, segs, prec, bool(fuse), M)
    return _SegLoRAFunction.apply(x, weight, bias, a_cat, b_cat, segs, prec, bool(fuse), variant)


def lora_linear_triton(x, weight, bias, a, b, scale=1.0, c=None, d=None, client_scale=1.0, *,
                       rank_mask=None, client_rank_mask=None, middle=None, middle_phi=None, middle_mask=None,
                       precision=None, fuse=None, base_gemm=None):
    """Triton path of ``fedlora.kernels.lora_linear`` (same maths as the reference; extras: see module doc).

    ``precision``: 'ieee' or 'tf32' for float32 dots (default ``select_precision``: TF32 iff torch
    allows TF32 for CUDA matmuls); ``fuse``: one launch for shrink + base GEMM (default: M ≤
    ``FUSE_MAX_M``); ``base_gemm``: 'triton' | 'cublas' | 'auto' (default env
    ``FEDLORA_KERNELS_BASE_GEMM``, else 'auto'; see ``fedlora.kernels.base_gemm``).
    Operands may be non-contiguous (strides are passed to the kernels; only the small folded factors
    are copied).
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
    if stacked:
        segs = _Segs.equal(x.shape[0], x.shape[1])
    else:
        a_cat, b_cat = a_cat.unsqueeze(0), b_cat.unsqueeze(0)
        segs = _Segs.equal(1, math.prod(x.shape[:-1]))
    y = _segmented_call(x, weight, bias, a_cat.contiguous(), b_cat.contiguous(), segs, precision, fuse,
                        base_gemm)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _check_offsets(seg_offsets, M, K):
    """Host offsets as a list of ints (validated), from a list or a CPU tensor."""
    if isinstance(seg_offsets, torch.Tensor):
        _check_offsets_tensor(seg_offsets, K)
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


def _check_offsets_tensor(seg_offsets, K):
    if seg_offsets.dim() != 1 or seg_offsets.is_floating_point() or seg_offsets.is_complex() \
            or seg_offsets.dtype == torch.bool:
        raise ValueError(f"lora_linear_multi: seg_offsets must be a 1-D integer tensor, got "
                         f"{seg_offsets.dtype} {_shape(seg_offsets)}")
    if seg_offsets.shape[0] != K + 1:
        raise ValueError(f"lora_linear_multi: seg_offsets must have K+1 = {K + 1} entries (one segment per "
                         f"client adapter), got {seg_offsets.shape[0]}")


def _device_segs(seg_offsets, M, K):
    """Offsets that stay on the device: checked with an async assert (no sync), read by the kernels."""
    _check_offsets_tensor(seg_offsets, K)
    offs_t = seg_offsets.to(torch.int32).contiguous()  # K+1 ints: the kernels read them with stride 1
    if offs_t.device.type != "meta":
        ok = (offs_t[0] == 0) & (offs_t[-1] == M) & (offs_t[1:] >= offs_t[:-1]).all()
        torch._assert_async(ok, f"lora_linear_multi: seg_offsets must rise from 0 to M = {M} (rows grouped "
                                f"by client)")
    return _Segs.from_device(offs_t)


def lora_linear_multi(x, weight, bias, a, b, c, d, seg_offsets, scale=1.0, client_scale=1.0, *,
                      rank_mask=None, client_rank_mask=None, backend=None, precision=None, fuse=None,
                      base_gemm=None):
    """Multi-client two-level LoRA: rows ``seg_offsets[k]:seg_offsets[k+1]`` of X use client k's adapter.

    Shapes: X (M, d_in) (or (..., d_in), flattened, rows in client order), W0 (d_out, d_in) or None,
    A (r, d_in), B (d_out, r) shared, C (K, r̃, d_in), D (K, d_out, r̃), seg_offsets (K+1,) ints;
    ``rank_mask`` (r,), ``client_rank_mask`` (r̃,) or (K, r̃). Equals K separate ``lora_linear`` calls.
    ``backend``: 'triton' | 'reference' | None (= ``fedlora.kernels`` dispatch rules); ``precision``,
    ``fuse``, ``base_gemm``: see ``lora_linear_triton``.

    ``seg_offsets`` as a list (or a CPU tensor) is validated on the host; equal segments then need no
    offsets tensor at all, others are uploaded once and cached. A tensor on X's device stays there
    on the Triton path (no host sync: checked by ``torch._assert_async``, the grid is sized by the
    bound cdiv(M, BLOCK_M) + K); the reference path and double backward read it on the host.
    """
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"lora_linear_multi: A, B must be 2-D (shared), got A {_shape(a)}, B {_shape(b)}")
    if c is None or d is None or c.dim() != 3 or d.dim() != 3:
        raise ValueError(f"lora_linear_multi: C, D must be stacked per client (K, r̃, d_in), (K, d_out, r̃); "
                         f"got C {_shape(c)}, D {_shape(d)}")
    K = c.shape[0]
    d_in = x.shape[-1]
    M = math.prod(x.shape[:-1])
    x_rows = torch.empty((M, d_in), device="meta")  # shape checks only: no copy of a strided X
    check_lora_shapes(x_rows, weight, bias, a, b, None, None)
    check_lora_shapes(x_rows.unsqueeze(0).expand(K, -1, -1), weight, bias, c, d, None, None)
    use_triton = _use_triton(x, backend) and not _has_tangent(x, (weight, bias, a, b, c, d))  # as lora_linear
    on_device = (use_triton and isinstance(seg_offsets, torch.Tensor) and seg_offsets.device == x.device)
    offsets = None if on_device else _check_offsets(seg_offsets, M, K)
    if client_rank_mask is not None and client_rank_mask.dim() == 2 and client_rank_mask.shape[0] != K:
        raise ValueError(f"lora_linear_multi: client_rank_mask must be (r̃,) or (K={K}, r̃), got "
                         f"{_shape(client_rank_mask)}")
    _check_extras(a, rank_mask, None, None, None, c, client_rank_mask, ())
    a_e, b_e, c_e, d_e = fold_adapters(a, b, scale, c, d, client_scale, rank_mask=rank_mask,
                                       client_rank_mask=client_rank_mask)
    if use_triton:
        _check_triton_operands(x, {"W0": weight, "bias": bias, "A": a, "B": b, "C": c, "D": d,
                                   "rank_mask": rank_mask, "client_rank_mask": client_rank_mask})
        segs = _device_segs(seg_offsets, M, K) if on_device else _Segs.from_host(offsets, x.device)
        r = a.shape[0]
        a_cat = torch.cat([a_e.unsqueeze(0).expand(K, r, d_in), c_e], dim=1).contiguous()
        b_cat = torch.cat([b_e.unsqueeze(0).expand(K, *b_e.shape), d_e], dim=2).contiguous()
        y = _segmented_call(x, weight, bias, a_cat, b_cat, segs, precision, fuse, base_gemm)
    else:
        x2 = x.reshape(-1, d_in)
        ys = [lora_linear_reference(x2[offsets[k]:offsets[k + 1]], weight, bias, a_e, b_e, 1.0, c_e[k], d_e[k])
              for k in range(K)]
        y = torch.cat(ys, dim=0)
    return y.reshape(*x.shape[:-1], y.shape[-1])

"""Triton kernels of the fused LoRA linear op (docs/design.md §7). Imported only when ``triton`` imports.

Two kernels cover forward and backward of the segmented (multi-client) low-rank linear

    OUT[rows of segment g] = [OUT +] X W [+ (X Wl_g) Rt_g | + L Rt_g] [+ bias]

* ``_lowrank_mm_kernel`` — an (M × N) GEMM with a low-rank epilogue: the accumulator starts from
  ``L @ Rt_g`` (``HAS_L``: L precomputed, e.g. S = X A_catᵀ) or, with ``FUSE_SHRINK``, the skinny
  ``S = X Wl_g`` is accumulated in the *same* K loop as the base GEMM (small M: one launch reads X
  once) and written out (for the backward) by the programs of the first N block. W may itself be
  per-segment (``stride_wg``), which makes the same kernel the shrink ``S = X A_g ᵀ``. ``ACC_OUT``
  adds the low-rank product to what OUT already holds (the cuBLAS-base variant: OUT = X W0ᵀ + b
  from cuBLAS, then OUT += S B_gᵀ); that launch is not idempotent, hence ``restore_value``.
  Used for: S = X A_catᵀ, Y = X W0ᵀ + S B_catᵀ + b, dS = dY B_cat, dX = dY W0 + dS A_cat.
* ``_seg_tn_kernel`` — per segment ``OUT_g = U_gᵀ V_g`` reducing over the rows of the segment,
  split over ``SPLIT`` programs. ``ATOMIC``: they ``atomic_add`` into a zeroed fp32 (G, P, Q)
  buffer (fast, summation order varies run to run); otherwise (deterministic mode) split s
  stores its partial sum into slice s of a (S_max, G, P, Q) buffer that the host sums in a fixed
  order. Either way the buffer must start at zero, hence ``reset_to_zero``.
  Used for dA_cat = dSᵀ X and dB_cat = dYᵀ S.

Segments. ``EQUAL_SEGS``: every segment has ``seg_len`` rows (the stacked and single-client
cases, and equal client splits): a tile's segment is arithmetic, no offsets tensor is read.
Otherwise tile ``pid_m`` finds its (segment, first row) by scanning the K+1 offsets at
``seg_ptr`` (``_seg_tile``); the host sizes the grid exactly when it knows the offsets, or by the
bound cdiv(M, BLOCK_M) + K when they live on the device only; surplus tiles get an empty row range
and skip the K loop. Row tiles never straddle a segment.

Strides. Every operand is addressed through its strides, none is assumed contiguous. The X
operand of the GEMM and V of the TN kernel may be a 3-D strided view (``X_3D`` / ``V_3D``): row m
sits at (m // rows_inner)·stride_o + (m % rows_inner)·stride_m, so hidden states of shape
(B, T, d) that cannot be viewed as (B·T, d) are read in place.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DET_MAX_SPLIT = 4  # deterministic mode: partial-sum slices per output (memory: DET_MAX_SPLIT × G×P×Q fp32)


def _mm_configs():
    if INTERPRET:  # one small config: exercises multi-tile masking, no benchmarking on CPU
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=1)]
    cfgs = []
    for bm, bn, bk, w, s in (
        (16, 64, 64, 4, 4), (16, 128, 64, 4, 4), (32, 64, 64, 4, 4), (32, 128, 64, 4, 4),
        (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4),
        (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
        (64, 16, 128, 4, 4), (128, 16, 128, 4, 4), (64, 32, 128, 4, 4), (128, 32, 64, 4, 4),
        (128, 64, 32, 4, 4),
    ):
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s))
    return cfgs


def _prune_mm(configs, named_args, **kwargs):
    named_args = {**named_args, **kwargs}
    n = named_args["N"]
    mb = named_args["M_BUCKET"]
    br = named_args.get("BLOCK_R", 16)
    nb = max(16, triton.next_power_of_2(n))
    keep = [c for c in configs
            if c.kwargs["BLOCK_N"] <= nb and c.kwargs["BLOCK_M"] <= max(16, mb)
            # keep register pressure sane when the low-rank tile is wide
            and not (br >= 128 and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 128 * 128)
            and not _ieee_spills(c, named_args, br)]
    return keep or configs[:1]


def _ieee_spills(c, named_args, br) -> bool:
    """Whether config ``c`` spills registers on sm_90 for fp32 IEEE dots (so the autotuner never tries it).

    IEEE fp32 ``tl.dot`` runs on FMA units with the accumulator and the operand tiles in registers.
    From ``python -m fedlora.kernels.aot`` (docs/concepts/kernels.md, "AOT compile check"): per thread (T = 32·warps) an
    accumulator above 32 values or operand tiles (BM·BK + BK·BN)/T above 96 values spill (up to ~50 KB
    for 128×256); with a wide low-rank epilogue (BLOCK_R ≥ 64) the L·Rt tiles spill above 2048
    outputs or 64 rows, the fused shrink above 1024 outputs.
    """
    if named_args.get("PRECISION") != "ieee":
        return False
    bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
    threads = 32 * c.num_warps
    if bm * bn > 32 * threads or (bm * bk + bk * bn) > 96 * threads:
        return True
    if br >= 64 and named_args.get("HAS_L") and (bm * bn > 2048 or bm > 64):
        return True
    return bool(br >= 64 and named_args.get("FUSE_SHRINK") and (bm * bn > 1024 or bm > 64))


def _tn_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_P": 32, "BLOCK_Q": 64, "BLOCK_M": 32, "SPLIT": 2}, num_warps=4, num_stages=1)]
    cfgs = []
    for bp, bq, bm, split, w in (
        (16, 128, 64, 1, 4), (16, 128, 64, 4, 4), (16, 128, 64, 16, 4), (16, 256, 64, 8, 8),
        (32, 128, 64, 4, 4), (64, 64, 64, 8, 4), (64, 128, 64, 4, 4), (128, 16, 64, 8, 4),
        (128, 32, 64, 4, 4), (128, 64, 64, 4, 4), (256, 16, 64, 4, 8), (128, 16, 128, 16, 4),
        (64, 64, 128, 1, 4), (128, 128, 32, 2, 8),
    ):
        cfgs.append(triton.Config({"BLOCK_P": bp, "BLOCK_Q": bq, "BLOCK_M": bm, "SPLIT": split},
                                  num_warps=w, num_stages=3))
    return cfgs


def _prune_tn(configs, named_args, **kwargs):
    named_args = {**named_args, **kwargs}
    pb = max(16, triton.next_power_of_2(named_args["P"]))
    qb = max(16, triton.next_power_of_2(named_args["Q"]))
    mb = named_args["M_BUCKET"]
    atomic = named_args.get("ATOMIC", True)
    keep = [c for c in configs
            if c.kwargs["BLOCK_P"] <= pb and c.kwargs["BLOCK_Q"] <= qb
            and c.kwargs["BLOCK_M"] * c.kwargs["SPLIT"] <= max(64, 4 * mb)
            and (atomic or c.kwargs["SPLIT"] <= DET_MAX_SPLIT)]
    if not keep:  # the fallback must still respect the deterministic split bound (buffer size)
        keep = [c for c in configs if atomic or c.kwargs["SPLIT"] <= DET_MAX_SPLIT][:1]
    return keep


@triton.jit
def _seg_tile(pid_m, seg_ptr, num_segs, seg_len, BLOCK_M: tl.constexpr, EQUAL_SEGS: tl.constexpr):
    """(segment, first row, end row) of row tile ``pid_m``; tiles are packed segment by segment.

    A tile past the last one (device-side offsets: the grid is an upper bound) gets start = end = 0.
    """
    if EQUAL_SEGS:
        tiles = (seg_len + BLOCK_M - 1) // BLOCK_M
        seg = pid_m // tiles
        start = seg * seg_len + (pid_m - seg * tiles) * BLOCK_M
        end = (seg + 1) * seg_len
    else:
        zero = pid_m * 0
        seg = zero
        start = zero
        end = zero
        base = zero
        for k in range(num_segs):
            s = tl.load(seg_ptr + k)
            e = tl.load(seg_ptr + k + 1)
            nt = (e - s + BLOCK_M - 1) // BLOCK_M
            hit = (pid_m >= base) & (pid_m < base + nt)
            seg = tl.where(hit, k, seg)
            start = tl.where(hit, s + (pid_m - base) * BLOCK_M, start)
            end = tl.where(hit, e, end)
            base = base + nt
    return seg, start, end


@triton.jit
def _row_offsets(offs_m, rows_inner, stride_o, stride_m, SPLIT_ROWS: tl.constexpr):
    """Memory offsets (int64) of rows ``offs_m`` (int64) of a 2-D (or, SPLIT_ROWS, a 3-D strided) operand.

    The split divides in int32 (row indices < 2³¹): an int64 division is a PTX subroutine whose stack
    frame spilled kilobytes in the TN kernel's loop (``fedlora.kernels.aot``).
    """
    if SPLIT_ROWS:
        m32 = offs_m.to(tl.int32)
        outer = m32 // rows_inner
        inner = m32 - outer * rows_inner
        return outer.to(tl.int64) * stride_o + inner.to(tl.int64) * stride_m
    else:
        return offs_m * stride_m


@triton.autotune(configs=_mm_configs(), key=["M_BUCKET", "N", "K", "BLOCK_R", "NUM_SEGS_BUCKET", "HAS_W",
                                              "FUSE_SHRINK", "HAS_L", "HAS_BIAS", "ACC_OUT", "EQUAL_SEGS", "X_3D",
                                              "PRECISION"],
                 prune_configs_by={"early_config_prune": _prune_mm}, restore_value=["out_ptr"])
@triton.jit
def _lowrank_mm_kernel(
    x_ptr, w_ptr, wl_ptr, l_ptr, rt_ptr, bias_ptr, out_ptr, s_out_ptr, seg_ptr,
    M, N, K, R, num_segs, seg_len, x_rows_inner, M_BUCKET, NUM_SEGS_BUCKET,
    stride_xo, stride_xm, stride_xk,
    stride_wg, stride_wk, stride_wn,
    stride_wlg, stride_wlk, stride_wlr,
    stride_lm, stride_lr,
    stride_rtg, stride_rtr, stride_rtn,
    stride_bn,
    stride_om, stride_on,
    stride_sm, stride_sr,
    HAS_W: tl.constexpr, FUSE_SHRINK: tl.constexpr, HAS_L: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACC_OUT: tl.constexpr, EQUAL_SEGS: tl.constexpr, X_3D: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg, start, end = _seg_tile(pid_m, seg_ptr, num_segs, seg_len, BLOCK_M, EQUAL_SEGS)
    seg = seg.to(tl.int64)
    offs_m = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = offs_m < end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = m_mask[:, None] & n_mask[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACC_OUT:
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    if HAS_L:
        # design lead: the accumulator starts from the low-rank product L · Rt_g
        lt = tl.load(l_ptr + offs_m[:, None] * stride_lm + offs_r[None, :] * stride_lr,
                     mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        rt = tl.load(rt_ptr + seg * stride_rtg + offs_r[:, None] * stride_rtr + offs_n[None, :] * stride_rtn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(lt, rt, acc, input_precision=PRECISION)
    if HAS_W or FUSE_SHRINK:
        x_rows = _row_offsets(offs_m, x_rows_inner, stride_xo, stride_xm, X_3D)
        s_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_hi = tl.where(start < end, K, 0)  # empty tile (grid upper bound): skip the K loop
        for k0 in range(0, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xt = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :] * stride_xk,
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if HAS_W:
                wt = tl.load(w_ptr + seg * stride_wg + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                             mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
            if FUSE_SHRINK:
                wl = tl.load(wl_ptr + seg * stride_wlg + offs_k[:, None] * stride_wlk + offs_r[None, :] * stride_wlr,
                             mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                s_acc = tl.dot(xt, wl, s_acc, input_precision=PRECISION)
        if FUSE_SHRINK:
            s = s_acc.to(s_out_ptr.dtype.element_ty)
            r_store = tl.where(pid_n == 0, R, 0)  # only the first N block writes S out
            tl.store(s_out_ptr + offs_m[:, None] * stride_sm + offs_r[None, :] * stride_sr, s,
                     mask=m_mask[:, None] & (offs_r[None, :] < r_store))
            rt = tl.load(rt_ptr + seg * stride_rtg + offs_r[:, None] * stride_rtr + offs_n[None, :] * stride_rtn,
                         mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(s.to(rt.dtype), rt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.autotune(configs=_tn_configs(), key=["P", "Q", "M_BUCKET", "NUM_SEGS_BUCKET", "EQUAL_SEGS", "V_3D",
                                              "ATOMIC", "PRECISION"],
                 prune_configs_by={"early_config_prune": _prune_tn}, reset_to_zero=["out_ptr"])
@triton.jit
def _seg_tn_kernel(
    u_ptr, v_ptr, out_ptr, seg_ptr,
    P, Q, seg_len, v_rows_inner, M_BUCKET, NUM_SEGS_BUCKET,
    stride_um, stride_up, stride_vo, stride_vm, stride_vq,
    stride_os, stride_og, stride_op, stride_oq,
    EQUAL_SEGS: tl.constexpr, V_3D: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
):
    """OUT[g] (+)= U[rows_g]ᵀ V[rows_g]; grid (P tiles × Q tiles, segments, SPLIT); OUT fp32, zeroed.

    ATOMIC: all splits add into OUT[g]; else split s writes OUT[s, g] (summed by the host).
    """
    pid_pq = tl.program_id(0)
    seg = tl.program_id(1)
    pid_s = tl.program_id(2)
    num_q = tl.cdiv(Q, BLOCK_Q)
    pid_p = pid_pq // num_q
    pid_q = pid_pq % num_q
    if EQUAL_SEGS:
        start = seg * seg_len
        end = start + seg_len
    else:
        start = tl.load(seg_ptr + seg)
        end = tl.load(seg_ptr + seg + 1)
    chunk = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_M) * BLOCK_M
    lo = start + pid_s * chunk
    hi = tl.minimum(lo + chunk, end)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = offs_q < Q
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_mask = offs_m < hi
        ut = tl.load(u_ptr + offs_p[:, None] * stride_up + offs_m[None, :] * stride_um,
                     mask=p_mask[:, None] & m_mask[None, :], other=0.0)
        v_rows = _row_offsets(offs_m, v_rows_inner, stride_vo, stride_vm, V_3D)
        vt = tl.load(v_ptr + v_rows[:, None] + offs_q[None, :] * stride_vq,
                     mask=m_mask[:, None] & q_mask[None, :], other=0.0)
        acc = tl.dot(ut, vt, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + seg.to(tl.int64) * stride_og + offs_p[:, None] * stride_op + offs_q[None, :] * stride_oq
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=p_mask[:, None] & q_mask[None, :])
    else:
        tl.store(out_ptrs + pid_s.to(tl.int64) * stride_os, acc, mask=p_mask[:, None] & q_mask[None, :])

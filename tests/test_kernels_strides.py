"""Non-contiguous operands (docs/design.md §7; review issue 8, item 5) on both backends.

Every operand — X (2-D column-strided, 3-D with rows that cannot be viewed as one dim, transposed),
W0 (GPT-2 Conv1D's ``weight.T``), bias, A, B, C, D, the rank masks, the H²Tune middle matrices and the
upstream gradient dY — is passed as a strided view whose skipped elements are NaN, so a kernel that
assumed stride 1 reads NaN or the wrong element. Each case checks the output and every gradient
against the float64 oracle on the same values. The Triton path must read X and W0 in place (no copy
of the big operands per call): the recorded launches get X's and W0's own storage.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from _kernel_helpers import _compare, _oracle, recorded_launches

from fedlora.kernels import lora_linear, lora_linear_multi

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _gapped(t: torch.Tensor) -> torch.Tensor:
    """Same values, last-dim stride 2, NaN in the gaps (differentiable)."""
    return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values, the last two dims stored transposed (column-major matrix)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _rows_gapped(t: torch.Tensor) -> torch.Tensor:
    """(B, T, d) with a NaN row after every T rows: rows that cannot be viewed as (B·T, d)."""
    pad = torch.full_like(t[:, :1], float("nan"))
    return torch.cat([t, pad], dim=1)[:, : t.shape[1]]


def _rows_transposed(t: torch.Tensor) -> torch.Tensor:
    """(B, T, d) stored as (T, B, d): the hidden-state layout of a sequence-first model."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


LAYOUTS = {
    "x_cols": ("x", _gapped), "x_rows3d": ("x", _rows_gapped), "x_seqfirst": ("x", _rows_transposed),
    "w0_conv1d": ("w", _transposed), "w0_gapped": ("w", _gapped), "bias": ("bias", _gapped),
    "a": ("a", _gapped), "a_t": ("a", _transposed), "b": ("b", _gapped), "b_t": ("b", _transposed),
    "c": ("c", _gapped), "d": ("d", _transposed), "rank_mask": ("rank_mask", _gapped),
    "client_rank_mask": ("client_rank_mask", _gapped), "middle": ("middle", _transposed),
    "middle_phi": ("middle_phi", _gapped), "middle_mask": ("middle_mask", _transposed), "dy": ("dy", _gapped),
}


def _operands(three_d: bool):
    gen = torch.Generator().manual_seed(11)
    d_in, d_out, r, rc = 40, 24, 4, 3
    xs = (2, 9, d_in) if three_d else (13, d_in)
    t = dict(
        x=torch.randn(xs, generator=gen).requires_grad_(),
        w=torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5,
        bias=torch.randn(d_out, generator=gen),
        a=torch.randn(r, d_in, generator=gen).requires_grad_(),
        b=torch.randn(d_out, r, generator=gen).requires_grad_(),
        c=torch.randn(rc, d_in, generator=gen).requires_grad_(),
        d=torch.randn(d_out, rc, generator=gen).requires_grad_(),
        middle=torch.randn(r, r, generator=gen).requires_grad_(),
        middle_phi=torch.randn(r, r, generator=gen).requires_grad_(),
    )
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    cmask = torch.tensor([1.0, 1.0, 0.0])
    support = (torch.rand(r, r, generator=gen) > 0.4).float()
    return t, mask, cmask, support


@pytest.mark.parametrize("backend,base_gemm", [("reference", None), ("triton", "triton"), ("triton", "cublas")])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_non_contiguous_operand(layout, backend, base_gemm):
    name, make = LAYOUTS[layout]
    t, mask, cmask, support = _operands(three_d=layout in ("x_rows3d", "x_seqfirst"))
    fixed = {"rank_mask": mask, "client_rank_mask": cmask, "middle_mask": support}
    strided = {k: (make(v) if k == name else v) for k, v in fixed.items()}
    keys = ("x", "w", "bias", "a", "b", "c", "d", "middle", "middle_phi")
    kw = {} if backend == "reference" else {"base_gemm": base_gemm}

    def fn32(*ts):
        o = dict(zip(keys, ts))
        o = {k: (make(v) if k == name else v) for k, v in o.items()}
        return lora_linear(o["x"], o["w"], o["bias"], o["a"], o["b"], 0.5, o["c"], o["d"], 2.0,
                           rank_mask=strided["rank_mask"], client_rank_mask=strided["client_rank_mask"],
                           middle=o["middle"], middle_phi=o["middle_phi"], middle_mask=strided["middle_mask"],
                           backend=backend, **kw)

    def fn64(*ts):
        o = dict(zip(keys, ts))
        return _oracle(o["x"], o["w"], o["bias"], o["a"], o["b"], 0.5, o["c"], o["d"], 2.0,
                       rank_mask=mask.double(), client_rank_mask=cmask.double(), middle=o["middle"],
                       phi=o["middle_phi"], support=support.double())

    _compare(fn32, fn64, tuple(t[k] for k in keys), grad_layout=_gapped if name == "dy" else None)


@pytest.mark.parametrize("layout", ["x_cols", "x_rows3d", "w0_conv1d", "bias", "c", "client_rank_mask", "offsets"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_multi_non_contiguous_operand(layout, backend):
    """lora_linear_multi: strided X, W0, bias, stacked C / D, per-client masks and offsets tensor."""
    gen = torch.Generator().manual_seed(12)
    K, d_in, d_out, r, rc = 3, 36, 20, 4, 2
    lens = [7, 0, 12]
    offs = [0, 7, 7, 19]
    x = torch.randn(19, d_in, generator=gen)
    if layout == "x_rows3d":  # (19,) rows as (1, 19): pad rows make the 3-D view non-collapsible
        x = x.unsqueeze(0)
    x.requires_grad_()
    w = torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5
    bb = torch.randn(d_out, generator=gen)
    a = torch.randn(r, d_in, generator=gen).requires_grad_()
    b = torch.randn(d_out, r, generator=gen).requires_grad_()
    c = torch.randn(K, rc, d_in, generator=gen).requires_grad_()
    d = torch.randn(K, d_out, rc, generator=gen).requires_grad_()
    cm = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert sum(lens) == 19
    make = {"x_cols": _gapped, "x_rows3d": _rows_gapped, "w0_conv1d": _transposed, "bias": _gapped,
            "c": _gapped}.get(layout)
    cm_in = _gapped(cm) if layout == "client_rank_mask" else cm
    offs_in = offs
    if layout == "offsets":  # int32 tensor with stride 2, kept on X's device by the Triton path
        offs_in = torch.stack([torch.tensor(offs, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)], -1)[:, 0]
        assert not offs_in.is_contiguous()
    which = {"x_cols": 0, "x_rows3d": 0, "w0_conv1d": 1, "bias": 2, "c": 5}.get(layout)

    def fn32(*ts):
        ts = [make(v) if i == which else v for i, v in enumerate(ts)]
        return lora_linear_multi(*ts[:5], ts[5], ts[6], offs_in, 0.5, 2.0, client_rank_mask=cm_in, backend=backend)

    def fn64(x_, w_, b_, a_, bb_, c_, d_):
        x2 = x_.reshape(-1, d_in)
        ys = [_oracle(x2[offs[k]:offs[k + 1]], w_, b_, a_, bb_, 0.5, c_[k], d_[k], 2.0,
                      client_rank_mask=cm[k].double()) for k in range(K)]
        return torch.cat(ys).reshape(*x_.shape[:-1], d_out)

    _compare(fn32, fn64, (x, w, bb, a, b, c, d))


@pytest.mark.parametrize("base_gemm", ["triton", "cublas"])
@pytest.mark.parametrize("layout", ["x_cols", "x_rows3d", "x_seqfirst", "w0_conv1d"])
def test_big_operands_are_read_in_place(layout, base_gemm):
    """No per-call copy of X or W0: the kernels get their storage and strides (forward and backward)."""
    name, make = LAYOUTS[layout]
    t, _, _, _ = _operands(three_d=layout in ("x_rows3d", "x_seqfirst"))
    x = make(t["x"].detach()) if name == "x" else t["x"].detach()
    w = make(t["w"]) if name == "w" else t["w"]
    x.requires_grad_()
    a = t["a"].detach().requires_grad_()
    with recorded_launches() as seen:
        y = lora_linear(x, w, t["bias"], a, t["b"].detach(), 0.5, backend="triton", base_gemm=base_gemm)
        y.backward(torch.ones_like(y))
    ptrs = [(k, [v.data_ptr() if isinstance(v, torch.Tensor) else None for v in args[:3]]) for k, _, args in seen]
    mm = [p for k, p in ptrs if k == "_lowrank_mm_kernel"]
    tn = [p for k, p in ptrs if k == "_seg_tn_kernel"]
    assert mm and tn
    if name == "x":  # the forward GEMM's X operand is X's own storage; so is dA's V operand
        assert any(p[0] == x.data_ptr() for p in mm), "X was copied before the forward launch"
        assert any(p[1] == x.data_ptr() for p in tn), "X was copied before the dA launch"
    elif base_gemm == "triton":  # W0 is the GEMM's W operand (forward W0ᵀ, backward W0) in place
        assert sum(p[1] == w.data_ptr() for p in mm) >= 2, "W0 was copied before a launch"
    out = lora_linear(x.detach(), w, t["bias"], a.detach(), t["b"].detach(), 0.5, backend="reference")
    assert torch.allclose(y, out, atol=1e-5, rtol=1e-5)

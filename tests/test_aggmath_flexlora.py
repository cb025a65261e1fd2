"""Property tests for fedlora.aggmath.flexlora: exact pre-truncation ΔW, Eckart–Young optimality,
robustness on degenerate input, and that the dense d_out × d_in matrix is never formed."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from fedlora.aggmath import flexlora as fl
from fedlora.aggmath.exact import exact_delta
from fedlora.aggmath.flexlora import flexlora_aggregate, flexlora_svd
from fedlora.errors import ConfigError

FAST = settings(max_examples=40, deadline=None)
D64 = torch.float64



def _clients(seed, d_out, d_in, ranks, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(d_out, r, generator=g, dtype=dtype) for r in ranks]
    As = [torch.randn(r, d_in, generator=g, dtype=dtype) for r in ranks]
    return Bs, As


def _fro(x):
    return float(torch.linalg.matrix_norm(x))


def _check_eckart_young(res, dw, ranks_out, out_scales, tol=1e-8):
    sv = torch.linalg.svdvals(dw)
    norm = _fro(dw)
    for (b, a), r, s in zip(res.factors, ranks_out, out_scales):
        assert b.shape == (dw.shape[0], r) and a.shape == (r, dw.shape[1])
        assert torch.isfinite(b).all() and torch.isfinite(a).all()
        err = _fro(dw - s * b @ a)
        ey = float(sv[r:].pow(2).sum().sqrt())
        assert abs(err - ey) <= tol * norm + 1e-300, (err, ey, norm)
        # all of Σ on B: A has orthonormal rows
        assert torch.allclose(a @ a.T, torch.eye(r, dtype=a.dtype), atol=1e-8)


def _snap(ts):
    return [t.clone() for t in ts]


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), d_out=st.integers(1, 40), d_in=st.integers(1, 40),
       data=st.data())
def test_exact_before_truncation_and_eckart_young(seed, K, d_out, d_in, data):
    ranks = data.draw(st.lists(st.integers(1, 32), min_size=K, max_size=K))
    w = data.draw(st.lists(st.floats(0.0, 10.0), min_size=K, max_size=K).filter(lambda x: sum(x) > 0.01))
    scales = [16.0 / r for r in ranks]
    m = min(d_out, d_in)
    ranks_out = data.draw(st.lists(st.integers(1, m), min_size=1, max_size=16))
    out_scales = data.draw(st.lists(st.floats(0.1, 10.0), min_size=len(ranks_out), max_size=len(ranks_out)))
    Bs, As = _clients(seed, d_out, d_in, ranks)
    snapshot = _snap(Bs + As)
    dw = exact_delta(Bs, As, w, scales)
    u, s, v = flexlora_svd(Bs, As, w, scales)
    assert s.numel() == min(d_out, d_in, sum(ranks))
    assert _fro(u * s @ v.T - dw) <= 1e-10 * _fro(dw) + 1e-300
    assert torch.all(s[:-1] >= s[1:])
    res = flexlora_aggregate(Bs, As, w, scales, ranks_out, out_scales)
    assert torch.allclose(res.singular_values, torch.linalg.svdvals(dw)[: s.numel()], atol=1e-10 * _fro(dw))
    _check_eckart_young(res, dw, ranks_out, out_scales)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, Bs + As))


def _degenerate_case(kind, seed):
    """Factor lists whose ΔW is rank-deficient, has repeated σ, or a 1e12 condition number."""
    g = torch.Generator().manual_seed(seed)
    d_out, d_in = 30, 25
    if kind == "rank_deficient":  # every client shares B → rank ≤ 3, plus all-zero clients
        b = torch.randn(d_out, 3, generator=g, dtype=D64)
        Bs = [b, b.clone(), torch.zeros(d_out, 3, dtype=D64), b * 2]
        As = [torch.randn(3, d_in, generator=g, dtype=D64) for _ in range(3)] + [torch.zeros(3, d_in, dtype=D64)]
    elif kind == "all_zero":
        Bs = [torch.zeros(d_out, 4, dtype=D64) for _ in range(3)]
        As = [torch.randn(4, d_in, generator=g, dtype=D64) for _ in range(3)]
    elif kind == "repeated":  # ΔW = Q1 Q2ᵀ split over clients: 8 equal singular values
        q1, _ = torch.linalg.qr(torch.randn(d_out, 8, generator=g, dtype=D64))
        q2, _ = torch.linalg.qr(torch.randn(d_in, 8, generator=g, dtype=D64))
        Bs = [q1[:, :4], q1[:, 4:], q1[:, :4]]
        As = [q2[:, :4].T, q2[:, 4:].T, q2[:, :4].T]  # the repeated client is weighted like the others
    elif kind == "ill_conditioned":  # σ from 1 to 1e-12
        q1, _ = torch.linalg.qr(torch.randn(d_out, 10, generator=g, dtype=D64))
        q2, _ = torch.linalg.qr(torch.randn(d_in, 10, generator=g, dtype=D64))
        sig = torch.logspace(0, -12, 10, dtype=D64)
        Bs = [q1[:, :5] * sig[:5], q1[:, 5:] * sig[5:]]
        As = [q2[:, :5].T.contiguous(), q2[:, 5:].T.contiguous()]
    elif kind == "huge_scale_spread":  # one client 1e12 times larger than the other
        Bs = [torch.randn(d_out, 4, generator=g, dtype=D64) * 1e6, torch.randn(d_out, 4, generator=g, dtype=D64) * 1e-6]
        As = [torch.randn(4, d_in, generator=g, dtype=D64) for _ in range(2)]
    else:
        raise AssertionError(kind)
    return Bs, As


KINDS = ["rank_deficient", "all_zero", "repeated", "ill_conditioned", "huge_scale_spread"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_degenerate_inputs_do_not_fail(kind, seed):
    Bs, As = _degenerate_case(kind, seed)
    K = len(Bs)
    w = [1.0] * K
    ranks_out = [1, 2, 3, 5, 8, 16]
    res = flexlora_aggregate(Bs, As, w, 1.0, ranks_out, [1.0] * len(ranks_out))
    assert torch.isfinite(res.singular_values).all()
    dw = exact_delta(Bs, As, w)
    _check_eckart_young(res, dw, ranks_out, [1.0] * len(ranks_out), tol=1e-8)


@pytest.mark.parametrize("kind", KINDS)
def test_svd_fallback_when_lapack_fails(kind, monkeypatch):
    """If torch.linalg.svd raises (LAPACK non-convergence), the eigh fallback still gives optimal factors."""
    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", broken)
    Bs, As = _degenerate_case(kind, 3)
    w = [1.0] * len(Bs)
    ranks_out = [1, 3, 8, 16]
    res = flexlora_aggregate(Bs, As, w, 1.0, ranks_out, [1.0] * 4)
    _check_eckart_young(res, exact_delta(Bs, As, w), ranks_out, [1.0] * 4, tol=1e-7)


class _ShapeRecorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.shapes, self.svd_inputs = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.linalg.svd:
            self.svd_inputs.append(tuple(args[0].shape))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor):
                self.shapes.append(tuple(o.shape))
        return out


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 6), data=st.data())
def test_never_materialises_dense_delta(seed, K, data):
    ranks = data.draw(st.lists(st.integers(1, 6), min_size=K, max_size=K))
    R = sum(ranks)
    d_out = data.draw(st.integers(R + 1, R + 30))
    d_in = data.draw(st.integers(R + 1, R + 30))
    Bs, As = _clients(seed, d_out, d_in, ranks)
    rec = _ShapeRecorder()
    with rec:
        flexlora_aggregate(Bs, As, [1.0] * K, 2.0)
    assert rec.svd_inputs and all(s[0] <= R and s[1] <= R for s in rec.svd_inputs)
    dense = d_out * d_in
    assert all(math.prod(s) < dense for s in rec.shapes), max(rec.shapes, key=math.prod)


def test_more_components_requested_than_available():
    """Σ r_k = 2 but a client wants rank 6: exact ΔW, extra B columns zero, A rows orthonormal."""
    Bs, As = _clients(5, 12, 9, [1, 1])
    res = flexlora_aggregate(Bs, As, [1, 3], [2.0, 2.0], ranks_out=[6, 2], out_scales=[0.5, 1.0])
    dw = exact_delta(Bs, As, [1, 3], [2.0, 2.0])
    b, a = res.factors[0]
    assert torch.equal(b[:, 2:], torch.zeros(12, 4, dtype=D64))
    assert torch.allclose(a @ a.T, torch.eye(6, dtype=D64), atol=1e-12)
    assert _fro(0.5 * b @ a - dw) <= 1e-12 * _fro(dw)
    _check_eckart_young(res, dw, [6, 2], [0.5, 1.0])


def test_float32_in_float32_out_and_default_ranks():
    Bs, As = _clients(7, 20, 10, [2, 4, 8], dtype=torch.float32)
    res = flexlora_aggregate(Bs, As, [1, 1, 1], [8.0, 4.0, 2.0])
    assert [b.shape[1] for b, _ in res.factors] == [2, 4, 8]
    assert all(b.dtype == torch.float32 and a.dtype == torch.float32 for b, a in res.factors)
    assert res.singular_values.dtype == D64


def test_errors():
    Bs, As = _clients(0, 6, 5, [2, 3])
    with pytest.raises(ConfigError, match="ranks_out"):
        flexlora_aggregate(Bs, As, [1, 1], 1.0, ranks_out=[0, 2])
    with pytest.raises(ConfigError, match="ranks_out"):
        flexlora_aggregate(Bs, As, [1, 1], 1.0, ranks_out=[6, 2])
    with pytest.raises(ConfigError, match="out_scales"):
        flexlora_aggregate(Bs, As, [1, 1], 1.0, ranks_out=[2, 2], out_scales=[1.0, -1.0])
    with pytest.raises(ConfigError, match="out_scales"):
        flexlora_aggregate(Bs, As, [1, 1], [1.0, 2.0], ranks_out=[2, 2, 2])
    with pytest.raises(ConfigError, match="weights"):
        flexlora_aggregate(Bs, As, [0, 0])
    with pytest.raises(ConfigError, match="d_in"):
        flexlora_aggregate(Bs, [As[0], torch.randn(3, 4, dtype=D64)], [1, 1])
    with pytest.raises(ConfigError, match="NaN"):
        flexlora_aggregate([Bs[0] * float("inf"), Bs[1]], As, [1, 1])


def test_internal_completion_is_orthonormal():
    q, _ = torch.linalg.qr(torch.randn(10, 4, dtype=D64))
    extra = fl._complete_columns(q, 5)
    full = torch.cat([q, extra], 1)
    assert torch.allclose(full.T @ full, torch.eye(9, dtype=D64), atol=1e-12)

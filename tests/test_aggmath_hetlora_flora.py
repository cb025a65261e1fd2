"""Property tests for HetLoRA's existing pure functions (fedlora.aggregation) and FLoRA stacking."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlora.aggmath.exact import exact_delta
from fedlora.aggmath.flora import flora_merge, flora_stack
from fedlora.aggregation import (frobenius_norm_of_product, hetlora_aggregate, hetlora_sparsity_weights,
                                 truncate_rank, zero_pad_rank)
from fedlora.errors import ConfigError

FAST = settings(max_examples=40, deadline=None)
D64 = torch.float64



def _clients(seed, d_out, d_in, ranks):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(d_out, r, generator=g, dtype=D64) for r in ranks],
            [torch.randn(r, d_in, generator=g, dtype=D64) for r in ranks])


def _snap(ts):
    return [t.clone() for t in ts]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- HetLoRA (existing functions)

@FAST
@given(seed=st.integers(0, 2**31 - 1), d_out=st.integers(1, 24), d_in=st.integers(1, 24),
       r=st.integers(1, 32), extra=st.integers(0, 16))
def test_hetlora_pad_truncate_round_trip(seed, d_out, d_in, r, extra):
    (b,), (a,) = _clients(seed, d_out, d_in, [r])
    snapshot = _snap([a, b])
    r_max = r + extra
    a_pad, b_pad = zero_pad_rank(a, b, r_max)
    assert a_pad.shape == (r_max, d_in) and b_pad.shape == (d_out, r_max)
    assert torch.equal(a_pad[r:], torch.zeros(extra, d_in, dtype=D64))
    assert torch.equal(b_pad[:, r:], torch.zeros(d_out, extra, dtype=D64))
    assert torch.allclose(b_pad @ a_pad, b @ a, rtol=0, atol=1e-12 * (1 + float((b @ a).abs().max())))
    a_back, b_back = truncate_rank(a_pad, b_pad, r)
    assert torch.equal(a_back, a) and torch.equal(b_back, b)
    assert _same(snapshot, [a, b])


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), d_out=st.integers(1, 16),
       d_in=st.integers(1, 16), data=st.data())
def test_hetlora_sparsity_weights_sum_to_one(seed, K, d_out, d_in, data):
    ranks = data.draw(st.lists(st.integers(1, 32), min_size=K, max_size=K))
    Bs, As = _clients(seed, d_out, d_in, ranks)
    zero = data.draw(st.lists(st.booleans(), min_size=K, max_size=K))
    Bs = [torch.zeros_like(b) if z else b for b, z in zip(Bs, zero)]
    snapshot = _snap(Bs + As)
    w = hetlora_sparsity_weights(As, Bs)
    assert w.shape == (K,) and torch.isfinite(w).all() and (w >= 0).all()
    assert abs(float(w.sum()) - 1.0) <= 1e-12
    norms = torch.stack([torch.linalg.matrix_norm(b @ a) for a, b in zip(As, Bs)])
    if norms.sum() > 0:
        assert torch.allclose(w, (norms + 1e-12) / (norms + 1e-12).sum(), atol=1e-10)
    # trace identity agrees with the dense norm
    for a, b, n in zip(As, Bs, norms):
        assert abs(float(frobenius_norm_of_product(b, a)) - float(n)) <= 1e-9 * (1 + float(n))
    assert _same(snapshot, Bs + As)


@pytest.mark.parametrize("K", [1, 2, 7])
def test_hetlora_sparsity_weights_all_zero_are_uniform(K):
    Bs = [torch.zeros(5, r, dtype=D64) for r in range(1, K + 1)]
    As = [torch.zeros(r, 3, dtype=D64) for r in range(1, K + 1)]
    w = hetlora_sparsity_weights(As, Bs)
    assert torch.allclose(w, torch.full((K,), 1.0 / K, dtype=D64))
    a_g, b_g, w2 = hetlora_aggregate(As, Bs, r_max=K)
    assert a_g.shape == (K, 3) and b_g.shape == (5, K) and torch.isfinite(a_g).all()


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), data=st.data())
def test_hetlora_aggregate_pure_and_padded_average(seed, K, data):
    ranks = data.draw(st.lists(st.integers(1, 32), min_size=K, max_size=K))
    r_max = max(ranks) + data.draw(st.integers(0, 4))
    Bs, As = _clients(seed, 7, 5, ranks)
    snapshot = _snap(Bs + As)
    a_g, b_g, w = hetlora_aggregate(As, Bs, r_max)
    ref_a = sum(wk * zero_pad_rank(a, b, r_max)[0] for wk, a, b in zip(w, As, Bs))
    ref_b = sum(wk * zero_pad_rank(a, b, r_max)[1] for wk, a, b in zip(w, As, Bs))
    assert torch.allclose(a_g, ref_a, atol=1e-12) and torch.allclose(b_g, ref_b, atol=1e-12)
    assert _same(snapshot, Bs + As)


# ---------------------------------------------------------------- FLoRA stacking

@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), d_out=st.integers(1, 24),
       d_in=st.integers(1, 24), data=st.data())
def test_flora_stack_equals_weighted_sum_of_products(seed, K, d_out, d_in, data):
    ranks = data.draw(st.lists(st.integers(1, 32), min_size=K, max_size=K))
    p = data.draw(st.lists(st.floats(0.0, 10.0), min_size=K, max_size=K).filter(lambda x: sum(x) > 0.01))
    scales = [16.0 / r for r in ranks]
    Bs, As = _clients(seed, d_out, d_in, ranks)
    snapshot = _snap(Bs + As)
    b_st, a_st = flora_stack(Bs, As, p, scales)
    assert b_st.shape == (d_out, sum(ranks)) and a_st.shape == (sum(ranks), d_in)
    ref = exact_delta(Bs, As, p, scales)
    assert float(torch.linalg.matrix_norm(b_st @ a_st - ref)) <= 1e-12 * float(torch.linalg.matrix_norm(ref)) + 1e-300
    W0 = torch.randn(d_out, d_in, dtype=D64, generator=torch.Generator().manual_seed(seed + 1))
    W0_snap = W0.clone()
    merged = flora_merge(W0, b_st, a_st)
    assert torch.allclose(merged, W0 + ref, atol=1e-12 * (1 + float(ref.abs().max())))
    assert torch.equal(W0, W0_snap)
    assert _same(snapshot, Bs + As)


def test_flora_errors():
    Bs, As = _clients(0, 4, 3, [2, 3])
    with pytest.raises(ConfigError, match="weights"):
        flora_stack(Bs, As, [0.0, 0.0])
    with pytest.raises(ConfigError, match="d_out"):
        flora_stack([Bs[0], torch.zeros(5, 3, dtype=D64)], As, [1, 1])
    with pytest.raises(ConfigError, match="W0"):
        flora_merge(torch.zeros(3, 3, dtype=D64), *flora_stack(Bs, As, [1, 1]))

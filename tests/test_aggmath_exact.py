"""Property tests for fedlora.aggmath.exact: discordance of FedAvg-of-factors and the exactness of
frozen-factor aggregation (FFA-LoRA, RoLoRA rounds)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlora.aggmath.exact import (aggregate_trained_factor, discordance, exact_delta, fedavg_delta,
                                   trained_factor)
from fedlora.errors import ConfigError

FAST = settings(max_examples=40, deadline=None)
D64 = torch.float64



def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _clients(seed, K, d_out, d_in, r):
    g = _gen(seed)
    Bs = [torch.randn(d_out, r, generator=g, dtype=D64) for _ in range(K)]
    As = [torch.randn(r, d_in, generator=g, dtype=D64) for _ in range(K)]
    return Bs, As


def _rel(x, y):
    return float(torch.linalg.matrix_norm(x - y) / torch.linalg.matrix_norm(y).clamp_min(1e-300))


def _snap(ts):
    return [t.clone() for t in ts]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


weights_st = lambda K: st.lists(st.floats(0.05, 10.0), min_size=K, max_size=K)  # noqa: E731


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(2, 16), d_out=st.integers(2, 24),
       d_in=st.integers(2, 24), r=st.integers(1, 32), data=st.data())
def test_fedavg_of_factors_differs_from_mean_of_products(seed, K, d_out, d_in, r, data):
    w = data.draw(weights_st(K))
    Bs, As = _clients(seed, K, d_out, d_in, r)
    snapshot = _snap(Bs + As)
    dis = discordance(Bs, As, w, scale=2.0)
    ex = exact_delta(Bs, As, w, 2.0)
    assert dis > 1e-8 * float(torch.linalg.matrix_norm(ex))
    assert _same(snapshot, Bs + As)


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), d_out=st.integers(1, 24),
       d_in=st.integers(1, 24), r=st.integers(1, 32), data=st.data())
def test_fedavg_of_factors_exact_when_frozen_factor_shared(seed, K, d_out, d_in, r, data):
    w = data.draw(weights_st(K))
    Bs, As = _clients(seed, K, d_out, d_in, r)
    shared_A = [As[0]] * K
    shared_B = [Bs[0]] * K
    for bs, as_ in ((Bs, shared_A), (shared_B, As)):
        ex = exact_delta(bs, as_, w, 0.5)
        fa = fedavg_delta(bs, as_, w, 0.5)
        assert float(torch.linalg.matrix_norm(fa - ex)) <= 1e-10 * float(torch.linalg.matrix_norm(ex)) + 1e-300
        assert discordance(bs, as_, w, 0.5) <= 1e-10 * float(torch.linalg.matrix_norm(ex)) + 1e-300


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), d_out=st.integers(1, 24),
       d_in=st.integers(1, 24), r=st.integers(1, 32), s=st.floats(0.01, 32.0), data=st.data())
def test_ffa_lora_aggregation_is_exact(seed, K, d_out, d_in, r, s, data):
    """FFA-LoRA: A frozen at init and shared, only B trained → s·avg(B)·A = Σ w_k s B_k A."""
    w = data.draw(weights_st(K))
    Bs, As = _clients(seed, K, d_out, d_in, r)
    A = [As[0].clone() for _ in range(K)]
    snapshot = _snap(Bs + A)
    b, a = aggregate_trained_factor(Bs, A, w, trained="B")
    assert _rel(s * b @ a, exact_delta(Bs, A, w, s)) <= 1e-10
    assert torch.equal(a, A[0])
    assert _same(snapshot, Bs + A)


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), d_out=st.integers(1, 16),
       d_in=st.integers(1, 16), r=st.integers(1, 32), rounds=st.integers(1, 6), data=st.data())
def test_rolora_rounds_are_exact(seed, K, d_out, d_in, r, rounds, data):
    """RoLoRA: even rounds train B (A frozen), odd rounds train A (B frozen); every round exact."""
    w = data.draw(weights_st(K))
    g = _gen(seed)
    A = torch.randn(r, d_in, generator=g, dtype=D64)
    B = torch.zeros(d_out, r, dtype=D64)
    for t in range(rounds):
        f = trained_factor(t)
        assert f == ("B" if t % 2 == 0 else "A")
        if f == "B":
            Bs = [B + torch.randn(d_out, r, generator=g, dtype=D64) for _ in range(K)]
            As = [A.clone() for _ in range(K)]
        else:
            Bs = [B.clone() for _ in range(K)]
            As = [A + torch.randn(r, d_in, generator=g, dtype=D64) for _ in range(K)]
        target = exact_delta(Bs, As, w, 2.0)
        B, A = aggregate_trained_factor(Bs, As, w, trained=f)
        assert _rel(2.0 * B @ A, target) <= 1e-10


def test_exact_delta_heterogeneous_ranks_and_scales():
    g = _gen(0)
    Bs = [torch.randn(5, r, generator=g, dtype=D64) for r in (1, 3, 7)]
    As = [torch.randn(r, 4, generator=g, dtype=D64) for r in (1, 3, 7)]
    w, s = [1.0, 2.0, 3.0], [4.0, 1.0, 0.5]
    ref = sum((wk / 6.0) * sk * b @ a for wk, sk, b, a in zip(w, s, Bs, As))
    assert _rel(exact_delta(Bs, As, w, s), ref) <= 1e-14


def test_errors_name_the_argument():
    g = _gen(1)
    Bs, As = _clients(1, 2, 4, 3, 2)
    with pytest.raises(ConfigError, match="weights"):
        exact_delta(Bs, As, [0.0, 0.0])
    with pytest.raises(ConfigError, match="weights"):
        exact_delta(Bs, As, [1.0, -1.0])
    with pytest.raises(ConfigError, match="weights"):
        exact_delta(Bs, As, [1.0])
    with pytest.raises(ConfigError, match="d_out"):
        exact_delta([Bs[0], torch.randn(5, 2, generator=g, dtype=D64)], As, [1, 1])
    with pytest.raises(ConfigError, match="rank"):
        exact_delta([Bs[0], torch.randn(4, 3, generator=g, dtype=D64)], As, [1, 1])
    with pytest.raises(ConfigError, match="equal ranks"):
        fedavg_delta([Bs[0], torch.randn(4, 3, dtype=D64)], [As[0], torch.randn(3, 3, dtype=D64)], [1, 1])
    with pytest.raises(ConfigError, match="scales"):
        exact_delta(Bs, As, [1, 1], scales=[1.0, 0.0])
    with pytest.raises(ConfigError, match="frozen factor A"):
        aggregate_trained_factor(Bs, As, [1, 1], trained="B")
    with pytest.raises(ConfigError, match="frozen factor B"):
        aggregate_trained_factor(Bs, As, [1, 1], trained="A")
    with pytest.raises(ConfigError, match="'A' or 'B'"):
        aggregate_trained_factor(Bs, [As[0]] * 2, [1, 1], trained="C")
    with pytest.raises(ConfigError, match="round_idx"):
        trained_factor(-1)
    with pytest.raises(ConfigError, match="NaN"):
        exact_delta([Bs[0] * float("nan"), Bs[1]], As, [1, 1])
    assert issubclass(ConfigError, ValueError)

"""Property tests for fedlora.aggmath.h2tune: TriLoRA ΔW, Φ support, layer alignment, server mean, KL."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlora.aggmath.h2tune import (h2tune_aggregate, kl_softmax, server_mean, sparsify_support, to_client,
                                    to_global, trilora_delta, trilora_fold, trilora_middle)
from fedlora.errors import ConfigError

FAST = settings(max_examples=40, deadline=None)
D64 = torch.float64



def _g(seed):
    return torch.Generator().manual_seed(seed)


@FAST
@given(seed=st.integers(0, 2**31 - 1), d_out=st.integers(1, 24), d_in=st.integers(1, 24),
       r=st.integers(1, 32), s=st.floats(0.01, 32.0), beta=st.floats(0.0, 1.0))
def test_trilora_delta_formula(seed, d_out, d_in, r, s, beta):
    g = _g(seed)
    B = torch.randn(d_out, r, generator=g, dtype=D64)
    A = torch.randn(r, d_in, generator=g, dtype=D64)
    R = torch.randn(r, r, generator=g, dtype=D64)
    Phi = torch.randn(r, r, generator=g, dtype=D64) * sparsify_support(torch.randn(r, r, generator=g, dtype=D64), beta)
    snap = [t.clone() for t in (B, A, R, Phi)]
    dw = trilora_delta(B, R, Phi, A, s)
    ref = torch.zeros(d_out, d_in, dtype=D64)  # s·(B A + Σ_ij B[:, i] Φ_ij R_ij A[j, :])
    ref += B @ A
    for i in range(r):
        for j in range(r):
            ref += Phi[i, j] * R[i, j] * torch.outer(B[:, i], A[j, :])
    ref *= s
    assert torch.allclose(dw, ref, rtol=1e-10, atol=1e-10 * (1 + float(ref.abs().max())))
    assert torch.allclose(s * trilora_fold(B, R, Phi) @ A, dw, atol=1e-10 * (1 + float(ref.abs().max())))
    assert torch.equal(trilora_delta(B, R, torch.zeros_like(Phi), A, s), s * (B @ A))
    assert all(torch.equal(x, y) for x, y in zip(snap, (B, A, R, Phi)))


@FAST
@given(seed=st.integers(0, 2**31 - 1), r=st.integers(1, 32), L=st.integers(1, 4), beta=st.floats(0.0, 1.0))
def test_sparsify_support_top_beta(seed, r, L, beta):
    Phi = torch.randn(L, r, r, generator=_g(seed), dtype=D64)
    snap = Phi.clone()
    mask = sparsify_support(Phi, beta)
    assert mask.dtype == torch.bool and mask.shape == Phi.shape
    n = r * r
    k = math.ceil(beta * n - 1e-9)
    for l in range(L):
        m, a = mask[l].flatten(), Phi[l].abs().flatten()
        assert int(m.sum()) == k
        if 0 < k < n:
            assert float(a[m].min()) >= float(a[~m].max())
    assert torch.equal(Phi, snap)


def test_sparsify_support_edges_and_ties():
    Phi = torch.ones(3, 3)
    assert not sparsify_support(Phi, 0.0).any()
    assert sparsify_support(Phi, 1.0).all()
    m = sparsify_support(Phi, 0.3)  # ⌈2.7⌉ = 3 entries, ties broken by flat index
    assert m.flatten().tolist() == [True] * 3 + [False] * 6
    for bad in (-0.1, 1.5, float("nan"), "x"):
        with pytest.raises(ConfigError, match="beta"):
            sparsify_support(Phi, bad)


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), L_g=st.integers(1, 12), r=st.integers(1, 32),
       data=st.data())
def test_layer_alignment_shapes_and_unweighted_mean(seed, K, L_g, r, data):
    Ls = data.draw(st.lists(st.integers(1, L_g), min_size=K, max_size=K))
    g = _g(seed)
    Rs = [torch.randn(L, r, r, generator=g, dtype=D64) for L in Ls]
    Oms = [torch.randn(L, L_g, generator=g, dtype=D64) for L in Ls]
    snap = [t.clone() for t in Rs + Oms]
    up = [to_global(R, O) for R, O in zip(Rs, Oms)]
    for R, O, u in zip(Rs, Oms, up):
        assert u.shape == (L_g, r, r)
        ref = torch.stack([sum(O[l, j] * R[l] for l in range(R.shape[0])) for j in range(L_g)])
        assert torch.allclose(u, ref, atol=1e-10)
    R_g = server_mean(up)
    assert torch.allclose(R_g, torch.stack(up).sum(0) / K, atol=1e-12)
    assert torch.allclose(server_mean(up[::-1]), R_g, atol=1e-12)  # order-free, unweighted
    assert torch.allclose(h2tune_aggregate(Rs, Oms), R_g, atol=1e-12)
    for R, O in zip(Rs, Oms):
        back = to_client(R_g, O)
        assert back.shape == R.shape
        ref = torch.stack([sum(O[l, j] * R_g[j] for j in range(L_g)) for l in range(R.shape[0])])
        assert torch.allclose(back, ref, atol=1e-10)
    assert all(torch.equal(x, y) for x, y in zip(snap, Rs + Oms))


def test_identity_alignment_is_plain_mean():
    g = _g(0)
    Rs = [torch.randn(4, 3, 3, generator=g, dtype=D64) for _ in range(3)]
    eye = torch.eye(4, dtype=D64)
    R_g = h2tune_aggregate(Rs, [eye] * 3)
    assert torch.allclose(R_g, sum(Rs) / 3)
    assert torch.allclose(to_client(R_g, eye), R_g)


@FAST
@given(seed=st.integers(0, 2**31 - 1), L=st.integers(1, 6), r=st.integers(1, 32))
def test_kl_softmax(seed, L, r):
    g = _g(seed)
    P, Q = torch.randn(L, r, r, generator=g, dtype=D64), torch.randn(L, r, r, generator=g, dtype=D64)
    kl = kl_softmax(P, Q, reduction="none")
    assert kl.shape == (L,) and (kl >= -1e-12).all()
    p, q = torch.softmax(P.reshape(L, -1), -1), torch.softmax(Q.reshape(L, -1), -1)
    assert torch.allclose(kl, (p * (p / q).log()).sum(-1), atol=1e-10)
    assert torch.allclose(kl_softmax(P, Q), kl.sum()) and torch.allclose(kl_softmax(P, Q, reduction="mean"), kl.mean())
    assert float(kl_softmax(P, P)) == pytest.approx(0.0, abs=1e-12)
    # transposing every R (our PEFT orientation vs the paper's) changes nothing
    assert torch.allclose(kl_softmax(P.transpose(-1, -2), Q.transpose(-1, -2)), kl_softmax(P, Q), atol=1e-12)
    whole = kl_softmax(P, Q, per_layer=False)
    pw, qw = torch.softmax(P.flatten(), 0), torch.softmax(Q.flatten(), 0)
    assert torch.allclose(whole, (pw * (pw / qw).log()).sum(), atol=1e-10)


def test_kl_is_differentiable():
    P = torch.randn(2, 3, 3, dtype=D64, requires_grad=True)
    Q = torch.randn(2, 3, 3, dtype=D64)
    kl_softmax(P, Q).backward()
    assert P.grad is not None and torch.isfinite(P.grad).all()


def test_errors():
    R = torch.zeros(2, 3, 3)
    with pytest.raises(ConfigError, match="Omega_k"):
        to_global(R, torch.zeros(3, 4))
    with pytest.raises(ConfigError, match="Omega_k"):
        to_client(torch.zeros(4, 3, 3), torch.zeros(2, 5))
    with pytest.raises(ConfigError, match="R must be"):
        to_global(torch.zeros(2, 3, 4), torch.zeros(2, 4))
    with pytest.raises(ConfigError, match="expected"):
        server_mean([torch.zeros(4, 3, 3), torch.zeros(4, 2, 2)])
    with pytest.raises(ConfigError, match="at least one"):
        server_mean([])
    with pytest.raises(ConfigError, match="Phi"):
        trilora_middle(torch.zeros(3, 3), torch.zeros(2, 2))
    with pytest.raises(ConfigError, match="A must be"):
        trilora_delta(torch.zeros(4, 3), torch.zeros(3, 3), torch.zeros(3, 3), torch.zeros(2, 5), 1.0)
    with pytest.raises(ConfigError, match="B must be"):
        trilora_delta(torch.zeros(4, 2), torch.zeros(3, 3), torch.zeros(3, 3), torch.zeros(3, 5), 1.0)
    with pytest.raises(ConfigError, match="same shape"):
        kl_softmax(torch.zeros(2, 3, 3), torch.zeros(1, 3, 3))
    with pytest.raises(ConfigError, match="reduction"):
        kl_softmax(R, R, reduction="max")

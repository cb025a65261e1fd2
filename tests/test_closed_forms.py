"""Closed forms and rank estimates of the synthetic testbed."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from fedlora.synthetic.closed_forms import best_two_level_fit, mse, ols, reduced_rank_regression
from fedlora.synthetic.data import make_clients
from fedlora.synthetic.rank import numerical_rank, rank90


def _rrr_numpy(X, Y, r):
    """Independent route: OLS by numpy lstsq, then project the fitted values on their top-r
    right singular vectors (Eckart–Young on XW), and solve back for W."""
    W = np.linalg.lstsq(X, Y, rcond=None)[0]
    _, _, Vt = np.linalg.svd(X @ W, full_matrices=False)
    V = Vt[:r].T
    return W @ V @ V.T


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.integers(2, 8), st.integers(0, 10_000), st.data())
def test_rrr_matches_numpy_lstsq_svd(d_in, d_out, seed, data):
    r = data.draw(st.integers(1, min(d_in, d_out)))
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((40, d_in))
    Y = X @ rng.standard_normal((d_in, d_out)) + 0.3 * rng.standard_normal((40, d_out))
    W = reduced_rank_regression(torch.from_numpy(X), torch.from_numpy(Y), r).numpy()
    np.testing.assert_allclose(W, _rrr_numpy(X, Y, r), rtol=1e-8, atol=1e-10)
    assert np.linalg.matrix_rank(W, tol=1e-8) <= r


def test_rrr_is_optimal_among_rank_r_matrices():
    rng = np.random.default_rng(0)
    X = torch.from_numpy(rng.standard_normal((60, 6)))
    Y = torch.from_numpy(rng.standard_normal((60, 5)))
    W = reduced_rank_regression(X, Y, 2)
    best = mse(X, Y, W)
    for _ in range(200):  # perturbations that stay rank 2 never do better
        U, s, Vh = torch.linalg.svd(W + 0.05 * torch.from_numpy(rng.standard_normal(W.shape)))
        W2 = U[:, :2] * s[:2] @ Vh[:2]
        assert mse(X, Y, W2) >= best - 1e-12


def test_ols_is_full_rank_rrr():
    c = make_clients("independent", 3)[0]
    torch.testing.assert_close(reduced_rank_regression(c.X_train, c.Y_train, 10), ols(c.X_train, c.Y_train))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(0, 10_000))
def test_rank_estimates_on_known_rank(r, seed):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(10, 10, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(10, 10, generator=g, dtype=torch.float64))
    W = (U[:, :r] * 3.0) @ V[:, :r].T  # r equal singular values: 90 % energy needs all r
    assert numerical_rank(W) == r
    assert rank90(W) == r
    assert rank90(torch.zeros(4, 4)) == 0


def test_rank90_is_the_papers_cumulative_rule():
    W = torch.diag(torch.tensor([10.0, 5.0, 3.0, 1.0, 1.0]))  # cumsum 10,15,18,19,20 → 0.9·20 = 18
    assert rank90(W) == 3
    assert numerical_rank(W, tol=0.2) == 3  # 1.0 ≤ 0.2·10


def test_shared_private_ground_truth_has_the_declared_structure():
    cs = make_clients("shared-private", 7, ranks=(3, 4), shared_rank=2)
    for c in cs:
        assert numerical_rank(c.W_star, 1e-9) == c.true_rank and rank90(c.W_star) == c.true_rank
    # the shared part: both clients agree on a rank-2 component
    common = torch.linalg.matrix_rank(torch.cat([cs[0].W_star, cs[1].W_star], dim=1))
    assert common == 3 + 4 - 2


def test_best_two_level_fit_beats_every_feasible_point():
    """W_k* = S + P_k is itself of the form (BA + D_kC_k)ᵀ with r = 4, r̃ = 2, so the joint optimum's
    summed training loss can be no worse than the truth's; and it recovers the true ranks."""
    feds = [make_clients("shared-private", s) for s in range(2)]
    X = torch.stack([torch.stack([c.X_train for c in f]) for f in feds])
    Y = torch.stack([torch.stack([c.Y_train for c in f]) for f in feds])
    W = best_two_level_fit(X, Y, 4, 2)
    for s, f in enumerate(feds):
        fit = sum(mse(c.X_train, c.Y_train, W[s, k]) for k, c in enumerate(f))
        truth = sum(mse(c.X_train, c.Y_train, c.W_star) for c in f)
        assert fit <= truth
        assert [int(rank90(W[s, k])) for k in range(2)] == [c.true_rank for c in f]


# ---------------------------------------------------------------- fewer samples than inputs (issue 18 §4)

def _min_norm(X, Y):
    """Minimum-norm least squares for full-row-rank X (n < d): Xᵀ(XXᵀ)⁻¹Y, by numpy in float64."""
    Xn, Yn = X.numpy(), Y.numpy()
    return Xn.T @ np.linalg.solve(Xn @ Xn.T, Yn)


def test_ols_with_fewer_samples_than_inputs_is_the_minimum_norm_solution():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(6, 10, generator=g, dtype=torch.float64)
    Y = torch.randn(6, 4, generator=g, dtype=torch.float64)
    W = ols(X, Y)
    assert W.shape == (10, 4) and torch.isfinite(W).all()
    np.testing.assert_allclose(W.numpy(), _min_norm(X, Y), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((X @ W).numpy(), Y.numpy(), atol=1e-10)  # interpolates
    # no other solution is shorter: adding a null-space direction of X keeps the fit, grows the norm
    null = torch.linalg.svd(X).Vh[-1]
    W2 = W + null[:, None] * torch.ones(1, 4, dtype=torch.float64)
    assert torch.allclose(X @ W2, X @ W, atol=1e-10) and torch.linalg.norm(W2) > torch.linalg.norm(W)


def test_ols_batch_with_a_degenerate_member_and_unchanged_full_rank_numbers():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(3, 20, 5, generator=g, dtype=torch.float64)
    Y = torch.randn(3, 20, 2, generator=g, dtype=torch.float64)
    full = ols(X, Y)
    X[1, :, 4] = X[1, :, 3]  # member 1: two equal columns (rank 4 < 5)
    W = ols(X, Y)
    assert torch.isfinite(W).all()
    Q, R = torch.linalg.qr(X[[0, 2]])
    exact = torch.linalg.solve_triangular(R, Q.transpose(-1, -2) @ Y[[0, 2]], upper=True)
    assert torch.equal(W[[0, 2]], exact) and torch.equal(W[[0, 2]], full[[0, 2]])  # bit for bit
    np.testing.assert_allclose(W[1].numpy(), (torch.linalg.pinv(X[1]) @ Y[1]).numpy(), rtol=1e-9, atol=1e-12)
    assert torch.allclose(W[1, 3], W[1, 4])  # the minimum-norm solution splits the weight evenly


def test_rank_recovery_with_n_train_below_dim_runs_and_reports_the_oracle(tmp_path):
    """`--n-train 6` on a 10-dim testbed crashed in the OLS oracle (linalg.solve_triangular)."""
    import json

    from fedlora.cli import main

    out = tmp_path / "o"
    assert main(["synthetic", "rank-recovery", "--n-train", "6", "--n-samples", "100", "--steps", "20",
                 "--jobs", "1", "--no-plot", "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    for run in m["runs"]:
        for c in run["clients"]:
            assert np.isfinite(c["oracle_mse"]) and np.isfinite(c["best_attainable_mse"]) and c["train_mse"] >= 0

"""Closed-form references of the regression testbed (000_c6c65d73352e5f2c.txt App. B; SPEC §6).

Paper orientation throughout: Y ≈ X W, X (n, d_in), Y (n, d_out), W (d_in, d_out).
"""
from __future__ import annotations

import torch

__all__ = ["ols", "reduced_rank_regression", "mse", "best_two_level_fit"]


def ols(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """W = (XᵀX)⁻¹XᵀY via a thin QR (X = QR, W = R⁻¹QᵀY): no explicit inverse, and bit-for-bit
    reproducible (``torch.linalg.lstsq`` on CPU differed in the last ulp between identical calls)."""
    Q, R = torch.linalg.qr(X)
    return torch.linalg.solve_triangular(R, Q.transpose(-1, -2) @ Y, upper=True)


def reduced_rank_regression(X: torch.Tensor, Y: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank-constrained least squares min_{rank W ≤ r} ‖Y − XW‖²_F.

    Reinsel & Velu (1998) Thm 2.2 (Lemma B.1 of the paper) with the weight Γ = Σ = I and the sample
    covariances: V_r = top-r eigenvectors of Σ̂_yx Σ̂_xx⁻¹ Σ̂_xy = ŶᵀŶ/n (Ŷ = X W_OLS), and
    W_r = W_OLS V_r V_rᵀ.
    """
    if not 1 <= rank <= min(X.shape[-1], Y.shape[-1]):
        raise ValueError(f"rank must be in [1, {min(X.shape[-1], Y.shape[-1])}], got {rank}")
    return _rrr_from_ols(X, ols(X, Y), rank)


def _rrr_from_ols(X: torch.Tensor, W: torch.Tensor, rank: int) -> torch.Tensor:
    Yhat = X @ W
    evals, evecs = torch.linalg.eigh(Yhat.transpose(-1, -2) @ Yhat)  # ascending
    V = evecs[..., :, -rank:]
    return W @ V @ V.transpose(-1, -2)


def mse(X: torch.Tensor, Y: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Mean over samples and outputs of (XW − Y)²; batched over leading dims."""
    return ((X @ W - Y) ** 2).mean(dim=(-2, -1))


def best_two_level_fit(
    X: torch.Tensor, Y: torch.Tensor, rank: int, client_rank: int, *, restarts: int = 2,
    iters: int = 300, tol: float = 1e-9, seed: int = 0,
) -> torch.Tensor:
    """Best fit PF2LoRA's parameterisation can reach: W_k = W_c + P_k, rank W_c ≤ r, rank P_k ≤ r̃.

    This is the set {(BA + D_kC_k)ᵀ} of the two-level adapter. Minimises Σ_k MSE_k(W_k) jointly by
    exact block-coordinate descent: given W_c, each P_k is the reduced-rank regression of the
    residual Y_k − X_k W_c at rank r̃; given the P_k, W_c is the reduced-rank regression of the
    stacked residuals at rank r (clients have equal sample counts, so Σ_k MSE_k is the stacked
    MSE). Every step is a closed-form minimiser, so the loss never increases. The problem is
    non-convex: one spectral start (from the per-client OLS maps) plus random starts; per
    federation the start with the lowest training loss wins.

    X: (S, K, n, d_in), Y: (S, K, n, d_out) for S independent federations of K clients.
    Returns W: (S, K, d_in, d_out) in the paper's orientation.
    """
    S, K, n, d_in = X.shape
    d_out = Y.shape[-1]
    X, Y = X.to(torch.float64), Y.to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    X_all = X.reshape(S, K * n, d_in)
    # X is fixed across sweeps: factor the least-squares solves once (pinv = (XᵀX)⁻¹Xᵀ).
    pinv, pinv_all = torch.linalg.pinv(X), torch.linalg.pinv(X_all)

    def rrr(Xm, Xp, R, r):
        return _rrr_from_ols(Xm, Xp @ R, r)

    best_W = best_loss = None
    for start in range(max(1, restarts)):
        if start == 0:
            W_c = reduced_rank_regression(X_all, Y.reshape(S, K * n, d_out), rank)
        else:
            W_c = torch.randn(S, d_in, rank, generator=g, dtype=torch.float64) @ torch.randn(
                S, rank, d_out, generator=g, dtype=torch.float64)
        prev = None
        for it in range(iters):
            P = rrr(X, pinv, Y - X @ W_c[:, None], client_rank)
            W_c = rrr(X_all, pinv_all, (Y - X @ P).reshape(S, K * n, d_out), rank)
            if it % 10 == 9:  # stop once every federation's loss has stalled (relative change < tol)
                cur = mse(X, Y, W_c[:, None] + P).sum(1)
                if prev is not None and bool(((prev - cur) <= tol * cur).all()):
                    break
                prev = cur
        P = rrr(X, pinv, Y - X @ W_c[:, None], client_rank)
        W = W_c[:, None] + P
        loss = mse(X, Y, W).sum(1)  # (S,)
        if best_W is None:
            best_W, best_loss = W, loss
        else:
            better = loss < best_loss
            best_W = torch.where(better[:, None, None, None], W, best_W)
            best_loss = torch.minimum(loss, best_loss)
    return best_W

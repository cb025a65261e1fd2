"""Closed-form references of the regression testbed ([PF2LoRA] App. B; docs/design.md §6).

Paper orientation throughout: Y ≈ X W, X (n, d_in), Y (n, d_out), W (d_in, d_out).
"""
from __future__ import annotations

import torch

__all__ = ["ols", "reduced_rank_regression", "mse", "best_two_level_fit"]


def ols(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Least squares: a W minimising ‖XW − Y‖_F, batched over leading dims.

    Where X has full column rank (n ≥ d_in, the testbed's default 700 × 10) the solution is unique,
    W = (XᵀX)⁻¹XᵀY, computed by a thin QR (X = QR, W = R⁻¹QᵀY): no explicit inverse, and bit-for-bit
    reproducible (``torch.linalg.lstsq`` on CPU differed in the last ulp between identical calls).

    Where it does not (fewer samples than inputs, ``n_train < dim``, or a degenerate X) there are
    infinitely many solutions, and this returns the **minimum-norm** one, W = X⁺Y (pseudo-inverse by
    SVD): the least-squares solution of least Frobenius norm, the limit of ridge regression as the
    penalty goes to 0, and the point plain gradient descent on W converges to from W = 0. With
    n < d_in (and X of full row rank, as a Gaussian X is) it fits the training data exactly.
    """
    n, d = X.shape[-2], X.shape[-1]
    if n < d:
        return torch.linalg.pinv(X) @ Y
    Q, R = torch.linalg.qr(X)
    diag = R.diagonal(dim1=-2, dim2=-1).abs()
    full = (diag > diag.amax(-1, keepdim=True) * n * torch.finfo(R.dtype).eps).all(-1)
    if bool(full.all()):
        return torch.linalg.solve_triangular(R, Q.transpose(-1, -2) @ Y, upper=True)
    # a rank-deficient X in the batch: the minimum-norm solution there, the QR one elsewhere
    W = torch.linalg.solve_triangular(torch.where(full[..., None, None], R, torch.eye(d, dtype=R.dtype)),
                                      Q.transpose(-1, -2) @ Y, upper=True)
    return torch.where(full[..., None, None], W, torch.linalg.pinv(X) @ Y)


def reduced_rank_regression(X: torch.Tensor, Y: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank-constrained least squares min_{rank W ≤ r} ‖Y − XW‖²_F.

    Reinsel & Velu (1998) Thm 2.2 (Lemma B.1 of the paper) with the weight Γ = Σ = I and the sample
    covariances: V_r = top-r eigenvectors of Σ̂_yx Σ̂_xx⁻¹ Σ̂_xy = ŶᵀŶ/n (Ŷ = X W_OLS), and
    W_r = W_OLS V_r V_rᵀ. With fewer samples than inputs W_OLS is the minimum-norm solution (``ols``),
    and W_r is a minimiser built from it (the minimiser is then not unique).
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
    # Every sweep works on sufficient statistics (d×d), never on the n rows again. With the Gram
    # matrices G_k = X_kᵀX_k, G = Σ_k G_k and OLS maps O_k = G_k⁺X_kᵀY_k, O = G⁺Σ_k X_kᵀY_k:
    #   OLS of the residual Y_k − X_k W_c is O_k − W_c (G_k⁺G_k = I for full-column-rank X_k; with
    #   fewer samples than inputs O_k − W_c is *a* least-squares solution: it differs from the
    #   minimum-norm one only in X_k's null space, which changes no fitted value, so every loss
    #   below and the minimisation stay exact — the returned W is then one of many minimisers);
    #   OLS of the stacked residuals Y_k − X_k P_k is O − G⁺Σ_k G_k P_k;
    #   RRR then projects an OLS map M on the top eigenvectors of MᵀGM (= ŶᵀŶ, Ŷ the fitted values).
    Gk = X.transpose(-1, -2) @ X                         # (S, K, d_in, d_in)
    XtY = X.transpose(-1, -2) @ Y                        # (S, K, d_in, d_out)
    YtY = (Y ** 2).sum(dim=(-2, -1))                     # (S, K)
    Gk_pinv = torch.linalg.pinv(Gk)
    O_k = Gk_pinv @ XtY
    G = Gk.sum(1)
    G_pinv = torch.linalg.pinv(G)
    O = G_pinv @ XtY.sum(1)                              # (S, d_in, d_out)

    def project(M, gram, r):
        _, evecs = torch.linalg.eigh(M.transpose(-1, -2) @ gram @ M)  # ascending
        V = evecs[..., :, -r:]
        return M @ V @ V.transpose(-1, -2)

    def summed_mse(W):  # Σ_k MSE_k(W_k) from the statistics: (‖Y‖² − 2⟨W, XᵀY⟩ + ⟨W, G_k W⟩)/(n·d_out)
        sq = YtY - 2 * (W * XtY).sum(dim=(-2, -1)) + (W * (Gk @ W)).sum(dim=(-2, -1))
        return (sq / (n * d_out)).sum(1)

    def fit_private(W_c):
        return project(O_k - W_c[:, None], Gk, client_rank)

    best_W = best_loss = None
    for start in range(max(1, restarts)):
        if start == 0:
            W_c = project(O, G, rank)  # the pooled RRR: the spectral start
        else:
            W_c = torch.randn(S, d_in, rank, generator=g, dtype=torch.float64) @ torch.randn(
                S, rank, d_out, generator=g, dtype=torch.float64)
        prev = None
        for it in range(iters):
            P = fit_private(W_c)
            W_c = project(O - G_pinv @ (Gk @ P).sum(1), G, rank)
            if it % 10 == 9:  # stop once every federation's loss has stalled (relative change < tol)
                cur = summed_mse(W_c[:, None] + P)
                if prev is not None and bool(((prev - cur) <= tol * cur).all()):
                    break
                prev = cur
        W = W_c[:, None] + fit_private(W_c)
        loss = summed_mse(W)  # (S,)
        if best_W is None:
            best_W, best_loss = W, loss
        else:
            better = loss < best_loss
            best_W = torch.where(better[:, None, None, None], W, best_W)
            best_loss = torch.minimum(loss, best_loss)
    return best_W

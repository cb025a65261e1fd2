"""LoRA-FAIR's server correction (Bian, Wang, Zhang, Xu, "LoRA-FAIR: Federated LoRA Fine-Tuning with
Aggregation and Initialization Refinement", ICCV 2025; arXiv 2411.14961).

Clients k upload B_k (d_out, r), A_k (r, d_in) (one rank r for all). The server forms the weighted
means Ā = Σ_k p_k A_k, B̄ = Σ_k p_k B_k, the ideal update ΔW = Σ_k p_k B_k A_k (the paper's eq. 6) and
the residual of its eq. 8,

    ΔB = argmin_ΔB  S(ΔW, (B̄ + ΔB) Ā) + λ ‖ΔB‖,

keeps Ā and sends (Ā, B̄' = B̄ + ΔB) to the clients (the W0 is not touched). As implemented:

* **S** is the cosine *dissimilarity* S(X, Y) = 1 − ⟨X, Y⟩_F / (‖X‖_F ‖Y‖_F). The paper names S a
  similarity metric, cosine similarity, and minimises it; its ablation reports that with λ = 0 the
  cosine similarity of (B̄ + ΔB)Ā to ΔW reaches 0.9998 — so the similarity is maximised, and 1 − cos
  is the term whose minimum that is. (An argmin of the cosine itself would turn the product away from ΔW.)
* **‖ΔB‖** is the Frobenius norm, not squared, as the paper writes it. It is not differentiable at
  ΔB = 0, where the solver starts: there the minimum-norm subgradient (0) is used, so the
  regulariser's gradient is λ ΔB/‖ΔB‖_F away from 0 and 0 at 0. When ‖∇S(0)‖_F ≤ λ, ΔB = 0 is a
  stationary point of the objective (the correction is not worth its norm).
* **The solver** is the paper's: gradient steps on ΔB from ΔB = 0 ("SGD on the server"; there are
  no data, so every step is the full gradient and nothing is random), ``steps`` of them with step size
  ``lr``. The paper gives λ = 0.01 and neither the step count nor the step size; ours are options
  (defaults in :data:`DEFAULTS`). With ``backtrack=True`` (default) a step that would not lower the
  objective is halved until it does (at most ``max_halvings`` times; the solver stops when none does),
  so the returned ΔB never scores worse than ΔB = 0 — the corrected product is at least as close to ΔW
  in S as B̄Ā, by S_after ≤ S_after + λ‖ΔB‖ ≤ S(ΔW, B̄Ā). ``backtrack=False`` takes every step at
  ``lr`` (plain fixed-step SGD, no such guarantee: the cosine is scale-free in B, so the gradient
  grows as 1/‖B̄‖ and a fixed step overshoots on small adapters).
* ``solver="ridge"`` is a **variant, not the paper's method**: the closed form of
  argmin ‖ΔW − (B̄ + ΔB)Ā‖_F² + λ‖ΔB‖_F², ΔB = (ΔW Āᵀ − B̄ĀĀᵀ)(ĀĀᵀ + λI)⁺ (a squared-error fit
  with a squared penalty, which has a closed form; the paper's cosine objective has none).

Cost, and where ΔW is formed. With the thin QR Āᵀ = Q R (Q (d_in, m) orthonormal, m = min(r, d_in)),
B' = B̄ + ΔB and M = B'Rᵀ (d_out, m): B'Ā = M Qᵀ, so ‖B'Ā‖_F = ‖M‖_F and ⟨ΔW, B'Ā⟩_F = ⟨H, M⟩_F with
H = ΔW Q = Σ_k p_k B_k (A_k Q), computed from the factors (O(K r (d_out + d_in) m)); the gradient is
−[H/(‖ΔW‖‖M‖) − ⟨H, M⟩ M/(‖ΔW‖‖M‖³)] R. A step costs O(d_out r m): the dense d_out × d_in product is
never formed in the solver (and the Gram form ⟨B'ĀĀᵀ, B'⟩, whose cancellation loses half the digits
when B'Ā is small, is not used either). The one number that needs ΔW itself, ‖ΔW‖_F, is taken through
the stacked factors B_cat = [p_1B_1, …, p_KB_K], A_cat = [A_1; …; A_K]: ‖B_cat A_cat‖_F = ‖R_B R_Aᵀ‖_F
with the triangular factors of B_cat = Q_B R_B and A_catᵀ = Q_A R_A (O((d_out + d_in)(Kr)²)), unless
forming ΔW densely is cheaper (O(d_out d_in Kr), when (d_out + d_in) Kr > d_out d_in): then ΔW is
formed, used for its norm, and dropped.

Degenerate input: if ΔW = 0 or B̄Ā = 0 the cosine is undefined and ΔB = 0 is returned (``reason``
says which). All arithmetic is float64; the results come back in the dtype of the uploads. Inputs are
never modified.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Sequence

import torch

from ..aggregation import weighted_average
from ..errors import ConfigError
from ._checks import check_factor_pairs, check_weights, is_int

__all__ = ["DEFAULTS", "SOLVERS", "LoRAFAIRResult", "lora_fair_correction", "lora_fair_objective",
           "lora_fair_similarity"]

#: λ = 0.01 is the paper's (§5 implementation details); the step count and size are not given there — ours
DEFAULTS = {"lam": 0.01, "steps": 100, "lr": 0.01, "backtrack": True, "max_halvings": 50}
#: "sgd": the paper's objective and solver; "ridge": the documented closed-form variant (not the paper's)
SOLVERS = ("sgd", "ridge")


class LoRAFAIRResult(NamedTuple):
    """``B`` = B̄ + ΔB (d_out, r) and ``A`` = Ā (r, d_in), what the clients start the next round from, in
    the uploads' dtype; ``delta_B`` = ΔB (float64); ``objective`` the objective's value after each step,
    index 0 at ΔB = 0 (float64 list; ``sgd`` only, the ridge variant lists its before/after); ``similarity_before``
    / ``similarity_after`` the cosine of B̄Ā / (B̄ + ΔB)Ā to ΔW; ``steps`` the steps taken; ``reason`` why
    the solver stopped ("steps", "stationary", "zero ΔW", "zero B̄Ā", "ridge")."""

    B: torch.Tensor
    A: torch.Tensor
    delta_B: torch.Tensor
    objective: list[float]
    similarity_before: float
    similarity_after: float
    steps: int
    reason: str


class _Problem:
    """The precomputed pieces of eq. 8 for one layer (float64): B̄, Ā, the thin QR Āᵀ = Q R, H = ΔW Q and ‖ΔW‖_F.

    With M = B'Rᵀ (d_out, m), m = min(r, d_in): B'Ā = M Qᵀ, so ‖B'Ā‖_F = ‖M‖_F and ⟨ΔW, B'Ā⟩_F = ⟨H, M⟩_F —
    norms of small matrices, never the Gram form ⟨B'ĀĀᵀ, B'⟩, whose cancellation loses half the digits
    when B'Ā is small next to ‖B'‖‖Ā‖ (and then lets the solver "improve" on rounding errors)."""

    def __init__(self, fn: str, Bs, As, weights) -> None:
        d_out, d_in, ranks = check_factor_pairs(fn, Bs, As, same_rank=True)
        w = check_weights(fn, weights, len(Bs))
        B64 = [b.detach().to(torch.float64) for b in Bs]
        A64 = [a.detach().to(torch.float64) for a in As]
        K = len(B64)
        # the house's weighted mean (FedAvg-LoRA's, bit for bit: with no correction B̄' is FedAvg's B̄)
        self.A_bar = weighted_average(A64, weights)
        self.B_bar = weighted_average(B64, weights)
        self.Q, self.R = torch.linalg.qr(self.A_bar.T)  # (d_in, m), (m, r)
        self.H = sum(w[k] * (B64[k] @ (A64[k] @ self.Q)) for k in range(K))  # ΔW Q, from the factors
        n_cat = sum(ranks)
        if (d_out + d_in) * n_cat <= d_out * d_in:  # ‖ΔW‖ through the stacked factors: QR of each side
            r_b = torch.linalg.qr(torch.cat([w[k] * B64[k] for k in range(K)], dim=1), mode="r")[1]
            r_a = torch.linalg.qr(torch.cat(A64, dim=0).T, mode="r")[1]
            self.dw_norm = float(torch.linalg.matrix_norm(r_b @ r_a.T))
        else:  # the dense product is cheaper: form ΔW for its norm only
            self.dw_norm = float(torch.linalg.matrix_norm(sum(w[k] * (B64[k] @ A64[k]) for k in range(K))))
        self.dtype = Bs[0].dtype

    def product_norm(self, b: torch.Tensor) -> float:
        return float(torch.linalg.matrix_norm(b @ self.R.T))

    def cosine(self, b: torch.Tensor) -> float:
        """cos(ΔW, b Ā); 0 when either is zero (the convention of a zero vector's cosine)."""
        m = b @ self.R.T
        pn = float(torch.linalg.matrix_norm(m))
        if self.dw_norm == 0.0 or pn == 0.0:
            return 0.0
        return float((self.H * m).sum()) / (self.dw_norm * pn)

    def objective(self, delta: torch.Tensor, lam: float) -> float:
        return 1.0 - self.cosine(self.B_bar + delta) + lam * float(torch.linalg.matrix_norm(delta))

    def gradient(self, delta: torch.Tensor, lam: float) -> torch.Tensor:
        """∇_ΔB of 1 − cos(ΔW, (B̄+ΔB)Ā) + λ‖ΔB‖_F (the regulariser's minimum-norm subgradient at 0):
        with M = (B̄+ΔB)Rᵀ, ∇_M cos = H/(‖ΔW‖‖M‖) − ⟨H, M⟩M/(‖ΔW‖‖M‖³) and ∇_ΔB = (∇_M) R."""
        m = (self.B_bar + delta) @ self.R.T
        pn = float(torch.linalg.matrix_norm(m))
        if pn == 0.0:  # the product vanished: S is not differentiable here, take no step
            return torch.zeros_like(delta)
        inner = float((self.H * m).sum())
        g = -(self.H / (self.dw_norm * pn) - (inner / (self.dw_norm * pn ** 3)) * m) @ self.R
        dn = float(torch.linalg.matrix_norm(delta))
        if lam > 0 and dn > 0:
            g = g + (lam / dn) * delta
        return g


def _check_options(fn: str, lam, steps, lr, solver, backtrack, max_halvings) -> None:
    if not isinstance(lam, numbers.Real) or isinstance(lam, bool) or not math.isfinite(lam) or lam < 0:
        raise ConfigError(f"{fn}: lam (λ) must be a finite number ≥ 0, got {lam!r}")
    if not is_int(steps) or steps < 0:
        raise ConfigError(f"{fn}: steps must be an integer ≥ 0, got {steps!r}")
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"{fn}: lr must be a finite number > 0, got {lr!r}")
    if solver not in SOLVERS:
        raise ConfigError(f"{fn}: solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if not isinstance(backtrack, bool):
        raise ConfigError(f"{fn}: backtrack must be true or false, got {backtrack!r}")
    if not is_int(max_halvings) or max_halvings < 0:
        raise ConfigError(f"{fn}: max_halvings must be an integer ≥ 0, got {max_halvings!r}")


def lora_fair_objective(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                        delta_B: torch.Tensor | None = None, lam: float = DEFAULTS["lam"]) -> float:
    """The value of eq. 8's objective at ``delta_B`` (default 0): 1 − cos(ΔW, (B̄ + ΔB)Ā) + λ‖ΔB‖_F,
    float64, through the factors (module docstring)."""
    _check_options("lora_fair_objective", lam, 0, 1.0, "sgd", True, 0)
    p = _Problem("lora_fair_objective", Bs, As, weights)
    delta = torch.zeros_like(p.B_bar) if delta_B is None else delta_B.detach().to(torch.float64)
    if delta.shape != p.B_bar.shape:
        raise ConfigError(f"lora_fair_objective: delta_B has shape {tuple(delta.shape)}, expected B's "
                          f"{tuple(p.B_bar.shape)}")
    return p.objective(delta, float(lam))


def lora_fair_similarity(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                         B: torch.Tensor) -> float:
    """cos(ΔW, B Ā) with ΔW = Σ p_k B_k A_k and Ā = Σ p_k A_k (float64; 0 if either product is 0)."""
    p = _Problem("lora_fair_similarity", Bs, As, weights)
    if B.shape != p.B_bar.shape:
        raise ConfigError(f"lora_fair_similarity: B has shape {tuple(B.shape)}, expected {tuple(p.B_bar.shape)}")
    return p.cosine(B.detach().to(torch.float64))


def lora_fair_correction(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights, *,
                         lam: float = DEFAULTS["lam"], steps: int = DEFAULTS["steps"], lr: float = DEFAULTS["lr"],
                         solver: str = "sgd", backtrack: bool = DEFAULTS["backtrack"],
                         max_halvings: int = DEFAULTS["max_halvings"]) -> LoRAFAIRResult:
    """LoRA-FAIR's server step for one layer: (Ā, B̄ + ΔB) with ΔB from eq. 8 (module docstring).

    ``weights``: p_k (normalised here). ``lam``: λ ≥ 0. ``steps``, ``lr``, ``backtrack``, ``max_halvings``:
    the gradient solver. ``solver``: "sgd" (the paper's) or "ridge" (the closed-form variant).
    Raises ``ConfigError`` on bad input (different ranks, shapes, non-finite values, bad options).
    """
    fn = "lora_fair_correction"
    _check_options(fn, lam, steps, lr, solver, backtrack, max_halvings)
    lam, lr = float(lam), float(lr)
    p = _Problem(fn, Bs, As, weights)
    zero = torch.zeros_like(p.B_bar)
    cos0 = p.cosine(p.B_bar)

    def done(delta, history, n, reason):
        b = p.B_bar + delta
        return LoRAFAIRResult(b.to(p.dtype), p.A_bar.to(As[0].dtype), delta, history, cos0, p.cosine(b), n, reason)

    if p.dw_norm == 0.0:
        return done(zero, [p.objective(zero, lam)], 0, "zero ΔW")
    if p.product_norm(p.B_bar) == 0.0:
        return done(zero, [p.objective(zero, lam)], 0, "zero B̄Ā")
    if solver == "ridge":
        C = p.R.T @ p.R  # ĀĀᵀ
        G = p.H @ p.R  # ΔW Āᵀ
        delta = (G - p.B_bar @ C) @ torch.linalg.pinv(C + lam * torch.eye(C.shape[0], dtype=torch.float64), hermitian=True)
        return done(delta, [p.objective(zero, lam), p.objective(delta, lam)], 0, "ridge")
    delta, f = zero, p.objective(zero, lam)
    history = [f]
    for t in range(steps):
        g = p.gradient(delta, lam)
        if not backtrack:
            delta = delta - lr * g
            f = p.objective(delta, lam)
            history.append(f)
            continue
        eta = lr
        for _ in range(max_halvings + 1):
            cand = delta - eta * g
            fc = p.objective(cand, lam)
            if fc < f:
                break
            eta /= 2
        else:  # no step of any size down to lr / 2^max_halvings lowers it: stationary at float precision
            return done(delta, history, t, "stationary")
        delta, f = cand, fc
        history.append(f)
    return done(delta, history, steps, "steps")

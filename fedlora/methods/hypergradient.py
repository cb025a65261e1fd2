"""PF2LoRA's hypergradient ([PF2LoRA], eq. 4 and Algorithm 1 lines 5–6).

Shared by the PF2LoRA method and the bilevel-convergence experiment, so the experiment checks the
same code that trains.

    y⁺ = y − α ∇_y F(x, y; π)                                          (Alg. 1 line 5)
    h  = ∇_x F(x, y⁺; ξ) − α ∇²_{xy} F(x, y; ζ) · ∇_y F(x, y⁺; ξ̃)      (eq. 4)

The sign of the mixed term is eq. (4)'s: it is the chain rule through y⁺ = y − α∇_yF; §7 eq. (6)
prints "+", a typo (docs/design.md §4.9). ∇²_{xy}F·v is a Hessian-vector product: ``exact`` differentiates
⟨∇_y F(x, y; ζ), v⟩ with respect to x (double backward); ``finite-difference`` uses
[∇_x F(x, y + δv) − ∇_x F(x, y − δv)] / 2δ with δ = fd_eps / ‖v‖; ``none`` is the
"without bilevel" ablation, h = ∇_x F(x, y; ξ).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError

__all__ = ["HYPERGRADIENT_MODES", "bilevel_direction"]

HYPERGRADIENT_MODES = ("exact", "finite-difference", "none")

Tensors = Sequence[torch.Tensor]


def _grad(out: torch.Tensor, inputs: Tensors, **kw) -> list[torch.Tensor]:
    gs = torch.autograd.grad(out, list(inputs), allow_unused=True, **kw)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, gs)]


def bilevel_direction(
    F: Callable[[Tensors, Tensors, Any], torch.Tensor],
    x: Tensors,
    y: Tensors,
    alpha: float,
    batches: Sequence[Any],
    mode: str = "exact",
    fd_eps: float = 1e-3,
    per_replica: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return (h, y⁺) for one PF2LoRA local step. Inputs are not modified.

    Args:
        F: scalar loss F(x, y, batch) (differentiable twice in ``exact`` mode).
        x: upper-level (common adapter) tensors.
        y: lower-level (client adapter) tensors.
        alpha: lower-level SGD step size α.
        batches: (π, ξ, ξ̃, ζ) — four draws as in Algorithm 1 line 4 — or two (inner, outer):
            π = ζ = inner, ξ = ξ̃ = outer — our mapping (docs/design.md §4.9), not the pseudocode's: App. E only
            says the client adapter steps on the inner batch and the common adapter on the outer one;
            with it h is the exact gradient through the unrolled inner step.
        mode: one of ``HYPERGRADIENT_MODES``.
        per_replica: x and y carry independent replicas along dim 0 (F sums them); the finite-
            difference step δ = fd_eps/‖v‖ is then taken per replica (exact mode is per replica anyway).
    """
    if not (fd_eps > 0 and fd_eps < float("inf")):
        raise ConfigError(f"fd_eps must be a finite number > 0, got {fd_eps!r}")
    if mode not in HYPERGRADIENT_MODES:
        raise ConfigError(f"hypergradient mode must be one of {HYPERGRADIENT_MODES}, got {mode!r}")
    if len(batches) == 2:
        pi, xi = batches
        xi_t, zeta = xi, pi
    elif len(batches) == 4:
        pi, xi, xi_t, zeta = batches
    else:
        raise ConfigError(f"batches: need 2 (inner, outer) or 4 (π, ξ, ξ̃, ζ), got {len(batches)}")
    xs = [t.detach().requires_grad_(True) for t in x]
    ys = [t.detach().requires_grad_(True) for t in y]

    if mode == "exact" and zeta is pi and xi_t is xi:
        # Same batches in both places (the two-batch default): eq. (4) is exactly the total
        # derivative of F(x, y⁺(x); ξ) through the unrolled step y⁺(x) = y − α∇_yF(x, y; π), since
        # ∂y⁺/∂x = −α∇²_{yx}F. One double backward instead of an explicit HVP: same numbers (to
        # rounding), one autograd pass fewer per step.
        g_y_pi = _grad(F(xs, ys, pi), ys, create_graph=True)
        y_plus = [yi - alpha * gi for yi, gi in zip(ys, g_y_pi)]
        h = _grad(F(xs, y_plus, xi), xs)
        return [t.detach() for t in h], [t.detach() for t in y_plus]

    reuse = mode == "exact" and zeta is pi
    # line 5: lower-level SGD step; keep the graph when the same batch also serves the HVP
    g_y_pi = _grad(F(xs, ys, pi), ys, create_graph=reuse)
    y_plus = [(yi - alpha * gi).detach() for yi, gi in zip(ys, g_y_pi)]

    if mode == "none":
        g_x = _grad(F(xs, ys, xi), xs)
        return [g.detach() for g in g_x], y_plus

    yp = [t.requires_grad_(True) for t in y_plus]
    if xi_t is xi:
        g = _grad(F(xs, yp, xi), [*xs, *yp])
        g_x, v = g[: len(xs)], g[len(xs):]
    else:
        g_x = _grad(F(xs, yp, xi), xs)
        v = _grad(F(xs, yp, xi_t), yp)
    v = [t.detach() for t in v]

    if mode == "exact":
        g_y_zeta = g_y_pi if reuse else _grad(F(xs, ys, zeta), ys, create_graph=True)
        mixed = _grad(sum((gi * vi).sum() for gi, vi in zip(g_y_zeta, v)), xs)
    elif per_replica:
        # One δ per replica (dim 0): a client's step must not depend on the other clients' ‖v‖.
        sq = sum((vi.double() ** 2).reshape(vi.shape[0], -1).sum(1) for vi in v)  # (G,)
        delta = torch.where(sq > 0, fd_eps / sq.sqrt().clamp_min(1e-300), torch.zeros_like(sq))

        def per(t, d):  # δ broadcast over a replica's slice
            return d.to(t.dtype).reshape(-1, *([1] * (t.dim() - 1)))

        plus = _grad(F(xs, [(yi + per(vi, delta) * vi).detach() for yi, vi in zip(ys, v)], zeta), xs)
        minus = _grad(F(xs, [(yi - per(vi, delta) * vi).detach() for yi, vi in zip(ys, v)], zeta), xs)
        inv = torch.where(delta > 0, 1 / (2 * delta).clamp_min(1e-300), torch.zeros_like(delta))  # v = 0 ⇒ HVP 0
        mixed = [(p - m) * per(p, inv) for p, m in zip(plus, minus)]
    else:
        vnorm = torch.sqrt(sum((vi.double() ** 2).sum() for vi in v)).item()
        if vnorm == 0.0:
            mixed = [torch.zeros_like(t) for t in xs]
        else:
            delta = fd_eps / vnorm
            plus = _grad(F(xs, [(yi + delta * vi).detach() for yi, vi in zip(ys, v)], zeta), xs)
            minus = _grad(F(xs, [(yi - delta * vi).detach() for yi, vi in zip(ys, v)], zeta), xs)
            mixed = [(p - m) / (2 * delta) for p, m in zip(plus, minus)]
    h = [(gx - alpha * m).detach() for gx, m in zip(g_x, mixed)]
    return h, [t.detach() for t in y_plus]

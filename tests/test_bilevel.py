"""Tests of the `bilevel-convergence` experiment (synthetic/bilevel.py) and, through it, of
PF2LoRA's hypergradient routine fedlora.methods.hypergradient.bilevel_direction
(000_c6c65d73352e5f2c.txt eq. 4, §7 Theorem 7.2, App. A Lemmas A.2 and A.5)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError  # noqa: E402
from fedlora.methods.hypergradient import bilevel_direction  # noqa: E402
from fedlora.synthetic.bilevel import (  # noqa: E402
    SLOPE_THRESHOLD,
    BilevelConfig,
    make_problem,
    plot_bilevel_convergence,
    run_bilevel_convergence,
    theorem_constants,
)

DT = torch.float64
# Central finite differences of the HVP are exact in y for f quadratic in y (here: always), so the
# only error is rounding, ~ eps·‖∇_x F‖·‖v‖/fd_eps ≈ 1e-12 relative; 1e-6 is the documented bound.
FD_RTOL = 1e-6
EXACT_RTOL = 1e-8


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _spd(rng, n, lo, hi):
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (q * rng.uniform(lo, hi, n)) @ q.T


def _quadratic_batches(rng, dx, dy, nb):
    """nb quadratics F_b(x, y) = ½ zᵀH_b z + g_bᵀz (one per batch), as numpy arrays."""
    out = []
    for _ in range(nb):
        H = _spd(rng, dx + dy, 0.5, 2.0)
        out.append((H, rng.standard_normal(dx + dy)))
    return out


def _closed_form(qs, x, y, alpha, pi, xi, xi_t, zeta):
    """Eq. (4) for quadratics: y⁺ = y − α∇_yF_π(x, y);
    h = ∇_x F_ξ(x, y⁺) − α (H_ζ)_{xy} ∇_y F_ξ̃(x, y⁺)."""
    dx = x.size

    def grad(b, y_):
        H, g = qs[b]
        return H @ np.concatenate([x, y_]) + g

    y_plus = y - alpha * grad(pi, y)[dx:]
    h = grad(xi, y_plus)[:dx] - alpha * qs[zeta][0][:dx, dx:] @ grad(xi_t, y_plus)[dx:]
    return h, y_plus


def _torch_F(qs):
    Ts = [(torch.tensor(H, dtype=DT), torch.tensor(g, dtype=DT)) for H, g in qs]

    def F(xs, ys, batch):
        H, g = Ts[0 if batch is None else batch]
        z = torch.cat([xs[0], ys[0]])
        return 0.5 * z @ H @ z + g @ z

    return F


# ---------------------------------------------------------------- hypergradient routine (eq. 4)

@pytest.mark.parametrize("mode,rtol", [("exact", EXACT_RTOL), ("finite-difference", FD_RTOL)])
@pytest.mark.parametrize("batch_kind", ["deterministic", "two", "four"])
def test_bilevel_direction_matches_closed_form_on_quadratic(mode, rtol, batch_kind):
    rng = np.random.default_rng(7)
    dx, dy, alpha = 5, 7, 0.1
    qs = _quadratic_batches(rng, dx, dy, 4)
    x, y = rng.standard_normal(dx), rng.standard_normal(dy)
    if batch_kind == "deterministic":
        batches, roles = (None, None), (0, 0, 0, 0)
    elif batch_kind == "two":   # (inner, outer): π = ζ = inner, ξ = ξ̃ = outer
        batches, roles = (0, 1), (0, 1, 1, 0)
    else:                       # (π, ξ, ξ̃, ζ), Algorithm 1 line 4
        batches, roles = (0, 1, 2, 3), (0, 1, 2, 3)
    h_ref, yp_ref = _closed_form(qs, x, y, alpha, *roles)
    h, yp = bilevel_direction(_torch_F(qs), [torch.tensor(x, dtype=DT)], [torch.tensor(y, dtype=DT)],
                              alpha, batches, mode=mode)
    assert _rel(yp[0].numpy(), yp_ref) < EXACT_RTOL
    assert _rel(h[0].numpy(), h_ref) < rtol


def test_experiment_problem_hypergradient_matches_closed_form():
    """On the experiment's own (nonconvex) f: h = ∇_x f(x, y⁺) − α H_xy ∇_y f(x, y⁺), both modes
    (the cosine term depends on x only, so the mixed Hessian is H_xy)."""
    cfg = BilevelConfig(dim_x=6, dim_y=9, seed=3)
    prob, x, y = make_problem(cfg)
    alpha = theorem_constants(prob)["alpha"]
    y_plus = y - alpha * prob.grad_y(x, y)
    h_ref = prob.grad_x(x, y_plus) - alpha * prob.Hxy @ prob.grad_y(x, y_plus)
    for mode, rtol in (("exact", EXACT_RTOL), ("finite-difference", FD_RTOL)):
        h, yp = bilevel_direction(prob.F, [x], [y], alpha, (None, None), mode=mode)
        assert _rel(yp[0], y_plus) < EXACT_RTOL
        assert _rel(h[0], h_ref) < rtol, mode


# ---------------------------------------------------------------- problem and constants

def test_implicit_hypergradient_matches_finite_difference_of_phi():
    """Lemma A.2: ∇Φ(x) = ∇_x f(x, y*(x)) against central differences of Φ(x) = f(x, y*(x))."""
    prob, x, _ = make_problem(BilevelConfig(dim_x=6, dim_y=9, seed=1))
    assert torch.linalg.norm(prob.grad_y(x, prob.y_star(x))) < 1e-12   # y* is the LL minimiser
    step, fd = 1e-5, torch.empty_like(x)
    for i in range(x.numel()):
        e = torch.zeros_like(x)
        e[i] = step
        fd[i] = (prob.phi(x + e) - prob.phi(x - e)) / (2 * step)
    assert _rel(prob.grad_phi(x), fd) < 1e-7


def test_constants_and_lemma_a5_bound_at_random_points():
    """L_{f,1} bounds ‖∇²f‖ everywhere, μ is the LL strong-convexity modulus, Φ is nonconvex, and
    Lemma A.5's bias bound holds at arbitrary (x, y), not only along the trajectory."""
    prob, _, _ = make_problem(BilevelConfig(seed=5))
    k = theorem_constants(prob)
    L, mu, alpha = k["L_f1"], k["mu"], k["alpha"]
    assert alpha == pytest.approx(1 / (4 * L)) and k["phi_nonconvex"]
    assert k["kappa"] < 2 and k["eta"] > 0.01          # well conditioned: η not tiny
    assert torch.linalg.eigvalsh(prob.Hyy)[0].item() == pytest.approx(mu)
    gen = torch.Generator().manual_seed(0)
    dx = prob.dim_x
    for _ in range(50):
        x = 4 * torch.randn(dx, generator=gen, dtype=DT)
        y = 4 * torch.randn(prob.gy.numel(), generator=gen, dtype=DT)
        hess = prob.H.clone()
        hess[:dx, :dx] -= prob.c * torch.diag(torch.cos(x))
        assert torch.linalg.matrix_norm(hess, 2) <= L * (1 + 1e-12)
        (h,), _ = bilevel_direction(prob.F, [x], [y], alpha, (None, None))
        bias = torch.linalg.norm(h - prob.grad_phi(x)).item()
        bound = k["lemma_a5_constant"] * torch.linalg.norm(y - prob.y_star(x)).item()
        assert bias <= bound * (1 + 1e-10)


# ---------------------------------------------------------------- config validation

@pytest.mark.parametrize("field,value,flag", [
    ("max_steps", 0, "--max-steps"),
    ("dim_x", 0, "--dim-x"),
    ("dim_y", -3, "--dim-y"),
    ("dim_x", 2.5, "--dim-x"),
    ("seed", -1, "--seed"),
    ("fit_points", 1, "--fit-points"),
    ("fit_min_steps", 10_000, "--max-steps"),
    ("nonconvexity", -0.5, "--nonconvexity"),
    ("nonconvexity", float("nan"), "--nonconvexity"),
    ("schur_min", 0.0, "--schur-min"),
    ("schur_max", 0.1, "--schur-max"),
    ("lower_mu", -1.0, "--lower-mu"),
    ("lower_max", 0.5, "--lower-max"),
    ("coupling", -0.1, "--coupling"),
    ("hypergradient_mode", "none", "--hypergradient-mode"),
    ("fd_eps", 0.0, "--fd-eps"),
    ("alpha", 0.0, "--alpha"),
    ("eta", -1e-3, "--eta"),
])
def test_bad_config_raises_config_error(field, value, flag):
    cfg = replace(BilevelConfig(), **{field: value})
    with pytest.raises(ConfigError, match=flag) as ei:
        cfg.validate()
    assert isinstance(ei.value, ValueError)
    with pytest.raises(ConfigError):
        run_bilevel_convergence(cfg)


def test_default_config_is_valid():
    assert BilevelConfig().validate().max_steps == 10_000


# ---------------------------------------------------------------- the experiment

SMALL = dict(dim_x=4, dim_y=6, max_steps=400, fit_min_steps=10, fit_points=8)


def _strip_runtime(r):
    return {k: v for k, v in r.items() if k != "runtime_s"}


def test_small_run_is_deterministic_and_json_serialisable():
    a = run_bilevel_convergence(BilevelConfig(seed=4, **SMALL))
    b = run_bilevel_convergence(BilevelConfig(seed=4, **SMALL))
    assert json.dumps(_strip_runtime(a), allow_nan=False) == json.dumps(_strip_runtime(b), allow_nan=False)
    c = run_bilevel_convergence(BilevelConfig(seed=5, **SMALL))
    assert c["trace"]["grad_phi_sq"] != a["trace"]["grad_phi_sq"]
    assert len(a["trace"]["running_avg_grad_phi_sq"]) == SMALL["max_steps"]
    assert a["trace"]["running_avg_grad_phi_sq"][0] == a["trace"]["grad_phi_sq"][0]


def test_finite_difference_mode_follows_exact_trajectory():
    ex = run_bilevel_convergence(BilevelConfig(seed=2, **SMALL))
    fd = run_bilevel_convergence(BilevelConfig(seed=2, hypergradient_mode="finite-difference", **SMALL))
    assert fd["bias_check"]["violations"] == 0
    assert _rel(fd["trace"]["phi"], ex["trace"]["phi"]) < 1e-9


def test_full_experiment_acceptance(tmp_path):
    """SPEC §6 / Theorem 7.2: (1/T)Σ‖∇Φ‖² = O(1/T) (slope ≤ −0.9 on T ∈ [1e2, 1e4]) and the
    measured bias never exceeds Lemma A.5's bound; Φ nonconvex; default (10⁴-step) config."""
    r = run_bilevel_convergence(BilevelConfig())
    json.dumps(r, allow_nan=False)
    assert r["fit"]["T_min"] == 100 and r["fit"]["T_max"] == 10_000
    assert r["fit"]["slope"] <= SLOPE_THRESHOLD
    bc = r["bias_check"]
    assert bc["violations"] == 0 and bc["lemma_a1_violations"] == 0
    assert bc["steps_resolved"] >= 100 and 0 < bc["max_ratio_bias_over_bound"] <= 1
    assert r["checks"]["passed"] and r["checks"]["phi_nonconvex"]
    assert r["final"]["grad_phi_sq"] < 1e-20          # converged to a stationary point
    for key in ("L_f1", "mu", "alpha", "eta", "L_phi"):
        assert math.isfinite(r["constants"][key]) and r["constants"][key] > 0
    out = tmp_path / "bilevel.png"
    plot_bilevel_convergence(r, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

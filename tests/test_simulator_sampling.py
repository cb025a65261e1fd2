"""Client sampling in the embedded simulator (Federation.sample_fraction / participants,
Method.snapshot / restore), checked through FedAvg-LoRA on stacked replicas."""
import math

import pytest
import torch
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.methods import FedAvgLoRA, RoLoRA
from fedlora.methods.fedavg import broadcast_initial_factors
from fedlora.simulator import Federation, run_rounds

F64 = torch.float64
D, R = 5, 2


def _problem(G, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(D, D, R, stack=G, dtype=F64)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=F64))
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=F64))
    X, Y = torch.randn(G, 20, D, generator=g, dtype=F64), torch.randn(G, 20, D, generator=g, dtype=F64)

    def objective(params, batch):
        return ((functional_call(layer, params, (batch[0],)) - batch[1]) ** 2).mean(dim=(-2, -1))

    return layer, objective, lambda: (X, Y)


# ---------------------------------------------------------------------------------------------
# who takes part

@pytest.mark.parametrize("K,fraction", [(7, 0.1), (7, 0.3), (7, 0.5), (8, 0.5), (10, 0.25), (3, 0.99), (5, 1.0)])
def test_participants_count_range_and_determinism(K, fraction):
    fed = Federation(2, K, sample_fraction=fraction, sample_seed=3)
    want = max(1, math.ceil(fraction * K))
    for rnd in range(6):
        for g in range(2):
            p = fed.participants(rnd, g)
            assert len(p) == want == len(set(p)) and p == sorted(p) and all(0 <= k < K for k in p)
            assert p == Federation(2, K, sample_fraction=fraction, sample_seed=3).participants(rnd, g)


def test_participants_vary_with_round_group_and_seed():
    fed = Federation(3, 10, sample_fraction=0.3, sample_seed=0)
    rounds = {tuple(fed.participants(r, 0)) for r in range(10)}
    groups = {tuple(fed.participants(0, g)) for g in range(3)}
    seeds = {tuple(Federation(1, 10, sample_fraction=0.3, sample_seed=s).participants(0, 0)) for s in range(10)}
    assert len(rounds) > 1 and len(groups) > 1 and len(seeds) > 1
    assert Federation(1, 4).participants(0, 0) == [0, 1, 2, 3]  # fraction 1: everyone


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan"), "half"])
def test_bad_fraction_raises(fraction):
    with pytest.raises(ConfigError, match="sample_fraction"):
        Federation(1, 4, sample_fraction=fraction)


# ---------------------------------------------------------------------------------------------
# what a sampled-out client does in a round: nothing

class _Spy:
    """Wraps a method's hooks to record the parameters at round start / just before the first
    download, the aggregation weights and the payloads."""

    def __init__(self, method, layer):
        self.start, self.before_download, self.weights, self.uploads = [], [], [], []
        begin, download, aggregate = method.begin_round, method.download, method.aggregate
        params = lambda: (layer.lora_A.detach().clone(), layer.lora_B.detach().clone())  # noqa: E731
        self._downloads = 0

        def begin_round(rnd):
            self.start.append(params())
            self._downloads = 0
            return begin(rnd)

        def download_(i, state):
            if self._downloads == 0:
                self.before_download.append(params())
            self._downloads += 1
            return download(i, state)

        def aggregate_(payloads, weights):
            self.weights.append(weights.clone())
            self.uploads.append(payloads)
            return aggregate(payloads, weights)

        method.begin_round, method.download, method.aggregate = begin_round, download_, aggregate_


def _run_fedavg(fraction=0.5, rounds=4, K=4, groups=2, weights=(1.0, 2.0, 3.0, 4.0), optimizer="adamw"):
    G = groups * K
    layer, objective, sample = _problem(G)
    m = FedAvgLoRA(rank=R, lr=0.05, optimizer=optimizer)
    m.setup(layer, list(range(K)) * groups)
    spy = _Spy(m, layer)
    fed = Federation(groups, K, client_weights=list(weights), sample_fraction=fraction, sample_seed=11)
    hist = run_rounds(m, fed, objective, sample, rounds, 3)
    return fed, hist, spy, m, layer


def test_sampled_out_replicas_do_not_train():
    fed, hist, spy, _, _ = _run_fedavg()
    K = fed.n_clients
    for rnd, h in enumerate(hist):
        (a0, b0), (a1, b1) = spy.start[rnd], spy.before_download[rnd]
        # the drawn replicas' ids, as fedlora run's rounds.jsonl lists its clients (not a mask over replicas)
        assert h["participants"] == [g * K + k for g in range(fed.n_groups) for k in fed.participants(rnd, g)]
        for i in range(fed.n_replicas):
            active = (i % K) in fed.participants(rnd, i // K)
            assert (i in h["participants"]) == active
            assert torch.equal(a0[i], a1[i]) == (not active) and torch.equal(b0[i], b1[i]) == (not active)


def test_weights_renormalised_over_participants_and_global_state():
    fed, hist, spy, _, layer = _run_fedavg()
    w_all = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    calls = iter(zip(spy.weights, spy.uploads))
    for rnd in range(len(hist)):
        for g in range(fed.n_groups):
            w, payloads = next(calls)
            active = fed.participants(rnd, g)
            torch.testing.assert_close(w, w_all[active] / w_all[active].sum(), rtol=0, atol=1e-15)
            assert len(payloads) == len(active) == 2
    # the last round's global A is the renormalised mean of the participants' uploads only
    w, last = spy.weights[-1], spy.uploads[-1]
    want = sum(wk * p.tensors["lora_A"] for wk, p in zip(w, last))
    for i in fed.replicas_of(fed.n_groups - 1):
        torch.testing.assert_close(layer.lora_A[i].detach(), want, rtol=1e-14, atol=1e-14)


def test_bytes_counted_for_who_sends_and_who_needs_the_download():
    """Uploads: this round's participants. Downloads of the full state (FedAvg): the clients drawn
    for the next round, who receive it before training (after the last round: everyone)."""
    fed, hist, _, m, _ = _run_fedavg()
    full = m.upload(0).nbytes
    for t, h in enumerate(hist):
        nxt = hist[t + 1]["participants"] if t + 1 < len(hist) else list(range(fed.n_replicas))
        for i in range(fed.n_replicas):
            assert h["bytes_up"][i] == (full if i in h["participants"] else 0)
            assert h["bytes_down"][i] == (full if i in nxt else 0)
        assert len(h["participants"]) == fed.n_groups * 2


def test_incremental_downloads_count_for_every_client():
    """FLoRA's download is a stack each client merges, so every client needs it every round."""
    from fedlora.methods import create_method

    G, K = 4, 4
    layer = LoRALinear(5, 5, 2, stack=G, dtype=torch.float64)
    with torch.no_grad():
        layer.lora_A[:] = layer.lora_A[0].clone()
    m = create_method("flora", rank=2, lr=0.01)
    fed = Federation(1, K, sample_fraction=0.5, sample_seed=1)
    m.setup(layer, fed.replica_clients)
    X = torch.randn(G, 10, 5, dtype=torch.float64)

    def objective(params, batch):
        return (layer.forward_with(params, batch) ** 2).mean(dim=(-2, -1))

    hist = run_rounds(m, fed, objective, lambda: X, rounds=3, local_steps=1)
    for h in hist:
        assert all(b > 0 for b in h["bytes_down"]) and sum(b > 0 for b in h["bytes_up"]) == 2


def test_full_participation_takes_no_snapshot_and_matches_fraction_one():
    """When every client is drawn — fraction 1, or 0.9 of 4 clients (⌈3.6⌉ = 4) — run_rounds neither
    snapshots nor restores anything, and the run equals the fraction-1 run bit for bit."""
    runs = {}
    for fraction in (1.0, 0.9):
        layer, objective, sample = _problem(8)
        m = FedAvgLoRA(rank=R, lr=0.05)
        m.setup(layer, list(range(4)) * 2)
        calls = []
        snapshot, restore = m.snapshot, m.restore
        m.snapshot = lambda: calls.append("snapshot") or snapshot()
        m.restore = lambda snap, reps: calls.append(("restore", list(reps))) or restore(snap, reps)
        fed = Federation(2, 4, client_weights=[1.0, 2.0, 3.0, 4.0], sample_fraction=fraction, sample_seed=11)
        hist = run_rounds(m, fed, objective, sample, 4, 3)
        assert calls == [], (fraction, calls)
        assert all(h["participants"] == list(range(fed.n_replicas)) for h in hist)
        runs[fraction] = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()
    assert torch.equal(runs[1.0][0], runs[0.9][0]) and torch.equal(runs[1.0][1], runs[0.9][1])
    # and a fraction that leaves clients out does snapshot, once per round
    layer, objective, sample = _problem(4)
    m = FedAvgLoRA(rank=R, lr=0.05)
    m.setup(layer, list(range(4)))
    n = []
    snapshot = m.snapshot
    m.snapshot = lambda: n.append(1) or snapshot()
    run_rounds(m, Federation(1, 4, sample_fraction=0.5), objective, sample, 3, 2)
    assert len(n) == 3


def test_sampled_runs_are_reproducible():
    _, _, _, _, l1 = _run_fedavg(fraction=0.5)
    _, _, _, _, l2 = _run_fedavg(fraction=0.5)
    assert torch.equal(l1.lora_A, l2.lora_A) and torch.equal(l1.lora_B, l2.lora_B)


def test_rolora_stays_exact_under_sampling():
    """A sampled-out client receives the global factor too, so the next round's frozen factor is
    still shared and RoLoRA's rounds stay exact."""
    from fedlora.aggmath import exact_delta

    K, G = 4, 4
    fed = Federation(1, K, client_weights=[1, 2, 3, 4], sample_fraction=0.5, sample_seed=5)
    m = RoLoRA(rank=R, lr=0.05)
    layer, objective, sample = _problem(G, seed=1)
    broadcast_initial_factors(layer, [list(range(G))])
    m.setup(layer, list(range(K)))
    spy = _Spy(m, layer)
    hist = run_rounds(m, fed, objective, sample, 4, 2)
    for rnd in range(4):
        active = fed.participants(rnd, 0)
        a1, b1 = spy.before_download[rnd]
        w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)[active]
        want = exact_delta([b1[i] for i in active], [a1[i] for i in active], w)
        end_A, end_B = (spy.start[rnd + 1] if rnd + 1 < 4 else (layer.lora_A.detach(), layer.lora_B.detach()))
        for i in range(G):
            got = end_B[i] @ end_A[i]
            assert float((got - want).norm() / want.norm()) < 1e-10
        assert all(hist[rnd]["bytes_up"][i] == 0 for i in range(G) if i not in active)


# ---------------------------------------------------------------------------------------------
# snapshot / restore directly

def test_snapshot_restore_puts_back_params_and_moments_of_chosen_replicas_only():
    layer, objective, sample = _problem(4)
    m = FedAvgLoRA(rank=R, lr=0.05)
    m.setup(layer, [0, 1, 2, 3])
    m.local_step(objective, sample)  # AdamW state exists
    snap = m.snapshot()
    st = m.opt.state[layer.lora_A]
    before = layer.lora_A.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    for _ in range(2):
        m.local_step(objective, sample)
    moved = layer.lora_A.detach().clone(), st["exp_avg"].clone()
    m.restore(snap, [1, 3])
    for i in range(4):
        back = i in (1, 3)
        assert torch.equal(layer.lora_A[i], before[0][i]) == back
        assert torch.equal(layer.lora_A[i], moved[0][i]) == (not back)
        assert torch.equal(st["exp_avg"][i], before[1][i]) == back
        if back:
            assert torch.equal(st["exp_avg_sq"][i], before[2][i])
    m.restore(snap, [])  # a no-op


def test_sampled_out_replicas_keep_fresh_optimizer_state_in_round_0():
    fed, hist, _, m, layer = _run_fedavg(rounds=1)
    st = m.opt.state[layer.lora_A]
    for i in range(fed.n_replicas):
        if i not in hist[0]["participants"]:
            assert torch.all(st["exp_avg"][i] == 0) and torch.all(st["exp_avg_sq"][i] == 0)

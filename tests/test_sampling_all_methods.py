"""Client sampling with EVERY registered method, through the library path the compare harness uses
(``fedlora.synthetic.runner.run_method`` → ``fedlora.simulator.run_rounds``): 3 rounds, half the clients.

Per round, a sampled-out client must reach the download exactly as it began the round: parameters,
stacked buffers (masks), optimizer moments and step counts, and the method's per-client state. What
a method keeps on the client (never downloaded) must also survive the download unchanged.
"""
import pytest
import torch

import fedlora.synthetic.runner as runner
from fedlora.errors import ConfigError
from fedlora.methods import available_methods, create_method
from fedlora.simulator import Federation, run_rounds
from fedlora.adapter import LoRALinear
from fedlora.synthetic.compare import method_spec
from fedlora.synthetic.data import make_heterogeneous_clients
from fedlora.synthetic.runner import run_method, stack_federations

K, RANK, ROUNDS = 4, 3, 3

#: parameters a method never downloads (they stay with the client): unchanged for a sampled-out
#: client over the whole round, download included
PRIVATE = {"local": ("lora_A", "lora_B"), "fedsa": ("lora_B",), "pf2lora": ("lora_C", "lora_D"),
           "feddpa": ("lora_C", "lora_D"),
           "h2tune": ("lora_A", "lora_B", "lora_R", "lora_Phi")}
#: sparse H²Tune supports (re-chosen every round start) make the masks part of what is restored
OVERRIDES = {"h2tune": {"densities": [0.5, 1.0, 0.3, 0.8]}}


@pytest.fixture(scope="module")
def data():
    feds = [make_heterogeneous_clients("classification", s, 1.0, n_clients=K, d_in=6, d_out=4, shared_rank=1,
                                       private_rank=1, n_train=(10, 12, 14, 16), n_test=10) for s in (0, 1)]
    return stack_federations("classification", feds, [0, 1], 4, val_fraction=0.2)


def _capture(method, G):
    """Per-replica state, read independently of Method.snapshot: {key: tensor with leading dim G}."""
    state = {f"param:{n}": p.detach().clone() for n, p in method.model.named_parameters() if p.shape[:1] == (G,)}
    state.update({f"buffer:{n}": b.clone() for n, b in method.model.named_buffers()
                  if b is not None and b.shape[:1] == (G,)})
    for opt in [o for o in vars(method).values() if isinstance(o, torch.optim.Optimizer)]:
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape[:1] == (G,):
                    state[f"opt:{id(p)}:{k}"] = v.clone()
    state.update({f"extra:{k}": v.clone() for k, v in method._extra_state().items() if v.shape[:1] == (G,)})
    return state


class _Watch:
    """Wraps the method's hooks inside run_rounds: state before begin_round, at the round's first
    download and at the next round's start."""

    def __init__(self, method, fed: Federation):
        self.method, self.fed, self.G = method, fed, fed.n_replicas
        self.start, self.pre_download, self.rounds = [], [], 0
        begin, download = method.begin_round, method.download
        self._first = True

        def begin_round(rnd):
            self.start.append(_capture(method, self.G))
            self._first = True
            self.rounds += 1
            return begin(rnd)

        def download_(i, state):
            if self._first:
                self.pre_download.append(_capture(method, self.G))
                self._first = False
            return download(i, state)

        method.begin_round, method.download = begin_round, download_

    def idle(self, rnd):
        K = self.fed.n_clients
        return [g * K + k for g in range(self.fed.n_groups) for k in range(K) if k not in self.fed.participants(rnd, g)]


def _run_watched(monkeypatch, name, data, **kw):
    watches = []

    def watched_run_rounds(method, fed, *a, **k):
        watches.append(_Watch(method, fed))
        hist = run_rounds(method, fed, *a, **k)
        watches[-1].end = _capture(method, fed.n_replicas)
        return hist

    monkeypatch.setattr(runner, "run_rounds", watched_run_rounds)
    spec = method_spec(name, RANK, K, OVERRIDES.get(name))
    res = run_method(name, data, lr=0.01, rounds=ROUNDS, local_steps=2, options=spec.options, adapter=spec.adapter,
                     lr_arg=spec.lr_arg, sample_fraction=0.5, sample_seed=0, **kw)
    return res, watches[0]


@pytest.mark.parametrize("name", [m for m in available_methods() if m != "centralized"])
def test_every_method_runs_with_half_the_clients_and_idle_clients_do_nothing(name, data, monkeypatch):
    res, w = _run_watched(monkeypatch, name, data)
    assert res.error is None, res.error
    assert w.rounds == ROUNDS and len(res.history) == ROUNDS
    silent = name == "local"
    for rnd, rec in enumerate(res.history):
        idle = w.idle(rnd)
        assert len(idle) == w.G // 2 and set(range(w.G)) - set(rec["participants"]) == set(idle)
        for i in range(w.G):
            assert (rec["bytes_up"][i] > 0) == (i not in idle and not silent), (rnd, i, rec["bytes_up"])
        start, pre = w.start[rnd], w.pre_download[rnd]
        for key, before in start.items():
            if key.startswith("opt:") and key not in pre:
                continue  # an optimizer rebuilt at round start (FlexLoRA): see the next check
            for i in idle:
                assert torch.equal(pre[key][i], before[i]), (name, rnd, i, key)
        for key in set(pre) - set(start):  # state born in this round: idle clients have none (fresh)
            assert all(torch.all(pre[key][i] == 0) for i in idle), (name, rnd, key)
        end = w.start[rnd + 1] if rnd + 1 < ROUNDS else w.end
        for leaf in PRIVATE.get(name, ()):
            keys = [k for k in start if k.startswith("param:") and k[6:].rsplit(".", 1)[-1] == leaf]
            assert keys, (name, leaf)
            for key in keys:
                for i in idle:
                    assert torch.equal(end[key][i], start[key][i]), (name, rnd, i, key)
    assert all(torch.isfinite(torch.tensor(res.final["test_loss"])))


def test_centralized_refuses_client_sampling_with_its_clear_error(data):
    spec = method_spec("centralized", RANK, K)
    with pytest.raises(ConfigError, match="Centralized has no clients to sample — use sample_fraction=1"):
        run_method("centralized", data, lr=0.01, rounds=ROUNDS, local_steps=2, options=spec.options,
                   sample_fraction=0.5)


def test_hetlora_sampled_out_client_with_a_larger_rank_takes_its_first_r_k_rows():
    """The reported failure: default HetLoRA (r_max 12, ranks 1, 3, 6, 9), 4 clients, half sampled. The
    server keeps rank r_max whoever took part, and every client holds the first r_k rows/columns of
    that one global adapter (the truncations of one matrix nest)."""
    m = create_method("hetlora", lr=0.01)
    fed = Federation(1, K, sample_fraction=0.5, sample_seed=0)
    layer = LoRALinear(6, 6, **m.adapter_kwargs(), stack=K, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=torch.float64))
    m.setup(layer, fed.replica_clients)
    assert m.ranks.tolist() == [1, 3, 6, 9]
    states = []
    aggregate = m.aggregate
    m.aggregate = lambda payloads, weights: states.append(aggregate(payloads, weights)) or states[-1]
    X = torch.randn(K, 10, 6, generator=g, dtype=torch.float64)
    Y = torch.randn(K, 10, 6, generator=g, dtype=torch.float64)

    def objective(params, batch):
        return ((layer.forward_with(params, batch[0]) - batch[1]) ** 2).mean(dim=(-2, -1))

    after = []
    evaluate = lambda rnd: after.append((layer.lora_A.detach().clone(), layer.lora_B.detach().clone(),  # noqa: E731
                                         m.ranks.tolist())) or {}
    run_rounds(m, fed, objective, lambda: (X, Y), rounds=ROUNDS, local_steps=2, evaluate=evaluate)
    # round 0 draws clients 0 and 1 (ranks 1, 3): the rank-9 client sat out but still downloads
    assert fed.participants(0, 0) == [0, 1]
    assert len(states) == len(after) == ROUNDS
    for state, (A, B, ranks) in zip(states, after):
        assert state["lora_A"].shape == (12, 6) and state["lora_B"].shape == (6, 12)
        for i, r in enumerate(ranks):
            assert torch.equal(A[i, :r], state["lora_A"][:r]) and torch.all(A[i, r:] == 0)
            assert torch.equal(B[i, :, :r], state["lora_B"][:, :r]) and torch.all(B[i, :, r:] == 0)

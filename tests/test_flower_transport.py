"""Flower as a transport of any task kind (fedlora.flower): a node kind registered with ``register_node`` —
here a toy executor of a module no fedlora folder knows — runs over ``FlowerExecutor`` and the one
``client_app``, message by message as on a deployment (tests/_flower_inprocess.py: every message a fresh
process, the node's state only what Flower serialised), and gives what the toy executor gives when called
directly; a process that has not imported the kind's module imports the one the message names; a kind
nobody registered is refused in one line naming the registered ones."""
import sys
import textwrap

import pytest
import torch

pytest.importorskip("flwr")

from _flower_inprocess import OneProcessGrid, run_as_serverapp  # noqa: E402
from fedlora import flower  # noqa: E402
from fedlora.errors import ConfigError  # noqa: E402
from fedlora.server import ClientUpdate, Download  # noqa: E402

#: a toy node kind: client k holds w (float64) and c (bf16); training adds the download and k + round to w,
#: uploads w * 2 and c; evaluation scores sum(w)
TOY = textwrap.dedent('''
    import torch
    from fedlora import flower
    from fedlora.payload import Payload
    from fedlora.server import ClientUpdate

    class Toy:
        live = False
        shared_base = False

        def __init__(self, config):
            n = int(config["clients"])
            self.w = {k: torch.full((3,), float(k), dtype=torch.float64) / 3 for k in range(n)}
            self.c = {k: torch.tensor([k + 0.1], dtype=torch.bfloat16) for k in range(n)}

        def train(self, rnd, clients, downloads):
            out = {}
            for k in clients:
                d = downloads.get(k)
                if d is not None and "g" in d.state:
                    self.w[k] = self.w[k] + d.state["g"]
                self.w[k] = self.w[k] + (k + rnd) / 7
                out[k] = ClientUpdate(Payload({"u": self.w[k] * 2, "c": self.c[k]}, {"k": str(k)}),
                                      float(self.w[k].sum()), [k], 24 if d is not None and d.state else 0)
            return out

        def deliver(self, rnd, downloads):
            return {k: 0 for k in downloads}

        def merge_into_base(self, state):
            raise NotImplementedError

        def evaluate(self, rnd, clients, downloads):
            return {k: {"score": float(self.w[k].sum())} for k in clients}

        def records(self):
            return {k: {"w": self.w[k].clone(), "c": self.c[k].clone()} for k in self.w}

        def restore(self, records):
            for k, r in records.items():
                self.w[k], self.c[k] = r["w"].clone(), r["c"].clone()

    flower.register_node("toy-kind", Toy, clients=lambda config: int(config["clients"]))
''')


@pytest.fixture()
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "fedlora_toy_node.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(flower, "_NODES", dict(flower._NODES))  # the registry as it was, after the test
    yield "fedlora_toy_node"
    sys.modules.pop("fedlora_toy_node", None)


def _rounds(executor, n, rounds=3):
    out = []
    for rnd in range(rounds):
        g = {"g": torch.arange(3, dtype=torch.float64) * (rnd + 1)}
        res = executor.train(rnd, list(range(n)), {k: Download(dict(g)) for k in range(n) if k != rnd % n})
        out.append({k: (r.upload.tensors, dict(r.upload.meta), r.train_loss, r.ranks, r.bytes_down)
                    for k, r in res.items()})
    return out, executor.evaluate(rounds, list(range(n)), {}), executor.records()


def test_a_registered_node_kind_runs_over_flower_as_it_runs_directly(toy_module):
    __import__(toy_module)
    direct = _rounds(flower.registered_nodes()["toy-kind"].build({"clients": 3}), 3)
    grid = OneProcessGrid(3)
    over = run_as_serverapp(lambda g: _rounds(flower.FlowerExecutor(g, {"clients": 3}, 3, node="toy-kind"), 3), grid)
    assert grid.messages == {0: 6, 1: 6, 2: 6}  # hello, 3 train, evaluate, get-record each
    for d, o in zip(direct[0], over[0]):
        for k in range(3):
            (du, dm, dl, dr, db), (ou, om, ol, orr, ob) = d[k], o[k]
            assert dm == om and dl == ol and dr == orr and db == ob
            for name in du:
                assert ou[name].dtype == du[name].dtype and torch.equal(ou[name], du[name])
    assert over[1] == direct[1]
    for k in range(3):
        for name in direct[2][k]:
            assert over[2][k][name].dtype == direct[2][k][name].dtype and torch.equal(over[2][k][name], direct[2][k][name])


def test_a_process_without_the_kinds_module_imports_the_one_the_message_names(toy_module):
    __import__(toy_module)
    conf = {"fedlora-node": "toy-kind", "fedlora-node-module": toy_module}
    del flower._NODES["toy-kind"]
    sys.modules.pop(toy_module)
    assert flower._kind_of(conf).module == toy_module  # imported again: registered again
    assert flower._kind_of(conf).clients({"clients": 5}) == 5


def test_a_kind_nobody_registered_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        flower._node_kind("no-such-kind")
    assert str(e.value).startswith("flower: no node of kind 'no-such-kind' is registered (registered: ")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no node of kind 'no-such-kind'"):
        flower.FlowerExecutor(OneProcessGrid(1), {}, 1, node="no-such-kind")

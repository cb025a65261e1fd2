"""Flower as a transport of any task kind (fedlora.flower): a node kind registered with ``register_node`` —
here a toy executor of a module no fedlora folder knows — runs over ``FlowerExecutor`` and the one
``client_app``, message by message as on a deployment (tests/_flower_inprocess.py: every message a fresh
process, the node's state only what Flower serialised), and gives what the toy executor gives when called
directly; a process that has not imported the kind's module imports the one the message names; a kind
nobody registered is refused in one line naming the registered ones."""
import sys
import textwrap
import time

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


def _rounds(executor, n, rounds=3, clients=None):
    """``rounds`` rounds of ``clients`` (default: all ``n``), then the evaluation of every client after the
    last one (round ``rounds``) and every client's record."""
    out = []
    clients = list(range(n)) if clients is None else clients
    for rnd in range(rounds):
        g = {"g": torch.arange(3, dtype=torch.float64) * (rnd + 1)}
        res = executor.train(rnd, clients, {k: Download(dict(g)) for k in clients if k != rnd % n})
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


def _same_records(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert list(a[k]) == list(b[k]) and a[k]
        for name in a[k]:
            assert a[k][name].dtype == b[k][name].dtype and torch.equal(a[k][name], b[k][name]), (k, name)


def test_the_final_evaluation_brings_the_records_back(toy_module):
    """With ``final_round``, the replies to that round's evaluation of every client carry the nodes' records:
    ``records()`` gives them without a message of its own — the stored record of a client that trained, the
    initial record (built on its node) of one that never did — equal to the executor's own records."""
    __import__(toy_module)
    direct = _rounds(flower.registered_nodes()["toy-kind"].build({"clients": 3}), 3, clients=[0, 1])
    grid = OneProcessGrid(3)
    over = run_as_serverapp(lambda g: _rounds(flower.FlowerExecutor(g, {"clients": 3}, 3, node="toy-kind",
                                                                    final_round=3), 3, clients=[0, 1]), grid)
    assert grid.messages == {0: 5, 1: 5, 2: 2}  # hello, 3 train (not client 2), evaluate: no get-record
    assert over[1] == direct[1]
    _same_records(direct[2], over[2])
    assert not torch.equal(over[2][0]["w"], over[2][2]["w"])  # client 0 trained, client 2 kept its initial w


def test_a_record_changed_after_the_final_evaluation_is_asked_for_again(toy_module):
    """Records kept from the final evaluation are used only while no message could have changed one: after a
    ``train``, ``deliver`` or ``restore`` ``records()`` asks every node (``get-record``) and gives the records as
    they are then; an evaluation (of any round) stores nothing on a node, so the kept records still hold."""
    __import__(toy_module)
    kind = flower.registered_nodes()["toy-kind"]

    def steps(ex, then):
        ex.evaluate(0, [0, 1, 2], {})  # the final round's evaluation of every client
        kept = ex.records()
        then(ex)
        return kept, ex.records()

    g = {"g": torch.ones(3, dtype=torch.float64)}
    cases = [  # what follows the final evaluation; then the messages each node answered in all
        ("train", lambda ex: ex.train(1, [0], {0: Download(dict(g))}), [4, 3, 3]),  # hello, evaluate, train, get-record
        ("deliver", lambda ex: ex.deliver(1, {k: Download(dict(g)) for k in range(3)}), [4, 4, 4]),
        ("restore", lambda ex: ex.restore({k: {"w": torch.full((3,), 5.0, dtype=torch.float64),
                                               "c": torch.tensor([k], dtype=torch.bfloat16)} for k in range(3)}),
         [4, 4, 4]),
        ("evaluate", lambda ex: ex.evaluate(1, [0, 1, 2], {}), [3, 3, 3])]  # hello, 2 evaluate: no get-record
    for name, then, messages in cases:
        grid = OneProcessGrid(3)
        kept, after = run_as_serverapp(lambda gr: steps(flower.FlowerExecutor(gr, {"clients": 3}, 3, node="toy-kind",
                                                                              final_round=0), then), grid)
        direct = steps(kind.build({"clients": 3}), then)
        _same_records(direct[0], kept)
        _same_records(direct[1], after)
        assert [grid.messages[k] for k in range(3)] == messages, name


def test_a_deliver_to_every_client_is_also_the_evaluation_that_follows_it(toy_module):
    """``evaluate_with_deliver``: each node evaluates in the deliver message, on what it then holds, and
    ``evaluate`` gives those scores without a message — only when asked exactly that: the deliver's round,
    every client, each with the empty uncounted download of a synchronised client (``fedlora run``); any other
    evaluation is sent. The final round's deliver also brings the records back."""
    __import__(toy_module)
    kind = flower.registered_nodes()["toy-kind"]
    g = {"g": torch.ones(3, dtype=torch.float64)}
    synced = {k: Download({}, counted=False) for k in range(3)}

    def steps(ex, rnd, downloads):
        ex.train(0, [0, 2], {0: Download(dict(g))})
        ex.deliver(1, {k: Download(dict(g)) for k in range(3)})
        return ex.evaluate(rnd, [0, 1, 2], downloads), ex.records()

    cases = [  # evaluation asked after round 1's deliver → the messages each node answered in all
        ("the deliver's", 1, synced, [3, 2, 3]),  # hello, train (not client 1), deliver: no evaluate, no get-record
        ("another round's", 2, synced, [4, 3, 4]),  # its evaluate sent (the records came with the deliver)
        ("with a download", 1, {**synced, 1: Download(dict(g), counted=False)}, [4, 3, 4]),
        ("counted", 1, {**synced, 2: Download({}, counted=True)}, [4, 3, 4])]
    for name, rnd, downloads, messages in cases:
        grid = OneProcessGrid(3)
        scores, records = run_as_serverapp(lambda gr: steps(flower.FlowerExecutor(
            gr, {"clients": 3}, 3, node="toy-kind", final_round=1, evaluate_with_deliver=True), rnd, downloads), grid)
        direct = steps(kind.build({"clients": 3}), rnd, downloads)
        assert scores == direct[0], name
        _same_records(direct[1], records)
        assert [grid.messages[k] for k in range(3)] == messages, name
    # a deliver to some clients only (a live executor's clients drawn next, say) evaluates nothing
    grid = OneProcessGrid(3)
    run_as_serverapp(lambda gr: flower.FlowerExecutor(gr, {"clients": 3}, 3, node="toy-kind", evaluate_with_deliver=True)
                     .deliver(1, {0: Download(dict(g))}), grid)
    assert [grid.messages[k] for k in range(3)] == [2, 1, 1]
    live = OneProcessGrid(3)

    def live_steps(gr):
        ex = flower.FlowerExecutor(gr, {"clients": 3}, 3, node="toy-kind", evaluate_with_deliver=True, live=True)
        ex.deliver(0, {k: Download(dict(g)) for k in range(3)})
        return ex.evaluate(0, [0, 1, 2], {})
    assert run_as_serverapp(live_steps, live) == kind.build({"clients": 3}).evaluate(0, [0, 1, 2], {})
    assert [live.messages[k] for k in range(3)] == [2, 2, 2]  # hello, deliver (which evaluated: live, no download)


class _SlowGrid(OneProcessGrid):
    """Replies readable only ``delay`` seconds after their message was pushed (a deployment's ClientApp
    process); ``pulls`` counts the pulls (on a deployment each is a request the SuperLink serves)."""

    delay, pulls = 0.0, 0

    def push_messages(self, messages):
        self.ready_at = time.monotonic() + self.delay
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        self.pulls += 1
        return super().pull_messages(message_ids) if time.monotonic() >= self.ready_at else []


def test_a_wave_is_pulled_ever_less_often_while_no_reply_comes(toy_module):
    """The first pulls of a wave come 0.05 s apart, then ×2 up to ``max_poll`` (0.5 s): a 1.2 s wave costs
    a handful of pulls instead of two dozen, and its replies are read at most ``max_poll`` late."""
    __import__(toy_module)
    grid = _SlowGrid(1)
    ex = run_as_serverapp(lambda gr: flower.FlowerExecutor(gr, {"clients": 1}, 1, node="toy-kind"), grid)
    grid.delay, grid.pulls = 1.2, 0
    t0 = time.monotonic()
    run_as_serverapp(lambda gr: ex.evaluate(0, [0], {}), grid)
    took = time.monotonic() - t0
    assert 3 <= grid.pulls <= 8, grid.pulls  # at 0, .05, .15, .35, .75, 1.25 s (sleeps only ever run late)
    assert 1.2 <= took < 1.2 + 0.5 + 1.0, took


def test_the_nodes_answer_hello_while_the_server_builds_its_run(toy_module):
    """``connect=False``: the nodes are asked which partition they hold and the answers read later
    (``connect``, or the first message); a node's bad answer is raised there, in one line."""
    __import__(toy_module)
    grid = OneProcessGrid(3)

    def main_(gr):
        ex = flower.FlowerExecutor(gr, {"clients": 3}, 3, node="toy-kind", connect=False)
        assert sum(grid.messages.values()) == 3 and ex._node_of is None  # asked, not read yet
        return ex.connect()
    node_of = run_as_serverapp(main_, grid)
    assert {k: grid.partition[n] for k, n in node_of.items()} == {0: 0, 1: 1, 2: 2}
    # a SuperNode holding no partition: the answer read by connect() is the node's one-line reason
    grid = OneProcessGrid(2)
    del grid.state[grid.NODE0]
    from flwr.app import Context, RecordDict
    from flwr.common.serde import context_to_proto
    grid.state[grid.NODE0] = context_to_proto(Context(run_id=grid.run_id, node_id=grid.NODE0, node_config={},
                                                      state=RecordDict(), run_config={})).SerializeToString()
    ex = run_as_serverapp(lambda gr: flower.FlowerExecutor(gr, {"clients": 2}, 2, node="toy-kind", connect=False), grid)
    with pytest.raises(ConfigError, match="has no partition: start it with --node-config") as e:
        run_as_serverapp(lambda gr: ex.connect(), grid)
    assert "\n" not in str(e.value)


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

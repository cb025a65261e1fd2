"""Flower as a transport of the server protocol (docs/design.md §9): the record codec, the nodes' message
handlers, the server's ``FlowerExecutor``, the simulation engine — for any task kind that registers a node.

The round loop stays ``fedlora.server.Server.run_round``; Flower is its transport. The server hands
``Server.run_round`` a ``FlowerExecutor``: each client's round is one ``train`` message to the SuperNode
that holds its partition, carrying its download (an ``ArrayRecord`` of the server entries it lacks) and the
run's config; the reply carries its upload (``ArrayRecord`` + the payload's string metadata), its training
loss, ranks and the bytes of the download it applied — or an error. Evaluations are ``evaluate`` messages
(each client scores its own model on its own rows), downloads outside training are ``query`` messages, as are
``hello`` (which partition a node holds) and ``get-record`` / ``put-record`` (a client's state record: a
checkpoint, a resumed run).

A **node** is a ``fedlora.server.ClientExecutor`` a SuperNode builds from the run's config in the message
(cached per process) and drives through that protocol for its one client (its node config's
``partition-id``), keeping the client's state record in the node's ``context.state`` between messages
(``restore`` before, ``records`` after every message). The **node registry**: a task kind calls
``register_node(kind, build, clients=…)`` when its Flower module is imported (``fedlora.llm.flower``:
``llm``, ``fedlora.synthetic.flower``: ``synthetic``); every message names its node kind and the module
that registered it, which a fresh process (a Ray actor, a deployment's ``flwr-clientapp``) imports to find
it. flwr is optional and imported only when a function here is used; importing this module imports torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from fedlora.errors import ConfigError
from fedlora import flower_client
from fedlora.flower_client import partition_of, state_key as _state_key
from fedlora.payload import Payload
from fedlora.server import ClientExecutor, ClientFailure, ClientUpdate, Download

__all__ = ["FlowerExecutor", "client_app", "simulate", "register_node", "registered_nodes", "make_server_app",
           "tensors_to_record", "record_to_tensors", "check_flower_method"]


#: torch dtypes numpy lacks travel as raw bytes under this stype (flwr's own helpers go through numpy)
_RAW_STYPE = "torch.raw"
_RAW = {"bfloat16": (torch.bfloat16, torch.int16)}


def _flwr():
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("the Flower runtime needs flwr: pip install 'fedlora[flower]' (flwr 1.42)") from None
    from flwr import app

    return app


# ------------------------------------------------------------------------------------------------------
# tensors ↔ Flower arrays, bit for bit (float64, int64, uint8 generator states, bfloat16 …)
def tensors_to_record(tensors: Mapping[str, torch.Tensor]):
    app = _flwr()
    rec = app.ArrayRecord()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        dtype = str(t.dtype).replace("torch.", "")
        if dtype in _RAW:
            rec[name] = app.Array(dtype=dtype, shape=tuple(t.shape), stype=_RAW_STYPE,
                                  data=t.view(_RAW[dtype][1]).numpy().tobytes())
        else:
            rec[name] = app.Array.from_numpy_ndarray(t.numpy())
    return rec


def record_to_tensors(rec) -> dict[str, torch.Tensor]:
    out = {}
    for name, a in rec.items():
        if a.stype == _RAW_STYPE:
            dtype, view = _RAW[a.dtype]
            out[name] = torch.frombuffer(bytearray(a.data), dtype=view).view(dtype).reshape(tuple(a.shape)).clone()
        else:
            out[name] = torch.from_numpy(np.array(a.numpy(), copy=True))
    return out


def check_flower_method(method) -> None:
    """Methods the Flower runtime runs: not those that merge into one shared base (FLoRA) or train one
    model on pooled data (Centralized) — both assume the clients share a process."""
    if method.incremental_download or method.pooled_data:
        raise ConfigError(f"--runtime flower: {method.name} is not supported on Flower (it needs "
                          f"{'one base model shared by every client' if method.incremental_download else 'the clients pooled in one process'}); "
                          f"run it embedded")


# ------------------------------------------------------------------------------------------------------
# client side
class _Node:
    """This process's copy of a run's clients: its ``executor`` (a ``fedlora.server.ClientExecutor``), its
    ``n_clients``, every client's initial record (a node's first message) and where the node keeps its
    client's record in ``context.state`` (``state_key``)."""

    def __init__(self, executor, n_clients: int, config_json: str) -> None:
        self.executor, self.n_clients = executor, int(n_clients)
        self.initial = executor.records()
        self.state_key = _state_key(config_json)


@dataclass(frozen=True)
class NodeKind:
    """A registered node: ``build(config)`` gives the node's ``ClientExecutor`` (one client per message; it
    writes nothing), ``clients(config)`` the run's number of clients (read without building the node);
    ``module``: the module that registered it (imported by a process that has not)."""

    build: Callable[[Mapping[str, Any]], ClientExecutor]
    clients: Callable[[Mapping[str, Any]], int]
    module: str


_NODES: dict[str, NodeKind] = {}


def register_node(kind: str, build: Callable[[Mapping[str, Any]], ClientExecutor], *,
                  clients: Callable[[Mapping[str, Any]], int]) -> None:
    """Register the node of task kind ``kind``: ``build(config)`` → its ``fedlora.server.ClientExecutor``,
    ``clients(config)`` → the run's clients, ``config`` being what the server's ``FlowerExecutor`` was given.
    Call it when the kind's Flower module is imported (that module is what a fresh process imports)."""
    _NODES[str(kind)] = NodeKind(build, clients, build.__module__)


def registered_nodes() -> dict[str, NodeKind]:
    """The node kinds registered in this process, by kind."""
    return dict(_NODES)


def _node_kind(kind: str, module: str = "") -> NodeKind:
    """The node kind ``kind``; a process that has not imported the module that registers it (``module``,
    named by the message) imports it first. ``ConfigError`` naming the registered kinds otherwise."""
    if kind not in _NODES and module:
        importlib.import_module(module)
    if kind not in _NODES:
        raise ConfigError(f"flower: no node of kind {kind!r} is registered (registered: "
                          f"{', '.join(sorted(_NODES)) or 'none'}; a task kind registers its node with "
                          f"fedlora.flower.register_node)")
    return _NODES[kind]


_RUNS: dict[str, _Node] = {}  # per process: the node kind and config's digest → its node


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _kind_of(conf) -> NodeKind:
    """The node kind a message's config names."""
    return _node_kind(str(conf["fedlora-node"]), str(conf.get("fedlora-node-module", "")))


def _local_run(conf) -> _Node:
    """This process's node of the run the message ``conf`` names (writes nothing), built once per config."""
    config_json = str(conf["fedlora-config"])
    kind = _kind_of(conf)
    key = f"{conf['fedlora-node']}:{_digest(config_json)}"
    if key not in _RUNS:
        cfg = json.loads(config_json)
        _RUNS.clear()  # one run per process at a time
        _RUNS[key] = _Node(kind.build(cfg), kind.clients(cfg), config_json)
    return _RUNS[key]


def _partition(context, node: _Node) -> int:
    """The client this node holds (its node config's ``partition-id``), checked against the node's clients."""
    return partition_of(context, node.n_clients)


def _load_state(node: _Node, k: int, context) -> None:
    """The client's record from the node's state (its initial record the first time), handed to the executor."""
    if node.state_key in context.state:
        node.executor.restore({k: record_to_tensors(context.state[node.state_key])})
    else:
        node.executor.restore({k: node.initial[k]})


def _save_state(node: _Node, k: int, context) -> None:
    context.state[node.state_key] = tensors_to_record(node.executor.records()[k])


def _downloads(k: int, content) -> dict[int, Download]:
    """Client ``k``'s download in the message, if it carries one (a live executor's clients are current)."""
    return {k: _download(content)} if "download" in content.array_records else {}


def _download(content) -> Download:
    conf = content["config"]
    nbytes = int(conf["download-nbytes"])
    return Download(record_to_tensors(content["download"]), bool(conf["download-counted"]),
                    None if nbytes < 0 else nbytes)


def _reply(msg, **records):
    app = _flwr()
    return app.Message(app.RecordDict(records), reply_to=msg)


def _client_train(msg, context):
    app = _flwr()
    conf = msg.content["config"]
    node = _local_run(conf)
    k = _partition(context, node)
    if int(conf["client"]) != k:
        raise ConfigError(f"misrouted: the message is for client {int(conf['client'])}, this node holds {k}")
    rnd = int(conf["round"])
    _load_state(node, k, context)
    res = node.executor.train(rnd, [k], _downloads(k, msg.content))[k]
    if isinstance(res, ClientFailure):  # its record was not stored: the node keeps the one before the round
        return _reply(msg, result=app.ConfigRecord({"failure-kind": res.kind, "failure-why": res.why,
                                                     "bytes-down": int(res.bytes_down)}))
    _save_state(node, k, context)
    return _reply(msg, upload=tensors_to_record(res.upload.tensors),
                  meta=app.ConfigRecord(dict(res.upload.meta)),
                  result=app.ConfigRecord({"bytes-down": int(res.bytes_down), "ranks": json.dumps(res.ranks),
                                           **({} if res.train_loss is None else {"train-loss": float(res.train_loss)})}))


def _client_query(msg, context):
    """The queries that build the node: ``get-record`` of a client that never trained here (its initial
    record) and ``deliver`` (apply a download outside training). ``hello``, ``put-record`` and ``get-record``
    of a kept record are answered without torch or the node (``fedlora.flower_client``, whose ``client_app``
    hands the others here): on a deployment every message is a new process, and building means importing
    transformers and the model."""
    app = _flwr()
    conf = msg.content["config"]
    op = str(conf["op"])
    node = _local_run(conf)
    k = _partition(context, node)
    _load_state(node, k, context)
    if op == "get-record":  # a client that never trained here: its initial record
        return _reply(msg, record=tensors_to_record(node.executor.records()[k]))
    rnd = int(conf["round"])
    sent = node.executor.deliver(rnd, {k: _download(msg.content)})
    _save_state(node, k, context)
    result = {"bytes-down": int(sent[k])}
    kept = {"record": context.state[node.state_key]} if conf.get("with-record", False) else {}
    if conf.get("then-evaluate", False):  # the evaluation the server makes next (FlowerExecutor.evaluate_with_deliver)
        _load_state(node, k, context)  # from the record just stored, as the evaluation's own process would
        ev = {} if conf["then-evaluate"] == "live" else {k: Download({}, False, None)}
        scores = node.executor.evaluate(rnd, [k], ev)[k]
        result["scores"] = json.dumps(scores, allow_nan=True)
    return _reply(msg, result=app.ConfigRecord(result), **kept)


def _client_evaluate(msg, context):
    """Score the node's client; with ``with-record`` (the run's final evaluation, ``FlowerExecutor``'s
    ``final_round``) the reply also carries the record the node keeps — what ``get-record`` would answer next,
    taken before the evaluation (which stores nothing) — so that the run's end needs no message wave of its own."""
    app = _flwr()
    conf = msg.content["config"]
    node = _local_run(conf)
    k = _partition(context, node)
    _load_state(node, k, context)
    kept = {}
    if conf.get("with-record", False):  # as flower_client's get-record: the stored record, else the initial one
        kept["record"] = (context.state[node.state_key] if node.state_key in context.state
                          else tensors_to_record(node.executor.records()[k]))
    scores = node.executor.evaluate(int(conf["round"]), [k], _downloads(k, msg.content))[k]
    return _reply(msg, result=app.ConfigRecord({"scores": json.dumps(scores, allow_nan=True)}), **kept)


# ------------------------------------------------------------------------------------------------------
# server side
class FlowerExecutor:
    """``fedlora.server.ClientExecutor`` over a Flower ``Grid``: client k's round goes to the node of
    partition k. ``timeout``: seconds a round waits for replies (a client that does not answer is a
    ``timeout`` failure). ``poll``: seconds between the first pulls of a wave's replies, growing ×2 up to
    ``max_poll`` while none comes (flwr's own deployment grid sleeps 3 s; on a deployment each pull is a request
    the SuperLink serves, on the cores the ClientApps need)."""

    shared_base = False  # every client has its own base model (FLoRA is refused: check_flower_method)

    def __init__(self, grid, config: Mapping[str, Any], n_clients: int, *, node: str, timeout: float = 600.0,
                 poll: float = 0.05, max_poll: float = 0.5, node_wait: float = 120.0, live: bool = False,
                 final_round: int | None = None, evaluate_with_deliver: bool = False, connect: bool = True) -> None:
        """``config``: what the nodes rebuild the run from (JSON-able; every message carries it);
        ``n_clients``: the run's clients, one node each; ``node``: the registered node kind the nodes build
        (``register_node``). ``live``: the server sends every client the round's changes at the end of each
        round (``deliver``), as the testbed's executor does, instead of each client's download with its next
        round's message (``fedlora run``). ``final_round``: the round whose evaluation of every client is the
        run's last message before ``records()`` (the final adapters, a last checkpoint): its replies carry each
        node's record, which ``records()`` then gives without asking again — unless a message since could
        have changed one (``train``, ``deliver``, ``restore``). ``evaluate_with_deliver``: the server evaluates
        every client right after a ``deliver`` to every client (the testbed's live rounds; ``fedlora run``'s final
        broadcast): each node evaluates in the deliver message, on what it then holds — with no download
        (``live``) or with the empty one the server sends a synchronised client — and ``evaluate`` gives those
        scores when it is asked exactly that, without a message wave (the final round's deliver also brings the
        records back). ``connect=False``: the nodes are asked which
        partition they hold (``hello``) but the answers are read by ``connect()`` — the caller builds its
        run meanwhile (a deployment's ServerApp: seconds of imports and model, while each node starts a process)."""
        self.grid, self.n_clients, self.timeout = grid, int(n_clients), float(timeout)
        self.poll, self.max_poll = float(poll), max(float(poll), float(max_poll))
        self.live = bool(live)
        self.final_round = None if final_round is None else int(final_round)
        self.node = {"fedlora-node": str(node), "fedlora-node-module": _node_kind(str(node)).module}
        self.config_json = json.dumps(dict(config), sort_keys=True)
        #: every node's record from the final evaluation's replies (``final_round``), until a message changes one
        self._kept: dict[int, Any] | None = None
        self.evaluate_with_deliver = bool(evaluate_with_deliver)
        #: (round, client → scores) of the evaluation made with the last deliver, until a message changes a record
        self._scores: tuple[int, dict[int, Any]] | None = None
        self._node_of: dict[int, int] | None = None
        self._hello = self._say_hello(node_wait)
        if connect:
            self.connect()
        #: what Flower carried for training and synchronisation: array bytes (the tensors) and config bytes
        #: (the run's config travels in every message, so that a node needs nothing but its data)
        self.wire_bytes = {"arrays_down": 0, "arrays_up": 0, "config_down": 0, "messages": 0}

    # -- messages --------------------------------------------------------------------------------------
    def _message(self, kind: str, client: int, rnd: int, download: Download | None = None, *,
                 record: Mapping[str, torch.Tensor] | None = None, node: int | None = None, **conf):
        """A message to client ``client``'s node (``node``: to a node whose partition is not known yet)."""
        app = _flwr()
        config = {"fedlora-config": self.config_json, **self.node, "fedlora-clients": self.n_clients,
                  "client": int(client), "round": int(rnd), **conf}
        records = {} if record is None else {"record": tensors_to_record(record)}
        if download is not None:
            config.update({"download-counted": bool(download.counted),
                           "download-nbytes": -1 if download.nbytes is None else int(download.nbytes)})
            records["download"] = tensors_to_record(download.state)
        records["config"] = app.ConfigRecord(config)
        mtype = {"train": app.MessageType.TRAIN, "evaluate": app.MessageType.EVALUATE,
                 "query": app.MessageType.QUERY}[kind]
        node = self.node_of[client] if node is None else node
        return app.Message(app.RecordDict(records), dst_node_id=node, message_type=mtype, group_id=str(rnd))

    def _exchange(self, msgs, timeout: float) -> dict[int, Any]:
        """Send ``msgs``; the replies by source node (a node that does not answer in time is absent)."""
        return self._collect({i for i in self.grid.push_messages(msgs) if i}, time.monotonic() + timeout)

    def _collect(self, ids: set, deadline: float) -> dict[int, Any]:
        """The replies to the messages ``ids`` by source node, pulled until ``deadline`` (time.monotonic)."""
        out = {}
        wait = self.poll
        while ids:
            got = list(self.grid.pull_messages(ids))
            for m in got:
                out[m.metadata.src_node_id] = m
            ids.difference_update(m.metadata.reply_to_message_id for m in got)
            if not ids or time.monotonic() >= deadline:
                break
            if got:  # a reply came: the others are near
                wait = self.poll
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(2 * wait, self.max_poll)
        return out

    @property
    def node_of(self) -> dict[int, int]:
        """Client → the node id holding its partition (``connect`` reads the nodes' answers, once)."""
        return self._node_of if self._node_of is not None else self.connect()

    def _say_hello(self, node_wait: float):
        """Wait (at most ``node_wait`` s) for the run's SuperNodes to connect and ask each its partition;
        what ``connect`` needs to read the answers."""
        K = self.n_clients
        deadline = time.monotonic() + node_wait
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= K:
                break
            if time.monotonic() > deadline:
                raise ConfigError(f"flower: {len(nodes)} SuperNode(s) connected after {node_wait:.0f} s, the run "
                                  f"has {K} clients (one SuperNode per client)")
            time.sleep(0.2)
        msgs = [self._message("query", -1, -1, op="hello", node=n) for n in nodes]
        return nodes, {i for i in self.grid.push_messages(msgs) if i}, node_wait

    def connect(self) -> dict[int, int]:
        """The nodes' answers to ``hello``: client → node id (``node_of``). ``ConfigError`` (one line) when a
        node does not answer within the wait, holds no partition or the same as another, or a partition has no node."""
        if self._node_of is not None:
            return self._node_of
        nodes, ids, node_wait = self._hello
        replies = self._collect(ids, time.monotonic() + node_wait)
        node_of: dict[int, int] = {}
        for n in nodes:
            rep = replies.get(n)
            if rep is None:
                raise ConfigError(f"flower: SuperNode {n} did not answer within {node_wait:.0f} s")
            if rep.has_error():
                raise ConfigError(f"flower: SuperNode {n}: {_reason(rep)}")
            k = int(rep.content["result"]["partition-id"])
            if k in node_of:
                raise ConfigError(f"flower: SuperNodes {node_of[k]} and {n} both hold partition {k}")
            node_of[k] = n
        missing = [k for k in range(self.n_clients) if k not in node_of]
        if missing:
            raise ConfigError(f"flower: no SuperNode holds partition(s) {missing}")
        self._node_of = node_of
        return node_of

    # -- the executor ----------------------------------------------------------------------------------
    def train(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]):
        self._kept = self._scores = None  # the nodes' records change
        msgs = [self._message("train", k, rnd, None if self.live else downloads.get(k, Download())) for k in clients]
        self._count(msgs)
        replies = self._exchange(msgs, self.timeout)
        out: dict[int, ClientUpdate | ClientFailure] = {}
        for k in clients:
            rep = replies.get(self.node_of[k])
            if rep is None:
                out[k] = ClientFailure(f"no reply within {self.timeout:g} s", "timeout")
                continue
            if rep.has_error():
                out[k] = ClientFailure(_reason(rep), "error")
                continue
            self.wire_bytes["arrays_up"] += _array_nbytes(rep)
            res = rep.content["result"]
            if "failure-kind" in res:
                out[k] = ClientFailure(str(res["failure-why"]), str(res["failure-kind"]), int(res["bytes-down"]))
                continue
            upload = Payload(record_to_tensors(rep.content["upload"]), {a: str(b) for a, b in rep.content["meta"].items()})
            loss = float(res["train-loss"]) if "train-loss" in res else None
            out[k] = ClientUpdate(upload, loss, json.loads(str(res["ranks"])), int(res["bytes-down"]))
        return out

    def deliver(self, rnd: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        self._kept = self._scores = None
        everyone = set(downloads) == set(self.node_of)
        extra = {}
        if self.evaluate_with_deliver and everyone:
            extra["then-evaluate"] = "live" if self.live else "synced"
            if rnd == self.final_round:
                extra["with-record"] = True
        msgs = [self._message("query", k, rnd, d, op="deliver", **extra) for k, d in downloads.items()]
        self._count(msgs)
        replies = self._required(msgs, list(downloads), "did not take the final global state")
        if extra:
            self._scores = (rnd, {k: rep.content["result"]["scores"] for k, rep in replies.items()})
        if "with-record" in extra:
            self._kept = {k: rep.content["record"] for k, rep in replies.items()}
        return {k: int(rep.content["result"]["bytes-down"]) for k, rep in replies.items()}

    def _evaluated_with_deliver(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]):
        """The scores of round ``rnd``'s deliver when this evaluation is the one each node made then: the same
        round, every client, what the server sends each one — nothing (live) or an empty uncounted download."""
        if self._scores is None or self._scores[0] != rnd or set(clients) != set(self._scores[1]):
            return None
        if not self.live and not all(k in downloads and not downloads[k].state and not downloads[k].counted
                                     and downloads[k].nbytes is None for k in clients):
            return None
        return {k: json.loads(str(self._scores[1][k])) for k in clients}

    def _required(self, msgs, clients: Sequence[int], what: str) -> dict[int, Any]:
        """Send ``msgs``; every one of ``clients`` must answer without error (else ``RuntimeError``
        naming the client, ``what`` failed and why)."""
        replies = self._exchange(msgs, self.timeout)
        out = {}
        for k in clients:
            rep = replies.get(self.node_of[k])
            if rep is None or rep.has_error():
                why = _reason(rep) if rep is not None else f"no reply within {self.timeout:g} s"
                raise RuntimeError(f"flower: client {k} {what}: {why}")
            out[k] = rep
        return out

    def _ask_all(self, op: str, per_client: Mapping[int, Any] | None = None, **conf) -> dict[int, Any]:
        msgs = [self._message("query", k, -1, op=op, record=None if per_client is None else per_client[k], **conf)
                for k in sorted(self.node_of)]
        return self._required(msgs, sorted(self.node_of), f"did not answer {op}")

    def records(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every client's state record, as its node keeps it (what a checkpoint holds): from the final
        evaluation's replies when no message has changed a node's record since (``final_round``), else asked."""
        kept = self._kept if self._kept is not None and set(self._kept) == set(self.node_of) else None
        if kept is None:
            kept = {k: rep.content["record"] for k, rep in self._ask_all("get-record").items()}
        return {k: record_to_tensors(kept[k]) for k in sorted(kept)}

    def restore(self, records: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Give every node the record of a checkpoint (a resumed run)."""
        self._kept = self._scores = None
        self._ask_all("put-record", records)

    def _count(self, msgs) -> None:
        self.wire_bytes["messages"] += len(msgs)
        self.wire_bytes["arrays_down"] += sum(_array_nbytes(m) for m in msgs)
        self.wire_bytes["config_down"] += sum(_config_nbytes(m) for m in msgs)

    def merge_into_base(self, state) -> None:  # refused up front (check_flower_method)
        raise NotImplementedError

    def evaluate(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]) -> dict[int, dict]:
        """Each client scores its own model on its own rows on its node, with what the server sent it; the
        evaluation of ``final_round`` also brings every node's record back (``records``)."""
        done = self._evaluated_with_deliver(rnd, clients, downloads)
        if done is not None:
            return done
        final = rnd == self.final_round and set(clients) == set(self.node_of) and self._kept is None
        extra = {"with-record": True} if final else {}
        msgs = [self._message("evaluate", k, rnd, None if self.live else downloads.get(k), **extra) for k in clients]
        replies = self._required(msgs, list(clients), "could not be evaluated")
        if final:
            self._kept = {k: rep.content["record"] for k, rep in replies.items()}
        return {k: json.loads(str(rep.content["result"]["scores"])) for k, rep in replies.items()}


def _reason(rep) -> str:
    """A failed reply's reason, one line (simulation wraps it in a traceback: its last line)."""
    text = str(getattr(rep.error, "reason", "") or "")
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"error code {getattr(rep.error, 'code', '?')}"


def _array_nbytes(msg) -> int:
    """Bytes of a message's arrays as Flower carries them (numpy's .npy serialisation of each tensor)."""
    return sum(len(a.data) for rec in msg.content.array_records.values() for a in rec.values())


def _config_nbytes(msg) -> int:
    return sum(len(str(k)) + len(str(v)) for rec in msg.content.config_records.values() for k, v in rec.items())


class _DropDeprecation(logging.Filter):
    """Flower's "DEPRECATED FEATURE: `run_simulation` …" banner: addressed to Flower's API users, not to
    someone running ``fedlora run --runtime flower`` (who can do nothing about it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "DEPRECATED FEATURE" not in record.getMessage()


@contextlib.contextmanager
def _quiet_engine():
    """While the simulation engine runs: without Flower's deprecation banner and Ray's FutureWarning about
    a future default for accelerator variables (its behaviour now, which fedlora relies on, is unchanged) —
    messages the user cannot act on. Every other warning and log line of both still shows."""
    handlers = list(logging.getLogger("flwr").handlers)  # Flower's console handler (its child loggers' too)
    drop = _DropDeprecation()
    for h in handlers:
        h.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*Ray will no longer override accelerator visible devices",
                                    category=FutureWarning)
            yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


@contextlib.contextmanager
def _engine_leaves_signals():
    """While the simulation engine starts Ray: Ray leaves this process's SIGTERM handling alone — its driver would
    install a Python handler that exits (``ray._private.utils.set_sigterm_handler``) and a native one that aborts
    (absl's failure signal handler; ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``) — so that SIGTERM, like SIGINT, reaches
    ``fedlora.signals.relay_signals`` (a scheduler's SIGTERM then finishes and checkpoints the round). Ray's
    processes are still stopped when the engine ends (``ray.shutdown``) or the process exits (Ray's atexit)."""
    saved_env = os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER")
    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    import ray._private.utils as ray_utils

    saved_set = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = saved_set
        if saved_env is None:
            os.environ.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
        else:
            os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = saved_env


def simulate(main, n_clients: int):
    """Run ``main(grid)`` as the ServerApp of Flower's simulation engine (Ray) with ``n_clients`` SuperNodes
    running ``client_app``; ``main``'s return value (its exception is raised here: the engine swallows it)."""
    _flwr()
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation as flwr_run_simulation

    box: dict[str, Any] = {}
    sapp = ServerApp()

    @sapp.main()
    def _main(grid, context) -> None:
        try:
            box["out"] = main(grid)
        except BaseException as e:  # re-raised below
            box["error"] = e

    from .signals import relay_signals

    cpus = max(1, min(n_clients, os.cpu_count() or 1))
    # the ServerApp runs in a thread of the engine and signals come to this one: relayed to the round loop
    # (fedlora.signals), so that Ctrl-C finishes and checkpoints the round instead of stopping the engine under it
    with _quiet_engine(), _engine_leaves_signals(), relay_signals():
        flwr_run_simulation(server_app=sapp, client_app=client_app, num_supernodes=n_clients, backend_name="ray",
                            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                            "init_args": {"num_cpus": cpus, "include_dashboard": False,
                                                          "logging_level": 40}})
    if "error" in box:
        raise box["error"]
    if "out" not in box:
        raise RuntimeError("flower: the simulation ended without running the ServerApp")
    return box["out"]


def make_server_app(main: Callable[[Any, Any], None]):
    """A Flower ``ServerApp`` running ``main(grid, context)`` (a task kind's deployment entry point)."""
    _flwr()
    from flwr.serverapp import ServerApp

    sapp = ServerApp()
    sapp.main()(main)
    return sapp


#: the ClientApp (``fedlora.flower_client``: the queries that need no model are answered without torch; the
#: others come to this module's handlers)
flower_client.NODE_HANDLERS.update(train=_client_train, query=_client_query, evaluate=_client_evaluate)
client_app = flower_client.client_app

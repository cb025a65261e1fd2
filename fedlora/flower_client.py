"""The ClientApp of fedlora's Flower apps (``client_app``), in a module that imports neither torch nor a task
kind's node: on a deployment a SuperNode starts a new ``flwr-clientapp`` process for every message, and this
module is what that process imports (the app's pyproject.toml names it: ``fedlora.flower_deploy.write_app_dir``).

The messages that need no model are answered here: ``hello`` (which partition this node holds), ``put-record``
(a resumed run's record), ``get-record`` of a record the node keeps (a checkpoint, the final adapters), and a
SecAgg+ simulation's ``save-record`` / ``load-record``: the node writes its client's record to a checkpoint of
its own (``node_checkpoints``) and takes it back on resume, so the record never crosses the server. The
others — ``train``, ``evaluate``, ``deliver``, a ``get-record`` of a client that never trained here — go to
``fedlora.flower``'s handlers (``NODE_HANDLERS``), imported then with the node kind's module the message names
(torch, and what builds the run).
"""
from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import Any, Callable

from fedlora.errors import ConfigError

__all__ = ["client_app", "make_client_app", "partition_of", "state_key", "node_checkpoints", "NODE_HANDLERS",
           "NODE_KEEP"]

#: the checkpoints a node keeps per client: the server keeps two, and a node may hold one more — the round it
#: wrote just before the server's own write of that round was cut short — so the server's older one resumes
NODE_KEEP = 3
RECORD_FILE = "record.pb"

#: the handlers of the messages that build the node, by message type (``train``, ``query``, ``evaluate``):
#: ``fedlora.flower`` sets them when imported — in a fresh process, by the node kind's module a message names
NODE_HANDLERS: dict[str, Callable[[Any, Any], Any]] = {}


def _node_handler(kind: str, msg) -> Callable[[Any, Any], Any]:
    if kind not in NODE_HANDLERS:  # registers the node kind, and imports fedlora.flower
        importlib.import_module(str(msg.content["config"].get("fedlora-node-module") or "fedlora.flower"))
    return NODE_HANDLERS[kind]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def state_key(config_json: str) -> str:
    """Where a node keeps its client's record in ``context.state``: one entry per run config, so that runs
    sharing nodes (one simulation running several configs) never read each other's records."""
    return f"fedlora-record-{_digest(config_json)[:16]}"


def partition_of(context, n_clients: int) -> int:
    """The client this node holds (its node config's ``partition-id``), checked against the run's ``n_clients``."""
    pid = context.node_config.get("partition-id")
    if pid is None:
        raise ConfigError("this SuperNode has no partition: start it with --node-config "
                          "'partition-id=K num-partitions=N' (K = the client it holds, 0..N-1)")
    try:
        k = int(pid)
    except (TypeError, ValueError):
        raise ConfigError(f"node config partition-id: must be an integer, got {pid!r}") from None
    if not 0 <= k < int(n_clients):
        raise ConfigError(f"node config partition-id: {k} is not a client of this run (0..{int(n_clients) - 1})")
    return k


def node_checkpoints(conf, k: int) -> Path:
    """Where this node keeps client ``k``'s checkpoints: ``<node-checkpoints>/client_<k>/round_<r>/``
    (``fedlora.checkpoint``'s layout), ``node-checkpoints`` the folder the server names — a simulation's (in the run's
    folder, so one run's), whose nodes all run on the server's machine (a deployment's SecAgg+ run keeps no
    checkpoint: ``fedlora.flower_secagg.SecAggExecutor``)."""
    root = conf.get("node-checkpoints")
    if not root:
        raise ConfigError("this SecAgg+ run's nodes keep no checkpoint (the server named no folder for them)")
    return Path(str(root)) / f"client_{k}"


def _save_record(context, conf, k: int, key: str) -> dict[str, Any]:
    """Write client ``k``'s record (as ``context.state`` keeps it, Flower's own protobuf bytes) as the node's
    checkpoint after round ``checkpoint-round``; a record never stored here (the client has not trained yet) is
    an empty checkpoint, which ``_load_record`` turns back into "build the initial record". Rounds after it are
    removed first: they belong to an earlier attempt at this run (a resumed run redoes them)."""
    import shutil

    from flwr.common.serde import array_record_to_proto

    from fedlora.checkpoint import list_checkpoints, write_checkpoint

    rnd = int(conf["checkpoint-round"])
    root = node_checkpoints(conf, k)
    for path in list_checkpoints(root):  # newest first
        if int(path.name.split("_")[-1]) <= rnd:
            break
        shutil.rmtree(path, ignore_errors=True)
    files = {} if key not in context.state else {RECORD_FILE: array_record_to_proto(context.state[key]).SerializeToString()}
    write_checkpoint(root, rnd, files, meta={"client": k}, keep=NODE_KEEP)
    return {"ok": True}


def _load_record(context, conf, k: int, key: str) -> dict[str, Any]:
    """Put client ``k``'s record of the node's checkpoint after round ``checkpoint-round`` back into
    ``context.state`` (a resumed SecAgg+ run); a one-line ``ConfigError`` when that checkpoint is missing or does
    not verify (``fedlora.checkpoint``'s hashes)."""
    from flwr.common.serde import array_record_from_proto
    from flwr.proto.recorddict_pb2 import ArrayRecord as ProtoArrayRecord

    from fedlora.checkpoint import checkpoint_path, read_checkpoint

    rnd = int(conf["checkpoint-round"])
    path = checkpoint_path(node_checkpoints(conf, k), rnd)
    try:
        ckpt = read_checkpoint(path)
    except ValueError as e:
        raise ConfigError(f"client {k}'s node has no intact checkpoint of round {rnd} in {str(path)!r} ({e}); a "
                          f"SecAgg+ run resumes on the nodes that kept its clients' checkpoints") from None
    if ckpt.meta.get("client") != k or ckpt.round != rnd:
        raise ConfigError(f"{str(path)!r} is not client {k}'s checkpoint of round {rnd}")
    if RECORD_FILE in ckpt.files:
        context.state[key] = array_record_from_proto(ProtoArrayRecord.FromString(ckpt.files[RECORD_FILE]))
    elif key in context.state:  # the client had not trained by then: its initial record again
        del context.state[key]
    return {"ok": True}


def _query(msg, context):
    """``hello``, ``put-record``, ``get-record`` of a kept record and a SecAgg+ run's ``save-record`` /
    ``load-record`` here; any other query (``deliver``, the initial record of a client that never trained here)
    builds the node (``fedlora.flower``)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    conf = msg.content["config"]
    op, key = str(conf["op"]), state_key(str(conf["fedlora-config"]))
    if op == "hello":
        k = partition_of(context, int(conf["fedlora-clients"]))
        return Message(RecordDict({"result": ConfigRecord({"partition-id": k})}), reply_to=msg)
    if op in ("save-record", "load-record"):  # a SecAgg+ checkpoint, kept on this node
        k = partition_of(context, int(conf["fedlora-clients"]))
        result = (_save_record if op == "save-record" else _load_record)(context, conf, k, key)
        return Message(RecordDict({"result": ConfigRecord(result)}), reply_to=msg)
    if op == "put-record":  # a resumed run: the record of its checkpoint
        partition_of(context, int(conf["fedlora-clients"]))
        context.state[key] = msg.content["record"]
        return Message(RecordDict({"result": ConfigRecord({"ok": True})}), reply_to=msg)
    if op == "get-record" and key in context.state:  # a checkpoint, the final adapters: the record it keeps
        partition_of(context, int(conf["fedlora-clients"]))
        return Message(RecordDict({"record": context.state[key]}), reply_to=msg)
    return _node_handler("query", msg)(msg, context)


def _train(msg, context):
    return _node_handler("train", msg)(msg, context)


def _secagg_gate(msg, context, call_next):
    """SecAgg+ train messages (they carry Flower's ``secaggplus_configs`` record: ``privacy.secagg``) go through
    Flower's ``secaggplus_mod``, whose fit stage is ``NODE_HANDLERS["secagg-fit"]`` (``fedlora.flower_secagg``,
    imported as the fit's config names it) calling the ordinary ``train`` handler; the others go straight to it."""
    if "secaggplus_configs" not in msg.content.config_records:
        return call_next(msg, context)
    from flwr.client.mod import secaggplus_mod

    def fit(fit_msg, fit_context):
        if "secagg-fit" not in NODE_HANDLERS:
            importlib.import_module(str(fit_msg.content.config_records["fitins.config"]["secagg-fit-module"]))
        return NODE_HANDLERS["secagg-fit"](fit_msg, fit_context, call_next)

    return secaggplus_mod(msg, context, fit)


def _evaluate(msg, context):
    return _node_handler("evaluate", msg)(msg, context)


def make_client_app():
    """A Flower ``ClientApp`` whose nodes are the registered node kinds (each message names its own)."""
    from flwr.clientapp import ClientApp

    capp = ClientApp()
    capp.train(mods=[_secagg_gate])(_train)
    capp.query()(_query)
    capp.evaluate()(_evaluate)
    return capp


try:  # importing this module without flwr still works (fedlora.flower's functions say what to install)
    client_app = make_client_app()
except ImportError:  # pragma: no cover - exercised where flwr is absent
    client_app = None

"""The ClientApp of fedlora's Flower apps (``client_app``), in a module that imports neither torch nor a task
kind's node: on a deployment a SuperNode starts a new ``flwr-clientapp`` process for every message, and this
module is what that process imports (the app's pyproject.toml names it: ``fedlora.flower_deploy.write_app_dir``).

The messages that need no model are answered here: ``hello`` (which partition this node holds), ``put-record``
(a resumed run's record) and ``get-record`` of a record the node keeps (a checkpoint, the final adapters). The
others — ``train``, ``evaluate``, ``deliver``, a ``get-record`` of a client that never trained here — go to
``fedlora.flower``'s handlers (``NODE_HANDLERS``), imported then with the node kind's module the message names
(torch, and what builds the run).
"""
from __future__ import annotations

import hashlib
import importlib
from typing import Any, Callable

from fedlora.errors import ConfigError

__all__ = ["client_app", "make_client_app", "partition_of", "state_key", "NODE_HANDLERS"]

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


def _query(msg, context):
    """``hello``, ``put-record`` and ``get-record`` of a kept record here; any other query (``deliver``, the
    initial record of a client that never trained here) builds the node (``fedlora.flower``)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    conf = msg.content["config"]
    op, key = str(conf["op"]), state_key(str(conf["fedlora-config"]))
    if op == "hello":
        k = partition_of(context, int(conf["fedlora-clients"]))
        return Message(RecordDict({"result": ConfigRecord({"partition-id": k})}), reply_to=msg)
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

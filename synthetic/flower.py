"""The synthetic testbed on Flower (docs/design.md §9): one federation of ``synthetic compare``'s testbed,
each client on its own SuperNode, the round loop the server's (``fedlora.server.Server.run_round``) as in
the embedded ``run_rounds``, over the transport of ``fedlora.flower``.

A **spec** (``flower_spec``) is what every message carries: the testbed's options (``CompareConfig``
fields), the task, the heterogeneity level, the method and its step size — everything a node needs to
rebuild the same run (``build_run``: same data, same initial adapters, same method options). A node
(``SyntheticNode``) holds the whole federation, as the embedded stacked executor does, but trains and
reports only its own client (replica ``partition-id``): the stacked step runs on every replica and the
others are put back (``StackedExecutor``), so its client's numbers are those of the embedded run, and
heterogeneous per-client settings (HetLoRA's ranks, LoRA-A²'s budgets, H²Tune's draws) stay per client.
Its client state record (``Method.replica_state``) lives in the node's context between messages. The node is
registered as ``synthetic`` with ``fedlora.flower.register_node`` when this module is imported; the module is
also the testbed's Flower app (``server_app``: ``serve_to_folder`` over the spec the run carries, ``client_app``).

The testbed's executor is *live*: the server sends every client the round's changes at the end of each
round (counted for the clients drawn next, uncounted for the others, who are evaluated on them), so the
Flower executor runs live here too and the byte records equal the embedded ones round by round.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Mapping

import torch

from fedlora import flower
from fedlora.errors import ConfigError
from fedlora.flower import FlowerExecutor
from fedlora.server import ClientUpdate, Download, Server
from fedlora.simulator import StackedExecutor, round_record

from .compare import CompareConfig, _make_data, method_spec
from .runner import SyntheticRun, build_run, run_method

__all__ = ["flower_spec", "build_spec_run", "SyntheticNode", "serve", "serve_with_records", "serve_to_folder",
           "run_flower", "run_embedded", "server_app", "client_app", "APP"]

#: the testbed's node kind in ``fedlora.flower``'s registry (and its spec's ``fedlora-task``)
TASK = "synthetic"
#: the testbed's Flower app module (``fedlora.flower_deploy.write_app_dir`` / ``LocalDeployment``'s ``app``)
APP = __name__


def flower_spec(method: str, lr: float, *, task: str = "regression", heterogeneity: float = 0.5,
                **options: Any) -> dict[str, Any]:
    """The JSON-able spec of one federation: ``options`` are ``synthetic compare``'s (``clients``, ``dim``,
    ``rounds``, ``local_steps``, ``sample_fraction``, ``seed_offset`` as the seed, ``rank``, ``method_options``,
    …; one seed, one heterogeneity level). ``ConfigError`` on a bad option."""
    cfg = CompareConfig.from_options(**{**options, "seeds": 1, "heterogeneity": (float(heterogeneity),),
                                        "tasks": (task,), "methods": (method,)})
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
    return {"fedlora-task": TASK, "method": method, "lr": float(lr), "task": task, "clients": cfg.clients,
            "compare": fields}


def _config(spec: Mapping[str, Any]) -> CompareConfig:
    return CompareConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["compare"].items()}).validate()


def _parts(spec: Mapping[str, Any]):
    if spec.get("fedlora-task") != TASK:
        raise ConfigError(f"not a synthetic Flower spec (fedlora-task {spec.get('fedlora-task')!r})")
    cfg = _config(spec)
    name = str(spec["method"])
    return cfg, name, method_spec(name, cfg.rank, cfg.clients, cfg.method_options.get(name), cfg.rslora), \
        _make_data(cfg, str(spec["task"]))


def build_spec_run(spec: Mapping[str, Any]) -> SyntheticRun:
    """The run ``spec`` describes, built as ``synthetic compare`` builds it (``run_method``'s arguments)."""
    cfg, name, ms, data = _parts(spec)
    return build_run(name, data, lr=float(spec["lr"]), options=ms.options, adapter=ms.adapter, lr_arg=ms.lr_arg,
                     sample_fraction=cfg.sample_fraction, sample_seed=cfg.seed_offset)


class SyntheticNode:
    """A Flower node's copy of the run: a ``fedlora.server.ClientExecutor`` (the ClientApp of
    ``fedlora.flower`` drives it through that protocol) over the stacked executor of the whole
    federation; a client's state record is its replica's (``Method.replica_state`` /
    ``load_replica_state``). ``evaluate`` gives each client's training loss on what it holds."""

    shared_base = False

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.run = build_spec_run(spec)
        cfg = _config(spec)
        self.n_clients = cfg.clients
        self.executor = StackedExecutor(self.run.method, self.run.federation, self.run.objective, self.run.sample,
                                        cfg.local_steps)
        self.live = self.executor.live

    def train(self, rnd: int, clients, downloads: Mapping[int, Download]) -> dict[int, ClientUpdate]:
        with warnings.catch_warnings():
            if self.run.data.task == "regression":  # expected, as in run_method: H²Tune's KL is for classifiers
                warnings.filterwarnings("ignore", message="h2tune: no output_fn")
            return self.executor.train(rnd, clients, downloads)

    def deliver(self, rnd: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        return self.executor.deliver(rnd, downloads)

    def merge_into_base(self, state) -> None:
        self.executor.merge_into_base(state)

    def evaluate(self, rnd: int, clients, downloads: Mapping[int, Download]) -> dict[int, dict]:
        if downloads:
            raise ConfigError("synthetic: a live executor's clients are evaluated on what they hold (no download)")
        loss = self.run.train_loss()
        return {k: {"train_loss": loss[k]} for k in clients}

    def records(self) -> dict[int, dict[str, torch.Tensor]]:
        return {k: self.run.method.replica_state(k) for k in range(self.n_clients)}

    def restore(self, records: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        for k, rec in records.items():
            self.run.method.load_replica_state(k, {n: v.clone() for n, v in rec.items()})


def serve(grid, spec: Mapping[str, Any], *, timeout: float = 600.0) -> list[dict[str, Any]]:
    """The server of ``spec``'s run over a Flower ``grid``: ``run_rounds``' records (per replica lists of
    ``bytes_up``, ``bytes_down``, ``train_loss`` after each round's deliveries; ``participants``: the ids drawn)."""
    return _serve(grid, spec, timeout, records=False)[0]


def serve_with_records(grid, spec: Mapping[str, Any], *,
                       timeout: float = 600.0) -> tuple[list[dict[str, Any]], dict[int, dict[str, torch.Tensor]]]:
    """``serve``, and every client's final state record as its node keeps it (``Method.replica_state``:
    adapter, optimizer moments, method state) — what ``run_embedded(spec, records=True)`` gives embedded."""
    history, executor = _serve(grid, spec, timeout, records=True)
    return history, executor.records()


def _serve(grid, spec: Mapping[str, Any], timeout: float, *, records: bool):
    """``serve``'s rounds and its executor; ``records``: the last round's evaluation brings the nodes'
    records back (``FlowerExecutor``'s ``final_round``), which ``executor.records()`` then gives."""
    run = build_spec_run(spec)  # the server's half of the method (aggregation, server_update, upload checks)
    cfg = _config(spec)
    fed, m = run.federation, run.method
    weighted = dataclasses.replace(fed, client_weights=fed.weights.tolist())  # as run_rounds
    server = Server(m, weighted, [m.initial_server_state(0)], cfg.rounds)
    # every round ends with the changes delivered to every client (live), whom the server then evaluates:
    # one message wave for both (evaluate_with_deliver), the last one bringing the records back when asked
    executor = FlowerExecutor(grid, spec, int(spec["clients"]), node=TASK, timeout=timeout, live=True,
                              final_round=cfg.rounds - 1 if records else None, evaluate_with_deliver=True)
    history, t0 = [], time.perf_counter()
    everyone = list(range(fed.n_replicas))
    for rnd in range(cfg.rounds):
        rec = round_record(server.run_round(executor, rnd), rnd, cfg.local_steps, fed.n_replicas, t0)
        scores = executor.evaluate(rnd, everyone, server.evaluation_downloads(everyone, executor))
        rec["train_loss"] = [float(scores[k]["train_loss"]) for k in range(fed.n_replicas)]
        history.append(rec)
    return history, executor


#: what ``serve_to_folder`` writes into its folder
FOLDER_WRITES = ("history.json", "run.json")


def serve_to_folder(grid, spec: Mapping[str, Any], out: str, *, overwrite: bool = False,
                    timeout: float = 600.0) -> list[dict[str, Any]]:
    """A deployment's ServerApp for the testbed: ``serve``, then ``out/history.json`` (the round records) and
    ``out/run.json`` (``complete``; ``failed`` with the error's first line if it stops), both atomic."""
    import json
    from pathlib import Path

    from fedlora.io import claim_output_dir, write_bytes_atomic, write_json_atomic

    if not out:
        raise ConfigError("synthetic on a Flower deployment: give the output folder (run config out=\"/abs/dir\")")
    claim_output_dir(out, "out", writes=FOLDER_WRITES, overwrite=overwrite)
    rounds = int(spec["compare"]["rounds"])
    try:
        history = serve(grid, spec, timeout=timeout)
    except BaseException as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        write_json_atomic(Path(out) / "run.json", {"status": "failed", "rounds": rounds, "rounds_done": 0, "error": why})
        raise
    write_bytes_atomic(Path(out) / "history.json", json.dumps(history, indent=1, allow_nan=True).encode())
    write_json_atomic(Path(out) / "run.json", {"status": "complete", "rounds": rounds, "rounds_done": rounds})
    return history


def run_flower(spec: Mapping[str, Any], *, timeout: float = 600.0) -> list[dict[str, Any]]:
    """``spec``'s run on Flower's simulation engine (one SuperNode per client); its round records."""
    return flower.simulate(lambda grid: serve(grid, spec, timeout=timeout), int(spec["clients"]))


def run_embedded(spec: Mapping[str, Any], *, records: bool = False):
    """The same run embedded, as ``synthetic compare`` runs it (``run_method``: the stacked executor); its
    round records — the reference the Flower runs equal. ``records``: also every client's final state
    record (``(history, {k: record})``, as ``serve_with_records``)."""
    cfg, name, ms, data = _parts(spec)
    res = run_method(name, data, lr=float(spec["lr"]), rounds=cfg.rounds, local_steps=cfg.local_steps,
                     options=ms.options, adapter=ms.adapter, lr_arg=ms.lr_arg, rank_tol=cfg.rank_tol,
                     sample_fraction=cfg.sample_fraction, sample_seed=cfg.seed_offset, keep_records=records)
    if res.error:
        raise RuntimeError(f"synthetic {name}: {res.error}")
    return (res.history, dict(enumerate(res.records))) if records else res.history


flower.register_node(TASK, SyntheticNode, clients=lambda spec: int(spec["clients"]))


def _deployment_main(grid, context) -> None:
    """The testbed's ServerApp on a deployment: the spec comes with the run (``fedlora-config-json``, as
    ``fedlora.flower_deploy.write_run_config`` writes it); ``serve_to_folder`` into ``out``."""
    import json

    rc = context.run_config
    text = str(rc.get("fedlora-config-json", ""))
    if not text:
        raise ConfigError("synthetic on a Flower deployment: the run carries no spec (fedlora-config-json; "
                          "fedlora synthetic flower --deployment writes it)")
    serve_to_folder(grid, json.loads(text), str(rc.get("out", "")), overwrite=bool(rc.get("overwrite", False)))


client_app = flower.client_app
try:  # importing this module without flwr still works (its functions say what to install)
    server_app = flower.make_server_app(_deployment_main)
except (ImportError, ConfigError):  # pragma: no cover - exercised where flwr is absent
    server_app = None

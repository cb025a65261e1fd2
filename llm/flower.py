"""``fedlora run CONFIG --runtime flower`` (docs/design.md §9): the LLM runtime's node and its runs over
Flower, the transport of ``fedlora.flower``.

The ServerApp builds the run as ``fedlora run`` does (model, data, split, the server's initial state, the run
folder) and hands its driver a ``fedlora.flower.FlowerExecutor`` over the run's ``RunConfig``. The node
(registered as ``llm`` with ``fedlora.flower.register_node`` when this module is imported) is the slot
executor of ``fedlora run`` with one client per message (``clients_per_pass = 1``,
``fedlora.llm.runtime.slot_executor``), rebuilt from the config in the message. Same config and seed give
the same numbers as the embedded runtime.

Deployment: this module is the Flower app (``server_app``, ``client_app``) that ``write_app_dir(path)``
names; the SuperLink, the SuperNodes (one per client, ``--node-config 'partition-id=K num-partitions=N'``)
and TLS are described in docs/how-to/flower.md (``fedlora.llm.flower_deploy``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from fedlora import flower
from fedlora.errors import ConfigError
from fedlora.flower import FlowerExecutor, check_flower_method
from fedlora.flower_deploy import write_app_dir as _write_app_dir
from fedlora.methods import get_method

from .config import RunConfig, load_config
from .driver import NODE_CHECKPOINTS
from .runtime import HETERO_EMBEDDED_ONLY, FederatedRun, slot_executor

__all__ = ["NODE", "server_app", "client_app", "run_simulation", "executor_over", "write_app_dir",
           "check_flower_config"]

#: this runtime's node kind in ``fedlora.flower``'s registry
NODE = "llm"


def check_flower_config(cfg, *, deployment: bool = False) -> None:
    """A ``RunConfig`` the Flower runtime can run: its method (``check_flower_method``) and one base model
    per run — heterogeneous client models (``federation.client_models``) run embedded only. ``deployment``: on a
    deployment, where a SecAgg+ run keeps no checkpoint, ``train.checkpoint_every`` must then be 0."""
    check_flower_method(get_method(cfg.method.name))
    if cfg.federation.client_models is not None:
        raise ConfigError(HETERO_EMBEDDED_ONLY)
    if deployment and cfg.privacy.secagg.enabled and cfg.train.checkpoint_every:
        from fedlora.flower_secagg import deployment_checkpoints_refused

        raise ConfigError(deployment_checkpoints_refused(cfg.train.checkpoint_every))


def _node(config: Mapping[str, Any]):
    """A node of the run ``config`` (a ``RunConfig.to_dict()``): its slot executor, one client per pass,
    records in memory (a node writes nothing)."""
    cfg = dict(config)
    cfg["federation"] = {**cfg.get("federation", {}), "clients_per_pass": 1, "store": "memory"}
    return slot_executor(RunConfig.from_dict(cfg))


def _clients(config: Mapping[str, Any]) -> int:
    return int(config["federation"]["clients"])


flower.register_node(NODE, _node, clients=_clients)


def executor_over(grid, cfg, *, connect: bool = True, run=None, simulation: bool = False) -> FlowerExecutor:
    """The executor of a run (``RunConfig`` ``cfg``) whose clients are the nodes of the Flower ``grid``: a
    ``FlowerExecutor`` waiting for each round's replies as long as the run's ``federation.timeout_s``. The
    last round's final broadcast (``deliver``) is also the evaluation the driver always makes next and brings
    back the nodes' records, which the run's adapters are saved from (``final_round``, ``evaluate_with_deliver``:
    one message wave for the three). ``connect=False``: the nodes' answers to ``hello`` are read by
    ``FlowerExecutor.connect`` (or the first message). With ``privacy.secagg`` on: a
    ``fedlora.flower_secagg.SecAggExecutor`` weighing the clients as ``run`` (the ``FederatedRun``) does, whose
    nodes keep their clients' checkpoints with ``simulation`` (every node on this machine) under
    ``<output_dir>/checkpoints/nodes`` (``NODE_CHECKPOINTS``), and none on a deployment."""
    kwargs = dict(node=NODE, timeout=cfg.federation.timeout_s, final_round=cfg.train.rounds - 1,
                  evaluate_with_deliver=True, connect=connect)
    if cfg.privacy.secagg.enabled:
        from fedlora.flower_secagg import SecAggExecutor
        from fedlora.secagg import secagg_weighting

        if run is None:
            raise ConfigError("flower: a SecAgg+ run's executor needs the run (its clients' weights)")
        return SecAggExecutor(grid, cfg.to_dict(), cfg.federation.clients, secagg=dataclasses.asdict(cfg.privacy.secagg),
                              weights=lambda: run.federation.client_weights, weighting=secagg_weighting(cfg.method.name),
                              rounding_seed=cfg.seed,
                              client_dp_clip=cfg.privacy.clip_norm if cfg.privacy.level == "client" else None,
                              node_checkpoints=Path(cfg.output_dir).resolve() / NODE_CHECKPOINTS if simulation else None, **kwargs)
    return FlowerExecutor(grid, cfg.to_dict(), cfg.federation.clients, **kwargs)


def run_simulation(run) -> dict[str, Any]:
    """``fedlora run CONFIG --runtime flower``: Flower's simulation engine (Ray) with one SuperNode per
    client; the ServerApp runs ``run`` (a ``fedlora.llm.runtime.FederatedRun``) in this process over a
    ``FlowerExecutor`` and writes the run folder as ``fedlora run`` does."""
    check_flower_config(run.cfg)

    def main(grid):
        return run.run(executor=executor_over(grid, run.cfg, run=run, simulation=True))

    t0 = time.perf_counter()
    summary = flower.simulate(main, run.cfg.federation.clients)  # one SuperNode per client (pooled training is refused)
    # the run's wall_s counts its rounds; the engine's start (Ray) and shutdown come on top: said, not hidden
    summary["wall_s_engine"] = time.perf_counter() - t0
    return summary


# the deployment entry points ([tool.flwr.app.components] of write_app_dir's pyproject.toml)
def _deployment_main(grid, context) -> None:
    """The ServerApp of a deployment: the run's config comes with the run (``fedlora-config-json``, as
    ``flower_deploy.write_run_config`` writes it) or is a file on the SuperLink's machine or a bundled
    config's name (``fedlora-config``); ``out`` overrides its output_dir (a path on the SuperLink's machine)."""
    rc = context.run_config
    text, path = str(rc.get("fedlora-config-json", "")), str(rc.get("fedlora-config", ""))
    if bool(text) == bool(path):
        raise ConfigError("flower: give the run's config, either fedlora-config-json (fedlora flower submit/local "
                          "write it) or fedlora-config (a config file on the SuperLink's machine or a bundled "
                          "config's name), not both: flwr run APP LINK -c 'fedlora-config=\"/abs/run.yaml\"'")
    cfg = RunConfig.from_dict(json.loads(text)) if text else load_config(path)
    if str(rc.get("out", "")):
        cfg = RunConfig.from_dict({**cfg.to_dict(), "output_dir": str(rc["out"])})
    check_flower_config(cfg, deployment=True)
    # the nodes are asked which partition they hold first: each answers from a new process (seconds of
    # SuperNode poll and start-up) while this one builds the run (seconds of imports and model); a node's
    # bad answer is raised before the run claims its folder
    run = FederatedRun(cfg, runtime="flower", overwrite=bool(rc.get("overwrite", False)))
    executor = executor_over(grid, cfg, connect=False, run=run)
    executor.connect()
    run.run(executor=executor)


client_app = flower.client_app
try:  # importing this module without flwr still works (its functions say what to install)
    server_app = flower.make_server_app(_deployment_main)
except (ImportError, ConfigError):  # pragma: no cover - exercised where flwr is absent
    server_app = None


def write_app_dir(path: str | os.PathLike) -> Path:
    """The Flower app folder of ``fedlora run`` (this module's ``server_app`` and ``client_app``), which
    ``flwr run PATH CONNECTION -c 'fedlora-config="/abs/config.json"'`` submits
    (``fedlora.flower_deploy.write_app_dir``)."""
    return _write_app_dir(path, __name__)

"""``fedlora flower``: a real Flower deployment of ``fedlora run`` (docs/how-to/flower.md, "Flower on one
machine and on several"; docs/design.md §9).

The deployment machinery is ``fedlora.flower_deploy`` (certificates, the SuperLink's and SuperNodes' command
lines, the app folder, the run-config file, ``LocalDeployment``); its names are re-exported here. What is
``fedlora run``'s: the app module (``APP``, whose ``server_app`` builds the run from its ``RunConfig``), a
``LocalDeployment`` running it by default, and ``run_local`` (``fedlora flower local``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fedlora import flower_deploy as _deploy
from fedlora.errors import ConfigError
from fedlora.flower_deploy import (APP_MINE, APP_WRITES, BIN, CERT_WRITES, WORK_WRITES, FlowerRunFailed,
                                   check_reachable, claim_app_dir, claim_certs_dir, flower_env, make_certs,
                                   make_node_key, superlink_command, supernode_command, warm_command,
                                   write_run_config)

__all__ = ["APP", "WARM_PRELOAD", "warm_command", "LocalDeployment", "run_local", "make_certs", "make_node_key", "superlink_command",
           "supernode_command", "check_reachable", "write_run_config", "flower_env", "FlowerRunFailed", "BIN",
           "CERT_WRITES", "APP_WRITES", "APP_MINE", "WORK_WRITES", "claim_certs_dir", "claim_app_dir"]

#: the Flower app module of ``fedlora run`` (its ``server_app`` and ``client_app``)
APP = "fedlora.llm.flower"
#: what a warm SuperExec of ``fedlora run``'s app imports before its first message, besides ``APP``
#: (``fedlora.flower_warm``): what every message's node builds its run with. ``transformers`` alone is lazy:
#: its model classes' first import (modeling_utils: accelerate, safetensors, scipy) was 10 of the 11 s a
#: child took to build ``tiny-smoke``'s node; with ``modeling_utils`` here, 1.5 s (a loaded 2-core machine)
WARM_PRELOAD = ("transformers.modeling_utils", "tokenizers", "fedlora.llm.runtime")


class LocalDeployment(_deploy.LocalDeployment):
    """``fedlora.flower_deploy.LocalDeployment`` running ``fedlora run``'s app (``APP``) unless told otherwise;
    its warm SuperExecs import ``WARM_PRELOAD`` too."""

    def __init__(self, work: str | os.PathLike, nodes: int, *, app: str = APP, preload=WARM_PRELOAD,
                 **kwargs: Any) -> None:
        super().__init__(work, nodes, app=app, preload=preload, **kwargs)


def run_local(cfg, out: str | os.PathLike, *, overwrite: bool = False, tls: bool = True, auth: bool = False,
              timeout: float = 3600.0, work: str | os.PathLike | None = None, warm: bool = True) -> dict[str, Any]:
    """``fedlora flower local``: run ``cfg`` (a ``RunConfig``) on a Flower deployment on this machine —
    SuperLink and one SuperNode per client on loopback, TLS — and stop it all; the run's summary.json.
    ``work``: where the deployment keeps its certificates, state and logs (a temporary folder, removed
    after a complete run, kept and named in the error otherwise). ``warm``: each SuperNode's messages are
    forked from a warm process (``fedlora.flower_warm``); False: flwr's SuperExec, an interpreter per message."""
    from .flower import check_flower_config  # imports torch: only for a run

    check_flower_config(cfg, deployment=True)
    tmp = work is None
    work = Path(tempfile.mkdtemp(prefix="fedlora-flower-")) if tmp else Path(work)
    ok = False
    try:
        with LocalDeployment(work, cfg.federation.clients, tls=tls, auth=auth, warm=warm) as dep:
            run_id = dep.submit(cfg.to_dict(), out=out, overwrite=overwrite)
            dep.wait(run_id, out, timeout)
        ok = True
    except (FlowerRunFailed, ConfigError) as e:
        raise type(e)(f"{e} (deployment logs: {work})") from None
    finally:
        if tmp and ok:
            shutil.rmtree(work, ignore_errors=True)
    return json.loads((Path(out) / "summary.json").read_text())

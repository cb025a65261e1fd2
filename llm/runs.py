"""Which run a config describes, and the two ways to start one from Python: ``run`` and ``resume``.

``FederatedRun`` (``fedlora.llm.runtime``) builds a run over one base model; ``HeteroRun``
(``fedlora.llm.hetero``) one base per model group, composed of the same parts. This module is the one
that knows both, so that neither imports the other's builder back (no import cycle inside ``llm/``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fedlora.io import OutputDir

from .config import RunConfig, apply_overrides, load_config
from .driver import resume_point
from .hetero import HeteroRun
from .runfolder import RUN_WRITES
from .runtime import FederatedRun

__all__ = ["run", "resume", "run_class"]


def run_class(cfg: RunConfig) -> type[FederatedRun] | type[HeteroRun]:
    """The run a config describes: ``FederatedRun`` over one base model, or — with
    ``federation.client_models`` — ``HeteroRun`` over one base per group."""
    return HeteroRun if cfg.federation.client_models is not None else FederatedRun


def run(config: RunConfig | Mapping[str, Any] | str | os.PathLike, overrides: Sequence[str] = (),
        progress: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """``fedlora run`` from Python: a RunConfig, a dict of sections, a YAML/TOML/JSON path or a
    bundled config's name. ``overwrite``: clear an output folder that holds an earlier run (else a
    folder that is not empty is refused, as ``fedlora run`` without ``--overwrite``)."""
    if isinstance(config, (RunConfig, Mapping)):
        data = config.to_dict() if isinstance(config, RunConfig) else dict(config)
        cfg = RunConfig.from_dict(apply_overrides(data, overrides))
    else:
        cfg = load_config(config, overrides)
    return run_class(cfg)(cfg, progress=progress, overwrite=overwrite).run()


def resume(run_dir: str | os.PathLike, config: RunConfig | str | os.PathLike | None = None,
           overrides: Sequence[str] = (), progress: bool = False,
           log: Callable[[str], None] | None = None) -> FederatedRun | HeteroRun:
    """A run that continues the interrupted run in ``run_dir`` from its newest intact checkpoint
    (``fedlora run --resume RUN_DIR``; ``fedlora.llm.driver.resume_point`` checks it); ``.run()``
    finishes it, bit for bit as if it had never stopped (CPU)."""
    cfg, ckpt, runtime = resume_point(run_dir, config, overrides)
    return run_class(cfg)(cfg, progress=progress, output=OutputDir(Path(cfg.output_dir), None, RUN_WRITES),
                          runtime=runtime, log=log, resume_from=ckpt)

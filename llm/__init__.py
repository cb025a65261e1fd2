"""The LLM layer (docs/design.md §8): federated LoRA fine-tuning of HuggingFace models with every method.

* ``fedlora.llm.inject`` — PEFT-style targets, slot adapters (``fedlora.adapter.LoRALinear``) and slot heads;
* ``fedlora.llm.runtime`` — builds a run's parts from its config (``FederatedRun``, ``run``);
* ``fedlora.llm.driver`` — one run's round loop over the server, evaluation schedule, records, checkpoints, resume;
* ``fedlora.llm.slots`` — the slot executor: many simulated clients on one frozen base model, in passes, their state
  records in a store; ``fedlora.llm.hetero`` — one slot executor per model group (heterogeneous client models);
* ``fedlora.llm.config`` — the one validated run configuration (``RunConfig``, ``load_config``);
* ``fedlora.llm.data``, ``fedlora.llm.tasks``, ``fedlora.llm.metrics`` — text data, client splits, metrics;
* ``fedlora.llm.export`` — a client's model as a PEFT adapter or merged into the base weights.

``fedlora run CONFIG`` is the command line of ``run`` (``fedlora.llm.cli``).

The names below are imported on first use, so that ``import fedlora.llm.cli`` — which every ``fedlora`` command
line does to list its commands — does not pull in torch and the runtime. This package imports none of its modules
(they import it, as their parent): the table below names them.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RunConfig", "load_config", "FederatedRun", "run"]

#: name → the module of this package that defines it (imported on first use: start-up time)
_HOME = {"RunConfig": "config", "load_config": "config", "FederatedRun": "runtime", "run": "runs"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

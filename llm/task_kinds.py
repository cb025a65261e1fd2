"""Every kind of task, and building a run's ``Task`` (docs/design.md §9, "the house").

``fedlora.llm.tasks`` holds the ``Task`` interface and the table of kinds (``TASK_KINDS``), which each
implementation module fills when it is imported (``register_kind``). This module imports the implementations —
a new kind of task is its module and one line below — and builds tasks from the table: ``task_for`` (a run's
data section), ``build_task`` (a spec and a kind) and ``task_from_resolved`` (a finished run, for export).
Imports point one way: tasks ← implementations ← task_kinds ← what runs them.
"""
from __future__ import annotations

from typing import Any, Mapping

from fedlora.errors import ConfigError

# each import registers its kind in TASK_KINDS (classification first: the kind of a source without a task)
from . import classification  # noqa: F401
from . import generation  # noqa: F401
from . import qa  # noqa: F401
from .tasks import TASK_KINDS, TASKS, Task, TaskSpec, get_task

__all__ = ["task_for", "build_task", "task_from_resolved"]


def task_for(task: str | TaskSpec | None, target_column: str | None = None) -> Task:
    """The ``Task`` of a data section: a registered task (name or spec) by its kind; without one (local files,
    any Hub dataset) generation when a target column is named, else classification."""
    spec = get_task(task) if isinstance(task, str) else task
    kind = spec.kind if spec is not None else ("generation" if target_column else "classification")
    return build_task(spec, kind)


def build_task(spec: TaskSpec | None, kind: str | None = None) -> Task:
    """The ``Task`` implementation of ``kind`` (default ``spec.kind``) around ``spec`` (None: a source without
    a registered task; ``load_data`` makes its spec)."""
    kind = kind or spec.kind
    if kind not in TASK_KINDS:
        raise ConfigError(f"task kind {kind!r}: one of {tuple(TASK_KINDS)}")
    return TASK_KINDS[kind](spec)


def task_from_resolved(resolved: Mapping[str, Any]) -> Task:
    """The ``Task`` of a finished run, from its config.json ``resolved`` section (what ``Task.describe`` wrote),
    ready to ``build_model`` the run's base again (export). Runs written before tasks had kinds are
    classification runs."""
    kind = resolved.get("task_kind", "classification")
    task = build_task(TASKS.get(resolved.get("task")), kind)
    task.restore(resolved)
    return task

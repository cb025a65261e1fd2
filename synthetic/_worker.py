"""The child processes of ``run_rank_recovery``'s parallel methods: started (``spawn``, ``prestart``), handed out
(``take``) and ended (``discard``) here; each runs ``CHILD``, the program ``fedlora.synthetic._child.main``.

The child imports torch and the experiment first, then reads a pickled (method name, RankRecoveryConfig,
torch threads) from stdin and writes the pickled ``(history, extra)`` of ``_run_method`` to stdout. Importing
first lets a parent start it before it has a job (``prestart``: the ``fedlora`` command does, before it
imports torch itself, so that the two imports overlap); a child whose stdin closes without a job exits at
once. A plain subprocess rather than multiprocessing: it never re-imports the caller's ``__main__``, so
scripts without an ``if __name__ == "__main__"`` guard (and notebooks) can call ``run_rank_recovery`` safely.

This module imports no torch (the parent's side of ``prestart`` runs before it has) and nothing of the
experiment (which imports it): the child's program is a string naming ``_child``.
"""
from __future__ import annotations

import os
import subprocess
import sys

#: the child's program: ``fedlora.synthetic._child.main`` without the current folder on sys.path. ``python -m``
#: would put it first, and from a clone's root that makes the source folder ``fedlora/`` (which holds no
#: ``kernels``/``llm``/``synthetic``: they install as fedlora.*) shadow the installed package, and the
#: folder ``kernels/`` HuggingFace's ``kernels``. The parent's own sys.path comes through PYTHONPATH.
CHILD = "import sys; sys.path[:] = [p for p in sys.path if p]; from fedlora.synthetic._child import main; main()"

#: children started by ``prestart`` that no job has taken yet (``take`` hands them out, ``discard`` ends them)
_idle: list[subprocess.Popen] = []


def spawn() -> subprocess.Popen | None:
    """A new child (it imports torch while the caller goes on), or None where no child can be started (an
    embedded interpreter has no ``sys.executable``)."""
    if not sys.executable:
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def workers_needed(n_methods: int, jobs: int) -> int:
    """How many children ``run_rank_recovery`` runs methods in: ``jobs`` − 1 (0 = one job per method up to
    the CPU count; this process is one job), at most one per method after the first."""
    jobs = jobs or min(n_methods, os.cpu_count() or 1)
    return max(0, min(jobs - 1, n_methods - 1))


def prestart(n: int) -> None:
    """Start ``n`` children now, for the jobs ``run_rank_recovery`` gives them later (``take``)."""
    for _ in range(n):
        proc = spawn()
        if proc is not None:
            _idle.append(proc)


def take() -> subprocess.Popen | None:
    """A child ``prestart`` started (None if there is none left): the caller sends it its job."""
    return _idle.pop(0) if _idle else None


def discard() -> None:
    """End the prestarted children no job has taken (killed: they hold nothing yet; one whose parent dies
    instead sees its stdin close and exits)."""
    while _idle:
        proc = _idle.pop()
        proc.kill()
        proc.communicate()

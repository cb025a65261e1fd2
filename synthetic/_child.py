"""The program of ``run_rank_recovery``'s child processes (``fedlora.synthetic._worker.CHILD`` runs ``main``).

The child imports torch and the experiment first, then reads a pickled (method name, RankRecoveryConfig,
torch threads) from stdin and writes the pickled ``(history, extra)`` of ``_run_method`` to stdout. Importing
first lets a parent start it before it has a job (``_worker.prestart``); a child whose stdin closes without a
job exits at once. A module of its own, not ``_worker``'s: the experiment imports ``_worker`` (which starts
the children and imports no torch), and this program imports the experiment.
"""
from __future__ import annotations

import os
import pickle
import sys

import torch

from .rank_recovery import _data_for, _run_method


def main() -> None:
    job = sys.stdin.buffer.read()
    if not job:  # prestarted, then not needed
        return
    name, cfg, threads = pickle.loads(job)
    torch.set_num_threads(threads)
    result = _run_method(name, cfg, _data_for(cfg))
    sys.stdout.buffer.write(pickle.dumps(result))
    sys.stdout.buffer.flush()
    sys.stderr.flush()
    # nothing is left to clean up: skip the interpreter's teardown (≈ 0.9 s with torch loaded), which the
    # parent would wait for
    os._exit(0)


if __name__ == "__main__":
    main()

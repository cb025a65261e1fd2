"""Child-process entry for ``run_rank_recovery``'s parallel methods (``rank_recovery._CHILD`` runs ``main``).

Reads a pickled (method name, RankRecoveryConfig, torch threads) from stdin and writes the pickled
``(history, extra)`` of ``_run_method`` to stdout. A plain subprocess rather than multiprocessing:
it never re-imports the caller's ``__main__``, so scripts without an ``if __name__ == "__main__"``
guard (and notebooks) can call ``run_rank_recovery`` safely.
"""
from __future__ import annotations

import pickle
import sys


def main() -> None:
    name, cfg, threads = pickle.load(sys.stdin.buffer)
    import torch

    from .rank_recovery import _data_for, _run_method

    torch.set_num_threads(threads)
    result = _run_method(name, cfg, _data_for(cfg))
    sys.stdout.buffer.write(pickle.dumps(result))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()

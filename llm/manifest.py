"""Provenance of a run folder: what is needed, beside the config, to write a paper's table from it and
to reproduce it — the code (fedlora's version and git commit), the libraries' versions, the command
line, a hash of every data file read, and each client's rows (``FederatedRun.describe`` puts this in
config.json under ``resolved.manifest`` and ``resolved.split_indices``)."""
from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["environment", "file_hashes", "data_files", "split_indices"]

#: the distributions whose versions change a run's numbers or its meaning
PACKAGES = ("fedlora", "torch", "transformers", "peft", "triton", "numpy", "datasets", "safetensors", "tokenizers",
            "scikit-learn")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _git(source: Path) -> dict[str, Any] | None:
    """The commit of the checkout fedlora runs from, and whether it has uncommitted changes (None when
    fedlora is not run from a git checkout, e.g. an installed wheel)."""
    try:
        top = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode != 0:
            return None
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head or None, "dirty": bool(dirty)}


def environment() -> dict[str, Any]:
    """Versions (fedlora and the libraries in ``PACKAGES``; None where not installed), Python, the
    platform, the command line, and the git commit of the source fedlora was imported from."""
    source = Path(__file__).resolve().parent
    return {"versions": {p: _version(p) for p in PACKAGES}, "python": platform.python_version(),
            "platform": platform.platform(), "command": list(sys.argv), "git": _git(source)}


def file_hashes(paths: Iterable[Path]) -> dict[str, str]:
    """``str(path)`` → SHA-256 of its bytes, for every file (folders: every file below, sorted)."""
    out: dict[str, str] = {}
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            out[str(f)] = h.hexdigest()
    return out


def data_files(path: str | None, task_local_dir: str | Path | None) -> list[Path]:
    """The files a run read its data from: ``data.path`` (a file or a folder), or the bundled task's
    folder; hub data is identified by name and revision in the config, not by files."""
    if path is not None:
        return [Path(path)]
    if task_local_dir is not None:
        return [Path(task_local_dir)]
    return []


def split_indices(clients: Sequence[Any], train_keys: Sequence[Any] | None = None) -> dict[str, Any]:
    """Every client's row indices (into the train / test sets as loaded and subsampled): ``train``,
    ``val``, ``test``; for a ``by_key`` split also which key went to which client."""
    out: dict[str, Any] = {"clients": [{"train": [int(i) for i in c.train], "val": [int(i) for i in c.val],
                                         "test": [int(i) for i in c.test]} for c in clients]}
    if train_keys is not None:
        key_client: dict[str, int] = {}
        for k, c in enumerate(clients):
            for i in list(c.train) + list(c.val):
                key_client[str(train_keys[int(i)])] = k
        out["key_to_client"] = dict(sorted(key_client.items()))
    return out

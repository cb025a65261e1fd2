"""Checkpoints: one folder per round, written atomically, with a manifest of hashes (docs/design.md §9).

A checkpoint is a flat set of named blobs (what a runtime chooses: the server's ``state_dict``, every
client's state record, the records so far) in ``<root>/round_<r>/`` with ``manifest.json`` listing each
file's SHA-256 and size. It is written into a temporary folder, flushed to disk, and renamed into place
in one step, so a crash (SIGKILL, power loss) leaves the previous checkpoint intact; the last ``keep``
are kept. ``load_checkpoint`` takes the newest one whose manifest and files verify, and says which
newer ones it skipped and why (a truncated or corrupted file).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["write_checkpoint", "load_checkpoint", "read_checkpoint", "checkpoint_path", "Checkpoint",
           "list_checkpoints", "FORMAT"]

FORMAT = 1
_PREFIX = "round_"
MANIFEST = "manifest.json"


@dataclass
class Checkpoint:
    """A verified checkpoint: the rounds it holds (``round``: rounds finished), its ``files`` (name →
    bytes), the manifest's ``meta`` and the newer checkpoints ``skipped`` (path, why)."""

    round: int
    path: Path
    files: dict[str, bytes]
    meta: dict[str, Any]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or name in (".", "..", MANIFEST) or name.startswith("."):
        raise ValueError(f"checkpoint file name {name!r}: a plain file name other than {MANIFEST}")


def checkpoint_path(root: str | os.PathLike, round_done: int) -> Path:
    """The folder of the checkpoint after ``round_done`` rounds under ``root`` (it may not exist)."""
    return Path(root) / f"{_PREFIX}{int(round_done):06d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoint folders under ``root``, newest (most rounds) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit():
            found.append((int(p.name[len(_PREFIX):]), p))
    return [p for _, p in sorted(found, reverse=True)]


def write_checkpoint(root: str | os.PathLike, round_done: int, files: Mapping[str, bytes],
                     meta: Mapping[str, Any] | None = None, keep: int = 2) -> Path:
    """Write ``files`` as the checkpoint after ``round_done`` rounds under ``root``; keep the newest
    ``keep``. Returns its folder. The manifest (written last, inside the folder that is renamed into
    place) holds ``format``, ``round``, each file's ``sha256`` and ``bytes``, and ``meta``."""
    if keep < 1:
        raise ValueError("keep must be ≥ 1")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, round_done)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    listing = {}
    for name, blob in files.items():
        _check_name(name)
        with open(tmp / name, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        listing[name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    manifest = {"format": FORMAT, "round": round_done, "files": listing, "meta": dict(meta or {})}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same round again (a resumed run redoing it): replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():  # temporary folders of writers that died
        if p.name.startswith(f".{_PREFIX}") and ".tmp-" in p.name and p != tmp:
            shutil.rmtree(p, ignore_errors=True)
    return final


def _verify(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable {MANIFEST} ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{MANIFEST} is not a format-{FORMAT} checkpoint manifest")
    files = {}
    for name, info in manifest["files"].items():
        try:
            blob = (path / name).read_bytes()
        except OSError:
            raise ValueError(f"{name} is missing") from None
        if len(blob) != info.get("bytes") or hashlib.sha256(blob).hexdigest() != info.get("sha256"):
            raise ValueError(f"{name} does not match its hash in {MANIFEST} (truncated or corrupted)")
        files[name] = blob
    return manifest, files


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint in the folder ``path`` (one round's, ``checkpoint_path``), verified; ``ValueError`` saying
    what is wrong (missing, unreadable manifest, a file that does not match its hash)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError("no such checkpoint")
    manifest, files = _verify(path)
    return Checkpoint(int(manifest["round"]), path, files, dict(manifest.get("meta") or {}))


def load_checkpoint(root: str | os.PathLike) -> Checkpoint:
    """The newest checkpoint under ``root`` whose manifest and files verify; ``ConfigError`` when none does."""
    skipped: list[tuple[str, str]] = []
    for path in list_checkpoints(root):
        try:
            manifest, files = _verify(path)
        except ValueError as e:
            skipped.append((str(path), str(e)))
            continue
        return Checkpoint(int(manifest["round"]), path, files, dict(manifest.get("meta") or {}), skipped)
    why = "; ".join(f"{p}: {w}" for p, w in skipped)
    raise ConfigError(f"no intact checkpoint in {str(root)!r}" + (f" ({why})" if why else " (none was written)"))

"""Files: atomic JSON writes and the output-folder check every command runs before any work."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["write_json_atomic", "check_output_dir"]


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temp file in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create the output folder ``path`` (with parents) and prove it writable; return it as a ``Path``.

    Every command calls this BEFORE any work, so a bad ``--out`` costs one line, not a run that ends
    in a traceback with nothing (or half of its files) written. Writability is checked by creating
    and removing a temporary file in the folder (permission bits alone say nothing for root, a
    read-only mount or /proc). Raises ``ConfigError("--out: …")`` naming the folder and the reason.
    """
    p = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag}: must name an output folder, got ''")
    blocker = next((a for a in (p, *p.parents) if a.exists() or a.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is" if blocker == p else f"lies under {str(blocker)!r}, which is"
        raise ConfigError(f"{flag}: cannot use {str(p)!r} as the output folder: it {what} a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot create the output folder {str(p)!r}: {e.strerror or e}") from None
    try:
        fd, tmp = tempfile.mkstemp(dir=p, prefix=".fedlora-write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"{flag}: the output folder {str(p)!r} is not writable: {e.strerror or e}") from None
    return p

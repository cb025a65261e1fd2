"""Files: atomic writes, config-file reading, and the output-folder checks every command runs before any
work (``check_output_dir``; ``claim_output_dir`` for a command that writes a results folder)."""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .errors import ConfigError

__all__ = ["write_bytes_atomic", "write_json_atomic", "check_output_dir", "claim_output_dir", "OutputDir",
           "RESUME_LATER", "read_table_file", "yaml_load"]


def _yaml12_loader():
    """PyYAML's SafeLoader with YAML 1.2's float syntax: YAML 1.1 (PyYAML) needs a dot and a signed
    exponent, so ``1e-3``, ``1E-3``, ``5e+2`` and ``1.0e3`` — step sizes as researchers write them —
    would be read as text. Everything else (ints with ``_``, ``.5``, ``.inf``, booleans) is unchanged."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            """A key given twice in one mapping is an error (PyYAML keeps the last silently: a second
            ``train:`` section would drop the first one's settings). Merge keys (``<<``) may still be overridden."""
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                                f"found duplicate key {key!r}", key_node.start_mark)
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class says so
                    pass
            return super().construct_mapping(node, deep=deep)

    Loader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
                                      for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."))
    return Loader


_LOADER = None


def yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that reads YAML 1.2 floats (``1e-3``) as numbers (see ``_yaml12_loader``)."""
    import yaml

    global _LOADER
    if _LOADER is None:
        _LOADER = _yaml12_loader()
    return yaml.load(text, Loader=_LOADER)


def _umask() -> int:
    """The process's umask. Linux reports it in /proc/self/status (read-only); elsewhere it is read
    by setting and restoring it (``os.umask`` has no getter)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temp file in the same folder, fsync, then rename: readers never see half a
    file, and a crash leaves the previous version in place. The file gets the mode of any file the
    user creates (0666 less the umask, as ``open`` gives), not the temp file's private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _has_nan(obj: Any) -> bool:
    if isinstance(obj, float):
        return obj != obj
    if isinstance(obj, dict):
        return any(_has_nan(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_nan(v) for v in obj)
    return False


def write_json_atomic(path: str | os.PathLike, obj: Any, *, infinity: bool = False) -> None:
    """``obj`` as JSON (NaN refused), written atomically (``write_bytes_atomic``). ``infinity``: ±∞ written as
    ``Infinity`` / ``-Infinity`` (what Python's json reads back, and what rounds.jsonl holds) instead of refused —
    for values that may legitimately be infinite, such as ε without noise (σ = 0)."""
    if infinity and _has_nan(obj):
        raise ValueError("Out of range float values are not JSON compliant: nan")
    write_bytes_atomic(path, json.dumps(obj, indent=1, allow_nan=infinity).encode())


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a key given twice is an error (json keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _parse_error(e: Exception) -> str:
    """A parser's error as one line that says what is wrong and where. PyYAML's first line is only its
    context ("while parsing a block mapping"); the problem and its line come after it."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
        where = f" from line {cmark.line + 1}, column {cmark.column + 1}" if cmark is not None else ""
        return (f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
                + (f" ({context}{where})" if context else ""))
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def read_table_file(path: str | os.PathLike, what: str = "config") -> dict[str, Any]:
    """A YAML (.yaml/.yml), TOML or JSON file holding a table → dict. Errors are one line starting
    with ``what`` (the flag or field that named the file): no file, a file that cannot be read or is
    not UTF-8, another suffix, a syntax error (the parser's problem and its line and column), a key
    given twice in one table (YAML and JSON too, as TOML), a file that is not a table."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: no such file {str(path)!r}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # the three formats are UTF-8 text (a BOM is dropped)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: not UTF-8 text (byte {e.object[e.start]:#04x} at "
                          f"offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {e.strerror or type(e).__name__}") from None
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml_load(text) or {}
        elif p.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            raise ConfigError(f"{what}: expected a .yaml/.yml, .toml or .json file, got {str(path)!r}")
    except ConfigError:
        raise
    except Exception as e:  # a syntax error in the file: one line, where it is
        raise ConfigError(f"{what}: cannot parse {str(path)!r}: {_parse_error(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {str(path)!r} must hold a table")
    return data


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


#: what ``--resume`` says to a command that keeps no checkpoints (the ``fedlora synthetic`` experiments: they
#: take seconds to minutes); ``fedlora run`` writes checkpoints and resumes (``fedlora run --resume RUN_DIR``)
RESUME_LATER = ("--resume: this command keeps no checkpoints, so an interrupted run cannot be continued; run it "
                "again from the start with --overwrite (clears only its own results) or with another --out")

_CHECK_PREFIX = ".fedlora-write-check-"


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _ours(name: str, writes: Iterable[str]) -> bool:
    """Whether a folder entry is one a command that ``writes`` these names leaves: one of them (an entry
    of ``writes`` holding ``*``, ``?`` or ``[`` is an fnmatch pattern, e.g. ``model-*-of-*.safetensors``),
    an atomic writer's temp file of one (``.NAME.*.tmp``, left by a killed process), or a write check's."""
    return name.startswith(_CHECK_PREFIX) or any(
        (fnmatch.fnmatchcase(name, w) if _is_pattern(w) else name == w)
        or fnmatch.fnmatchcase(name, f".{w if _is_pattern(w) else _glob_escape(w)}.*.tmp") for w in writes)


def _mine(path: Path, writes: Iterable[str], mine: Mapping[str, Callable[[Path], bool]]) -> bool:
    """``_ours`` by name, and for an entry ``mine`` names, by content too: ``mine[name](path)`` says
    whether the file there is one this command wrote (a ``pyproject.toml`` of a project is not)."""
    if not _ours(path.name, writes):
        return False
    check = mine.get(path.name)
    try:
        return check is None or bool(check(path))
    except OSError:
        return False


def _glob_escape(name: str) -> str:
    """``name`` as a literal fnmatch pattern."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _listing(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class OutputDir:
    """A results folder a command has claimed (``claim_output_dir``): ``path``; ``created``, the
    topmost folder the claim created (``path`` or a parent of it; None when ``path`` existed);
    ``writes``, every entry name (or fnmatch pattern) the command may write there; ``mine``, entry
    name → whether the file there is this command's (checked by content: see ``claim_output_dir``)."""

    path: Path
    created: Path | None
    writes: tuple[str, ...]
    mine: Mapping[str, Callable[[Path], bool]] = field(default_factory=dict, compare=False)

    def _remove_created(self) -> None:
        """``path`` and the parents the claim created, as far as they are empty (never anything else)."""
        if self.created is None:
            return
        p = self.path
        while True:
            try:
                p.rmdir()
            except OSError:
                return
            if p == self.created:
                return
            p = p.parent

    def discard(self) -> None:
        """Remove what the command wrote — the entries of ``writes`` (never another file) — and the
        folder itself (with the parents) where the claim created it."""
        if self.path.is_dir():
            for entry in list(self.path.iterdir()):
                if _mine(entry, self.writes, self.mine):
                    _remove(entry)
        self._remove_created()

    def clear(self) -> None:
        """Remove every entry of the folder that the command writes (``writes``; never another file): the
        clearing that ``claim_output_dir(…, overwrite=True, clear=False)`` left for after the checks."""
        if self.path.is_dir():
            for entry in list(self.path.iterdir()):
                if _mine(entry, self.writes, self.mine):
                    _remove(entry)

    def remove_if_empty(self) -> None:
        """Remove the folder (and the parents the claim created) if the claim created it and it is
        still empty: a command that stops before writing anything leaves no trace."""
        self._remove_created()


def claim_output_dir(path: str | os.PathLike, flag: str = "--out", *, writes: Iterable[str],
                     overwrite: bool = False, resume: bool = False,
                     overwrite_flag: str = "--overwrite", clear: bool = True,
                     mine: Mapping[str, Callable[[Path], bool]] | None = None, keep: bool = False) -> OutputDir:
    """Claim ``path`` as the results folder of a command that writes the entries ``writes`` (file and
    folder names): refuse a folder that already holds anything, so that two experiments never mix in
    one folder (a second run with fewer clients would keep the first run's ``adapters/client_2…``).

    * ``path`` missing or empty: created (with parents) and proved writable (``check_output_dir``).
    * not empty: a one-line ``ConfigError`` naming the folder, some of what it holds and the two ways
      out — ``overwrite_flag`` (``--overwrite``) or another folder;
    * ``overwrite``: every entry of the folder is removed before any work — but only when every entry
      is one the command writes (``writes``, the atomic writer's leftover temp files). A folder holding
      anything else (your own files, another command's results), the filesystem root or the home folder
      is never cleared: refused in one line naming what is foreign. ``keep``: the flag (``overwrite_flag``, e.g.
      ``--resume``) keeps this command's entries instead of clearing them (with ``clear=False``); its refusal says so.
    * ``resume``: refused in one line (``RESUME_LATER``): a command that keeps no checkpoints cannot resume.
    * ``mine``: entry name → a check of the file's content; an entry it names is this command's only when
      the check passes (``fedlora flower app``: a ``pyproject.toml`` it did not write — a project's own — is
      foreign, never cleared).
    * ``clear=False`` (with ``overwrite``): every refusal above is made, but nothing is removed yet — the
      command clears with ``OutputDir.clear()`` once its own checks have passed (``fedlora plot``: a bad
      RUN_DIR never costs the earlier results).

    Call it BEFORE any work, as ``check_output_dir``. Returns an ``OutputDir`` (its ``discard`` /
    ``remove_if_empty`` undo the claim when the command fails or is interrupted).
    """
    writes, mine = tuple(writes), dict(mine or {})
    if resume:
        raise ConfigError(RESUME_LATER)
    p = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag}: must name an output folder, got ''")
    if p.is_dir():
        try:
            entries = sorted(e.name for e in p.iterdir())
        except OSError as e:
            raise ConfigError(f"{flag}: cannot read the output folder {str(p)!r}: {e.strerror or e}") from None
        if entries and not overwrite:
            raise ConfigError(f"{flag}: the output folder {str(p)!r} is not empty (it holds {_listing(entries)}); "
                              f"give {overwrite_flag} to clear it and start afresh, or choose another folder")
        if entries:
            real = p.resolve()
            if real == Path(real.anchor) or real == Path.home().resolve():
                where = "the filesystem root" if real == Path(real.anchor) else "your home folder"
                raise ConfigError(f"{flag}: {overwrite_flag} never clears {str(p)!r}: it is {where}")
            foreign = [e for e in entries if not _mine(p / e, writes, mine)]
            foreign = [f"{e} (not one this command wrote)" if _ours(e, writes) else e for e in foreign]
            if foreign:
                raise ConfigError(f"{flag}: {overwrite_flag} {'goes on only in' if keep else 'clears only'} a folder of "
                                  "this command's results, and "
                                  f"{str(p)!r} also holds {_listing(foreign)}; move those away or choose another folder")
    created = None
    for a in (p, *p.parents):  # the topmost folder that does not exist yet: what this claim creates
        if a.exists() or a.is_symlink():
            break
        created = a
    out = OutputDir(check_output_dir(p, flag), created, writes, mine)
    if overwrite and clear:
        out.clear()
    return out

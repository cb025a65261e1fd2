"""Text data for the LLM layer (docs/design.md §5, §8): loading, client splits, tokenising.

* :func:`load_text_data` reads a registered task (``fedlora.llm.tasks``), any HuggingFace dataset by name,
  or local files (csv / tsv / jsonl / json, optionally ``.gz``; a folder of ``train.*`` /
  ``test.*`` files; a ``save_to_disk`` folder) into two :class:`TextDataset` (train, test) that
  share one label mapping.
* :func:`split_clients` partitions the training set with :func:`fedlora.partition.partition`,
  carves each client's held-out validation split from its share, and gives every client its own
  test split drawn from the test set with the client's label mix (:class:`ClientSplit`).
* :func:`encode` tokenises a :class:`TextDataset` into padded tensors.
* The table helpers every task kind builds its rows with (``fedlora.llm.classification``, ``.generation``,
  ``.qa``): :func:`read_tables` (a source's train and test :class:`Table`), :func:`column_texts`,
  :func:`check_columns`, :func:`subsample`, and ``STAND_IN_WORDS`` for the tiny variant's stand-in rows.

No model and no training loop here; everything is deterministic given ``seed``. ``datasets`` (an optional
dependency of the LLM layer, slow to import) is imported where a Hub or saved dataset is read.  Every bad input
raises :class:`fedlora.errors.ConfigError` with a one-line message, including a dataset the Hub
cannot serve (offline, unknown name).
"""
from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlora.errors import ConfigError, plural, quoted
from fedlora.partition import label_histograms, parse_partition
from fedlora.seeds import DATA_SPLIT, DATA_SUBSAMPLE, DATA_TEST, DATA_VAL, seed_of
from fedlora.partition import partition as _partition

from .tasks import TaskSpec, get_task

__all__ = [
    "TextDataset",
    "ColumnMap",
    "ClientSplit",
    "load_text_data",
    "check_labels",
    "split_clients",
    "describe_split",
    "encode",
    "LOCAL_FORMATS",
    "Table",
    "read_tables",
    "column_texts",
    "check_columns",
    "subsample",
    "stand_in_data",
    "STAND_IN_WORDS",
]

# Suffixes of the local files we read, in the order a folder is searched.
LOCAL_FORMATS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".csv.gz", ".tsv", ".tsv.gz")
# File stems searched for a split name in a folder of files (GLUE's own tsv release says "dev").
_SPLIT_STEMS = {
    "validation": ("validation", "dev", "valid", "val"),
    "validation_matched": ("validation_matched", "dev_matched"),
    "validation_mismatched": ("validation_mismatched", "dev_mismatched"),
}
_HOW_LOCAL = (
    "use a local copy: HF_HUB_OFFLINE=1 with a populated Hugging Face cache (HF_HOME), or point "
    "data.path at a file or folder (--set data.path=FILE_OR_FOLDER: csv/tsv/jsonl, train.*/test.* "
    "files, or a save_to_disk folder)"
)


# ============================================================================ data containers
@dataclass
class TextDataset:
    """A labelled text set.

    Attributes:
        texts: n input texts.
        text_pairs: n second segments (sentence-pair tasks) or None.
        labels: (n,) int64 class ids in ``[0, len(label_names))``.
        keys: n client-key values (for ``by_key`` partitions) or None.
        label_names: class names in id order (shared by the train and test sets of one load).
        targets: generation: n target texts (the one trained on); None for classification.
        references: generation: n lists of reference texts (every target of the row's prompt; what
            metrics score a generated text against); extractive QA: n lists of gold answers ([] where the
            question has none).
        answer_starts: extractive QA: n lists of the gold answers' character offsets in ``text_pairs``.
    """

    texts: list[str]
    text_pairs: list[str] | None
    labels: np.ndarray
    keys: list[str] | None
    label_names: list[str]
    targets: list[str] | None = None
    references: list[list[str]] | None = None
    answer_starts: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.int64).reshape(-1)
        n = len(self.texts)
        if self.labels.size != n:
            raise ConfigError(f"TextDataset: {n} texts but {self.labels.size} labels")
        for what, col in (("text_pairs", self.text_pairs), ("keys", self.keys), ("targets", self.targets),
                          ("references", self.references), ("answer_starts", self.answer_starts)):
            if col is not None and len(col) != n:
                raise ConfigError(f"TextDataset: {n} texts but {len(col)} {what}")
        if n and (self.labels.min() < 0 or self.labels.max() >= len(self.label_names)):
            raise ConfigError(
                f"TextDataset: label ids must lie in [0, {len(self.label_names)}) "
                f"(got {int(self.labels.min())}..{int(self.labels.max())})"
            )

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def subset(self, indices: Any) -> TextDataset:
        """The samples at ``indices`` (1-D ints, in the given order)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise ConfigError(f"TextDataset.subset: indices must lie in [0, {len(self)})")
        pick = idx.tolist()
        return TextDataset(
            texts=[self.texts[i] for i in pick],
            text_pairs=None if self.text_pairs is None else [self.text_pairs[i] for i in pick],
            labels=self.labels[idx],
            keys=None if self.keys is None else [self.keys[i] for i in pick],
            label_names=list(self.label_names),
            targets=None if self.targets is None else [self.targets[i] for i in pick],
            references=None if self.references is None else [self.references[i] for i in pick],
            answer_starts=None if self.answer_starts is None else [self.answer_starts[i] for i in pick],
        )


#: the run config's field for each ColumnMap field (error messages name what the user sets)
CONFIG_FIELD = {"text": "data.text_column", "text_pair": "data.text_pair_column", "label": "data.label_column",
                "target": "data.target_column",
                "client_key": "data.client_column"}


@dataclass(frozen=True)
class ColumnMap:
    """Which columns hold the text, the optional second text, the label and the client key."""

    text: str
    text_pair: str | None = None
    label: str | None = "label"
    client_key: str | None = None
    target: str | None = None  # generation: the target text

    @classmethod
    def coerce(cls, columns: Any, base: ColumnMap | None = None) -> ColumnMap:
        """A ColumnMap from None (``base`` or text/label), a ColumnMap, or a mapping overriding ``base``."""
        if columns is None:
            return base if base is not None else cls(text="text")
        if isinstance(columns, ColumnMap):
            return columns
        if isinstance(columns, Mapping):
            allowed = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(columns) - set(allowed))
            if unknown:
                raise ConfigError(f"data.columns: unknown key(s) {quoted(unknown)}; allowed: {', '.join(allowed)}")
            fields = dataclasses.asdict(base) if base is not None else {"text": "text"}
            fields.update(columns)
            for k, v in fields.items():
                if v is not None and (not isinstance(v, str) or not v):
                    raise ConfigError(f"{CONFIG_FIELD[k]} must be a column name (got {v!r})")
            if fields.get("text") is None:
                raise ConfigError("data.text_column is required (the column holding the input text)")
            return cls(**fields)
        raise ConfigError(f"data.columns must be a mapping like {{'text': 'sentence', 'label': 'label'}} (got {type(columns).__name__})")


@dataclass
class ClientSplit:
    """One client's data, as sorted int64 index arrays.

    ``train`` and ``val`` index the TRAIN dataset (disjoint; ``val`` is never trained on), ``test``
    indexes the TEST dataset.
    """

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


# ============================================================================ reading tables
@dataclass
class Table:
    """Columns of one split as Python lists, where they came from, and class names if known."""

    columns: dict[str, list]
    where: str
    class_names: list[str] | None = None  # from HF ClassLabel features
    lines: list[int] | None = None  # file line of every row (None: HF rows, report the index)
    text_file: bool = False  # values came from csv/tsv (all strings)

    @property
    def n(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def locate(self, i: int) -> str:
        return f"line {self.lines[i]}" if self.lines is not None else f"row {i}"

    def take(self, idx: np.ndarray, where: str) -> Table:
        pick = idx.tolist()
        return Table(
            {k: [v[i] for i in pick] for k, v in self.columns.items()},
            where,
            self.class_names,
            None if self.lines is None else [self.lines[i] for i in pick],
            self.text_file,
        )


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in sorted(LOCAL_FORMATS, key=len, reverse=True):
        if name.endswith(s):
            return s
    return path.suffix.lower()


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _read_file(path: Path) -> Table:
    """One csv / tsv / jsonl / json file (optionally gzipped) as a table."""
    fmt = _suffix(path).removesuffix(".gz")
    if fmt not in (".csv", ".tsv", ".jsonl", ".json"):
        raise ConfigError(
            f"data.path {str(path)!r}: unsupported file type {_suffix(path)!r}; use one of {list(LOCAL_FORMATS)} "
            "or a folder (train.*/test.* files, or a datasets save_to_disk folder)"
        )
    where = str(path)
    try:
        with _open_text(path) as f:
            if fmt in (".csv", ".tsv"):
                return _read_delimited(f, where, fmt)
            return _read_json(f, where, fmt)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:
        raise ConfigError(f"{where}: cannot read ({type(e).__name__}: {e})") from None


def _read_delimited(f: io.TextIOBase, where: str, fmt: str) -> Table:
    # tsv: no quoting (GLUE's tsv files hold bare quote characters inside sentences)
    if fmt == ".tsv":
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(f)
    try:
        header = next(reader)
    except StopIteration:
        raise ConfigError(f"{where}: empty file (no header row)") from None
    except csv.Error as e:
        raise ConfigError(f"{where}: not valid {fmt[1:]} ({e})") from None
    header = [h.strip().lstrip("\ufeff") for h in header]
    if len(set(header)) != len(header) or any(not h for h in header):
        raise ConfigError(f"{where}: the header row must name every column once (got {header})")
    cols: dict[str, list] = {h: [] for h in header}
    lines: list[int] = []
    try:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) != len(header):
                raise ConfigError(
                    f"{where}: line {reader.line_num} has {len(row)} fields but the header has {len(header)} ({header})"
                )
            for h, v in zip(header, row):
                cols[h].append(v)
            lines.append(reader.line_num)
    except csv.Error as e:
        raise ConfigError(f"{where}: not valid {fmt[1:]} at line {reader.line_num} ({e})") from None
    return Table(cols, where, lines=lines, text_file=True)


def _rows_to_table(rows: list[tuple[int, Any]], where: str, by_line: bool = True) -> Table:
    """Rows (line number or array index, object) → columns; a key missing from a row reads None."""
    names: dict[str, None] = {}
    for pos, r in rows:
        if not isinstance(r, dict):
            at = f"line {pos}" if by_line else f"item {pos}"
            raise ConfigError(f"{where}: {at} is not a JSON object (got {type(r).__name__})")
        names.update(dict.fromkeys(r))
    cols = {k: [r.get(k) for _, r in rows] for k in names}
    return Table(cols, where, lines=[pos for pos, _ in rows] if by_line else None)


def _read_json(f: io.TextIOBase, where: str, fmt: str) -> Table:
    text = f.read()
    if fmt == ".json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None  # maybe JSON lines with a .json name
        if isinstance(obj, list):
            if not obj:
                raise ConfigError(f"{where}: empty JSON array")
            return _rows_to_table(list(enumerate(obj)), where, by_line=False)
        if isinstance(obj, dict) and obj and all(isinstance(v, list) for v in obj.values()):
            lens = {len(v) for v in obj.values()}
            if len(lens) != 1:
                raise ConfigError(f"{where}: the column lists have different lengths {sorted(lens)}")
            return Table({k: list(v) for k, v in obj.items()}, where)
        if obj is not None:
            raise ConfigError(f"{where}: expected a list of objects, an object of column lists, or JSON lines")
    rows = []
    for no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((no, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: line {no} is not valid JSON ({e.msg})") from None
    if not rows:
        raise ConfigError(f"{where}: empty file (no JSON rows)")
    return _rows_to_table(rows, where)


def _hf_to_table(ds: Any, where: str, label_column: str | None) -> Table:
    """A ``datasets.Dataset`` as a table; ClassLabel names of the label column kept."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the llm extra
        raise ConfigError("the `datasets` package is needed for this data: pip install 'fedlora[llm]'") from None
    names = None
    feat = ds.features.get(label_column) if label_column else None
    if isinstance(feat, datasets.ClassLabel):
        names = list(feat.names)
    cols = ds[:] if len(ds) else {c: [] for c in ds.column_names}
    return Table({c: list(cols[c]) for c in ds.column_names}, where, class_names=names)


def _find_split_file(folder: Path, split: str) -> Path | None:
    stems = _SPLIT_STEMS.get(split, (split,))
    hits = [folder / f"{stem}{ext}" for stem in stems for ext in LOCAL_FORMATS if (folder / f"{stem}{ext}").is_file()]
    if len(hits) > 1:
        raise ConfigError(
            f"data.path {str(folder)!r}: several files could be the {split!r} split ({[h.name for h in hits]}); keep one"
        )
    return hits[0] if hits else None


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


# ============================================================================ the Hub
def _hub_error(name: str, config: str | None, exc: BaseException) -> ConfigError:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    msg = msg if len(msg) <= 240 else msg[:237] + "..."
    ident = repr(name) + (f" (config {config!r})" if config else "")
    low = msg.lower()
    if "scripts are no longer supported" in low:
        why = "is published as a loading script, which this `datasets` version cannot run"
    elif isinstance(exc, ConnectionError) or any(w in low for w in ("offline", "couldn't reach", "connect", "resolve host", "timed out")):
        why = "cannot be fetched: the Hugging Face Hub is unreachable (or offline mode is on) and it is not in the local cache"
    elif isinstance(exc, FileNotFoundError):
        why = "was not found on the Hugging Face Hub nor in the local cache"
    elif isinstance(exc, ValueError) and "config" in low:
        why = "has no such configuration"
    else:
        why = "could not be loaded"
    return ConfigError(f"dataset {ident} {why} ({type(exc).__name__}: {msg}); {_HOW_LOCAL}")


def _load_hub(name: str, config: str | None, revision: str | None) -> Any:
    """``datasets.load_dataset(name, config)`` → DatasetDict; every failure one ConfigError line."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"loading {name!r} from the Hugging Face Hub needs the `datasets` package (pip install 'fedlora[llm]'); "
            f"or point data.path at a local file or folder"
        ) from None
    try:
        dd = datasets.load_dataset(name, config, revision=revision)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user gets one line
        raise _hub_error(name, config, e) from None
    if not isinstance(dd, datasets.DatasetDict):
        dd = datasets.DatasetDict({"train": dd})
    return dd


# ============================================================================ labels
_INT_STR = re.compile(r"^\s*[-+]?\d+\s*$")


def _normalise_labels(tables: list[tuple[Table, list]]) -> tuple[str, list[list]]:
    """Labels of all tables as all-int or all-str lists; ('int' | 'str', per-table values)."""
    # csv/tsv cells are strings: read them as ids when every csv/tsv label looks like an integer
    text_ints = any(t.text_file for t, _ in tables) and all(
        isinstance(v, str) and _INT_STR.match(v) for t, vals in tables if t.text_file for v in vals
    )
    kinds: set[str] = set()
    out: list[list] = []
    for t, vals in tables:
        norm: list = []
        for i, v in enumerate(vals):
            if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v)):
                raise ConfigError(f"{t.where}: missing label at {t.locate(i)}; every sample needs a label")
            if isinstance(v, str):
                if text_ints and t.text_file:
                    norm.append(int(v))
                    kinds.add("int")
                else:
                    norm.append(v.strip())
                    kinds.add("str")
            elif isinstance(v, (bool, np.bool_)):
                norm.append(int(v))
                kinds.add("int")
            elif isinstance(v, numbers.Integral):
                norm.append(int(v))
                kinds.add("int")
            elif isinstance(v, numbers.Real) and float(v).is_integer():
                norm.append(int(v))
                kinds.add("int")
            else:
                raise ConfigError(
                    f"{t.where}: label {v!r} at {t.locate(i)} is neither a class id (integer) nor a class name (string)"
                )
        out.append(norm)
    if len(kinds) > 1:
        raise ConfigError(
            f"labels mix numbers and strings ({', '.join(t.where for t, _ in tables)}); use one kind: "
            "integer ids or class names"
        )
    return (kinds.pop() if kinds else "int"), out


def _label_ids(
    tables: list[tuple[Table, list]], declared: Sequence[Any] | None, known: list[str] | None
) -> tuple[list[np.ndarray], list[str]]:
    """Class ids per table and the class names, one mapping for all tables.

    * ``declared`` (the user's ``labels``): names/values in id order; anything else is an error.
    * else string labels: ``known`` order (task / dataset class names) if given, else sorted names;
      integer labels: used as ids, named by ``known`` or "0".."K-1".
    """
    kind, values = _normalise_labels(tables)

    def violation(bad: list[tuple[int, int]], allowed: str, what: str) -> ConfigError:
        ti, i = bad[0]
        t = tables[ti][0]
        return ConfigError(
            f"{t.where}: label {values[ti][i]!r} at {t.locate(i)} ({len(bad)} row(s) in all) {what}; allowed: {allowed}"
        )

    if declared is not None:
        declared = list(declared)
        if not declared or len(set(map(str, declared))) != len(declared):
            raise ConfigError(f"data.labels must be a non-empty list of distinct class names (got {declared})")
        names = [str(d) for d in declared]
        if kind == "str" or all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in declared):
            pos = {d if kind == "int" else str(d): k for k, d in enumerate(declared)}
            bad = [(ti, i) for ti, vals in enumerate(values) for i, v in enumerate(vals) if v not in pos]
            if bad:
                raise violation(bad, str(declared), "is not among the declared labels (data.labels)")
            return [np.array([pos[v] for v in vals], dtype=np.int64) for vals in values], names
        # integer ids with declared names
        bad = [(ti, i) for ti, vals in enumerate(values) for i, v in enumerate(vals) if not 0 <= v < len(names)]
        if bad:
            raise violation(bad, f"ids 0..{len(names) - 1} for {names}", "is outside the declared labels (data.labels)")
        return [np.array(vals, dtype=np.int64) for vals in values], names

    if kind == "str":
        if known is not None:
            pos = {n: k for k, n in enumerate(known)}
            bad = [(ti, i) for ti, vals in enumerate(values) for i, v in enumerate(vals) if v not in pos]
            if bad:
                raise violation(bad, str(known), "is not one of the task's class names (set data.labels to declare "
                                "others, or data.task to null for a file with labels of its own)")
            return [np.array([pos[v] for v in vals], dtype=np.int64) for vals in values], list(known)
        names = sorted({v for vals in values for v in vals})
        pos = {n: k for k, n in enumerate(names)}
        return [np.array([pos[v] for v in vals], dtype=np.int64) for vals in values], names

    neg = [(ti, i) for ti, vals in enumerate(values) for i, v in enumerate(vals) if v < 0]
    if neg:
        raise violation(neg, "ids ≥ 0", "is negative (GLUE-style test splits hide their labels as -1: use the "
                        "validation split as the test split)")
    top = max((max(vals) for vals in values if vals), default=-1)
    if known is not None:
        if top >= len(known):
            bad = [(ti, i) for ti, vals in enumerate(values) for i, v in enumerate(vals) if v >= len(known)]
            raise violation(bad, f"ids 0..{len(known) - 1} for {known}", "is outside the task's classes")
        names = list(known)
    else:
        names = [str(k) for k in range(top + 1)]
    return [np.array(vals, dtype=np.int64) for vals in values], names


def _names_from_text_column(tables: list[Table], label_col: str, text_col: str | None) -> list[str] | None:
    """Class names from a (label id, label name) column pair, e.g. SetFit's label_text; None
    unless the ids seen are exactly 0..K-1."""
    if not text_col or any(text_col not in t.columns or label_col not in t.columns for t in tables):
        return None
    pairs: dict[int, str] = {}
    for t in tables:
        for i, (lab, name) in enumerate(zip(t.columns[label_col], t.columns[text_col])):
            if isinstance(lab, numbers.Integral) and not isinstance(lab, bool) and lab >= 0 and name is not None:
                if pairs.setdefault(int(lab), str(name)) != str(name):
                    raise ConfigError(
                        f"{t.where}: label {lab} is named both {pairs[int(lab)]!r} and {name!r} in column "
                        f"{text_col!r} ({t.locate(i)})"
                    )
    if not pairs or sorted(pairs) != list(range(max(pairs) + 1)):
        return None
    return [pairs[k] for k in range(len(pairs))]


# ============================================================================ building datasets
def column_texts(t: Table, col: str, what: str) -> list[str]:
    """Column ``col`` of ``t`` as texts (``what`` names it in the error): every value a non-empty string."""
    vals = t.columns[col]
    bad = [i for i, v in enumerate(vals) if not isinstance(v, str) or not v.strip()]
    if bad:
        v = vals[bad[0]]
        kind = "empty" if v is None or (isinstance(v, str)) else f"not text ({type(v).__name__})"
        raise ConfigError(
            f"{t.where}: {what} column {col!r} is {kind} at {t.locate(bad[0])} ({len(bad)} row(s) in all); "
            "every sample needs non-empty text"
        )
    return list(vals)


def check_columns(t: Table, cols: ColumnMap) -> None:
    """Every column ``cols`` names is one of ``t``'s (else one line naming it, its config field and the columns)."""
    have = list(t.columns)
    for field in ("text", "text_pair", "label", "client_key", "target"):
        name = getattr(cols, field)
        if name is not None and name not in t.columns:
            raise ConfigError(
                f"{t.where} has no column {name!r} ({CONFIG_FIELD[field]}); its columns: {have}"
            )


def subsample(n: int, m: int | None, seed: int, stream: int, what: str) -> np.ndarray | None:
    """``m`` of ``n`` rows drawn from the generator of (``seed``, ``stream``), sorted; None: keep all (``m`` None
    or ≥ n). ``what``: the data field ``m`` came from (``max_train_samples``)."""
    if m is None:
        return None
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
        raise ConfigError(f"data.{what} must be a positive integer or None (got {m!r})")
    if m >= n:
        return None
    rng = np.random.default_rng(seed_of(seed, DATA_SUBSAMPLE, stream))
    return np.sort(rng.choice(n, size=int(m), replace=False))


def _split_one(t: Table, test_fraction: float, seed: int) -> tuple[Table, Table]:
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real) or not 0 < test_fraction < 1:
        raise ConfigError(f"data.test_fraction must be a number in (0, 1) (got {test_fraction!r})")
    n = t.n
    if n < 2:
        raise ConfigError(f"{t.where}: {n} row(s); splitting into train and test needs at least 2")
    n_test = min(n - 1, max(1, int(round(test_fraction * n))))
    perm = np.random.default_rng(seed_of(seed, DATA_SPLIT)).permutation(n)
    return (
        t.take(np.sort(perm[n_test:]), f"{t.where} (train part)"),
        t.take(np.sort(perm[:n_test]), f"{t.where} (test part)"),
    )


def _from_folder(folder: Path, train_split: str | None, test_split: str | None,
                 default_test: tuple[str, ...], test_fraction: float, seed: int,
                 label_col: str | None) -> tuple[Table, Table]:
    if _is_saved_dataset(folder):
        try:
            import datasets

            obj = datasets.load_from_disk(str(folder))
        except ImportError:
            raise ConfigError(f"{folder} is a datasets save_to_disk folder; reading it needs `datasets`") from None
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{folder}: cannot load the save_to_disk folder ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        if isinstance(obj, datasets.DatasetDict):
            return _pick_splits(obj, str(folder), train_split, test_split, default_test, test_fraction, seed, label_col)
        if train_split or test_split:
            raise ConfigError(f"{folder} holds one saved Dataset without splits; drop train_split/test_split (it is split by data.test_fraction)")
        return _split_one(_hf_to_table(obj, str(folder), label_col), test_fraction, seed)
    tr_name = train_split or "train"
    tr = _find_split_file(folder, tr_name)
    if tr is None:
        have = sorted(p.name for p in folder.iterdir() if p.is_file())
        raise ConfigError(
            f"data.path {str(folder)!r}: no {tr_name}.* file ({'/'.join(LOCAL_FORMATS)}); files there: {have[:20]}"
        )
    candidates = (test_split,) if test_split else default_test
    te = None
    for s in candidates:
        te = _find_split_file(folder, s)
        if te is not None:
            break
    if te is None and test_split:
        have = sorted(p.name for p in folder.iterdir() if p.is_file())
        raise ConfigError(f"data.path {str(folder)!r}: no file for test split {test_split!r}; files there: {have[:20]}")
    if te is None:  # only a training file: split it
        return _split_one(_read_file(tr), test_fraction, seed)
    return _read_file(tr), _read_file(te)


def _pick_splits(dd: Any, where: str, train_split: str | None, test_split: str | None,
                 default_test: tuple[str, ...], test_fraction: float, seed: int,
                 label_col: str | None) -> tuple[Table, Table]:
    avail = list(dd.keys())
    tr_name = train_split or "train"
    if tr_name not in dd:
        raise ConfigError(f"{where} has no split {tr_name!r} (data.train_split); its splits: {avail}")
    train = _hf_to_table(dd[tr_name], f"{where} split {tr_name!r}", label_col)
    if test_split and test_split == tr_name:  # the test rows held out of the training split (test_fraction)
        return _split_one(train, test_fraction, seed)
    if test_split:
        if test_split not in dd:
            raise ConfigError(f"{where} has no split {test_split!r} (data.test_split); its splits: {avail}")
        return train, _hf_to_table(dd[test_split], f"{where} split {test_split!r}", label_col)
    for s in default_test:
        if s in dd and s != tr_name:
            return train, _hf_to_table(dd[s], f"{where} split {s!r}", label_col)
    return _split_one(train, test_fraction, seed)


def read_tables(spec: TaskSpec | None, *, path: str | Path | None, hf_name: str | None, hf_config: str | None,
                train_split: str | None, test_split: str | None, default_test: tuple[str, ...],
                test_fraction: float, seed: int, label_col: str | None) -> tuple[Table, Table, str]:
    """The train and test tables of a source (local file or folder, a bundled task's folder, the Hub) and
    the source's name (``file:…`` / ``hf:…``) — the reading every task's loader shares; no column is
    interpreted here (``label_col``: where HF ClassLabel names come from, or None). ``train_split``: the one
    the user named (None: the task's)."""
    tr_split = train_split or (spec.train_split if spec is not None else None)
    local = Path(path).expanduser() if path is not None else None
    if local is None and spec is not None and spec.local_dir and hf_name is None:
        local = Path(spec.local_dir)
    if local is not None:
        if not local.exists():
            raise ConfigError(f"data.path {str(local)!r} does not exist")
        if local.is_dir():
            train_t, test_t = _from_folder(local, tr_split, test_split, default_test, test_fraction, seed, label_col)
        else:
            if train_split or test_split:
                raise ConfigError(
                    f"data.path {str(local)!r} is a single file without splits; drop train_split/test_split "
                    "(it is split by data.test_fraction) or point data.path at a folder of split files"
                )
            train_t, test_t = _split_one(_read_file(local), test_fraction, seed)
        source = f"file:{local}"
    else:
        name = hf_name or spec.hf_path  # type: ignore[union-attr]
        config = hf_config if hf_name is not None else spec.hf_config  # type: ignore[union-attr]
        revision = spec.hf_revision if (spec is not None and hf_name is None) else None
        dd = _load_hub(name, config, revision)
        where = f"{name}" + (f"[{config}]" if config else "")
        train_t, test_t = _pick_splits(dd, where, tr_split, test_split, default_test, test_fraction, seed, label_col)
        source = f"hf:{where}"
    return train_t, test_t, source


def load_text_data(
    *,
    task: str | TaskSpec | None = None,
    path: str | Path | None = None,
    hf_name: str | None = None,
    hf_config: str | None = None,
    columns: ColumnMap | Mapping[str, str | None] | None = None,
    train_split: str | None = None,
    test_split: str | None = None,
    labels: Sequence[Any] | None = None,
    test_fraction: float = 0.2,
    max_train_samples: int | None = None,
    max_test_samples: int | None = None,
    seed: int = 0,
    label_checks: bool = False,
    allow_unseen_test_labels: bool = False,
) -> tuple[TextDataset, TextDataset, TaskSpec]:
    """Load (train, test, task info).

    Sources (one of):
        * ``task``: a registered task (``fedlora.llm.tasks``) from the Hub (``datasets.load_dataset``) or,
          for bundled tasks, from the package;
        * ``task`` + ``path``: the task's columns, label names and metrics, data from local files
          (e.g. a local copy of GLUE SST-2 as tsv: a folder with train.tsv and dev.tsv);
        * ``hf_name`` (+ ``hf_config``): any Hub dataset (``columns`` default: text → label);
        * ``path``: a csv / tsv / jsonl / json file (optionally .gz; split into train/test with
          ``test_fraction``), a folder of ``train.*`` and ``test.*`` (or ``validation.*`` /
          ``dev.*``) files, or a ``Dataset(Dict).save_to_disk`` folder.

    Args:
        columns: ColumnMap, or a mapping overriding the task's columns (keys text, text_pair,
            label, client_key).
        train_split: split name of the training rows (Hub / saved / folder sources).
        test_split: split name of the test rows (likewise).
        labels: the declared label set, in id order; any label outside it is an error. String
            labels are otherwise mapped to ids by the task's class names or sorted order.
        test_fraction: test share when a source has no test split (deterministic with ``seed``).
        max_train_samples: deterministic random subsample of the training rows (seeded; order kept).
        max_test_samples: the same for the test rows.
        seed: integer ≥ 0.
        label_checks: refuse labels a classifier's run cannot mean anything with (``check_labels``: one label,
            a different label in every row, test labels no training row has) — a run's data (``fedlora run``).
        allow_unseen_test_labels: with ``label_checks``, accept test rows whose label no training row has (they
            are left out of every client's test set, ``split_clients``): ``data.allow_unseen_test_labels``.
    Returns: ``(train, test, info)``: two TextDatasets sharing ``label_names``, and the TaskSpec
    actually used (for ``path`` / ``hf_name`` sources a new one named ``file:...`` / ``hf:...``
    with metrics accuracy and macro-F1), its ``label_names`` filled in.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"data.seed must be a non-negative integer (got {seed!r})")
    seed = int(seed)
    spec = get_task(task) if isinstance(task, str) else task
    if spec is not None and not isinstance(spec, TaskSpec):
        raise ConfigError(f"task must be a task name or TaskSpec (got {type(task).__name__})")
    if path is not None and hf_name is not None:
        raise ConfigError("give data.path or data.hf_name, not both")
    if spec is None and path is None and hf_name is None:
        raise ConfigError("no data source: set data.task, data.hf_name or data.path")
    base = None
    if spec is not None:
        base = ColumnMap(spec.text_column, spec.text_pair_column, spec.label_column)
    cols = ColumnMap.coerce(columns, base)
    label_text_col = spec.label_text_column if spec is not None else None
    default_test = tuple(dict.fromkeys(((spec.test_split,) if spec else ()) + ("test", "validation")))
    tr_split = train_split or (spec.train_split if spec is not None else None)

    train_t, test_t, source = read_tables(spec, path=path, hf_name=hf_name, hf_config=hf_config,
                                          train_split=train_split, test_split=test_split, default_test=default_test,
                                          test_fraction=test_fraction, seed=seed, label_col=cols.label)

    for t in (train_t, test_t):
        check_columns(t, cols)
        if t.n == 0:
            raise ConfigError(f"{t.where}: no rows")
    known = train_t.class_names or _names_from_text_column([train_t, test_t], cols.label, label_text_col)
    if known is None and spec is not None and spec.label_names is not None:
        known = list(spec.label_names)
    (y_tr, y_te), names = _label_ids(
        [(train_t, train_t.columns[cols.label]), (test_t, test_t.columns[cols.label])], labels, known
    )

    def build(t: Table, y: np.ndarray, m: int | None, stream: int, what: str) -> TextDataset:
        texts = column_texts(t, cols.text, "text")
        pairs = column_texts(t, cols.text_pair, "text_pair") if cols.text_pair else None
        keys = None
        if cols.client_key:
            raw = t.columns[cols.client_key]
            missing = [i for i, v in enumerate(raw) if v is None or (isinstance(v, str) and not v.strip())]
            if missing:
                raise ConfigError(
                    f"{t.where}: client key column {cols.client_key!r} is empty at {t.locate(missing[0])} "
                    f"({len(missing)} row(s) in all)"
                )
            keys = [str(v) for v in raw]
        ds = TextDataset(texts, pairs, y, keys, list(names))
        idx = subsample(len(ds), m, seed, stream, what)
        return ds if idx is None else ds.subset(idx)

    train = build(train_t, y_tr, max_train_samples, 11, "max_train_samples")
    test = build(test_t, y_te, max_test_samples, 12, "max_test_samples")
    if label_checks:
        check_labels(train, test, column=cols.label, where=(train_t.where, test_t.where),
                     table_labels=train_t.columns[cols.label], columns=list(train_t.columns),
                     subsampled=max_train_samples is not None and max_train_samples < train_t.n,
                     allow_unseen=allow_unseen_test_labels)

    if spec is not None:
        info = dataclasses.replace(spec, label_names=tuple(names))
    else:
        info = TaskSpec(
            name=source, hf_path=hf_name, hf_config=hf_config if hf_name else None,
            text_column=cols.text, text_pair_column=cols.text_pair, label_column=cols.label,
            train_split=tr_split or "train", test_split=test_split or "test",
            metrics=("accuracy", "macro_f1"), main_metric="accuracy", label_names=tuple(names),
            description=f"text classification from {source}",
        )
    return train, test, info


def _some(values: Sequence[Any], k: int = 3) -> str:
    """The first ``k`` of ``values`` as a phrase: 'a', 'b', 'c', …"""
    return ", ".join(repr(v) for v in values[:k]) + (", …" if len(values) > k else "")


def check_labels(train: TextDataset, test: TextDataset, *, column: str, where: tuple[str, str],
                 table_labels: Sequence[Any], columns: Sequence[str], subsampled: bool = False,
                 allow_unseen: bool = False) -> None:
    """What a classifier's labels must be for the run to mean what it reports (one line each, naming the
    column and the likely mistake):

    * not a different value in every training row (``table_labels``: the whole training table, before any
      subsampling): an id or text column, not classes — no test row could have a label seen in training;
    * at least 2 distinct labels among the training rows: with one, every prediction is right (accuracy 1.0,
      loss 0.0 from round 0);
    * every test row's label among the training rows' (``allow_unseen``: accept, and those rows are left out
      of every client's test set, ``split_clients``)."""
    names = list(train.label_names)
    n = len(table_labels)
    if n > 2 and len({str(v) for v in table_labels}) == n:
        raise ConfigError(
            f"{where[0]}: column {column!r} holds a different value in each of its {n} training rows "
            f"({_some(list(table_labels))}): that is an id or a text, not a class shared by many rows, and no test "
            f"row can have a label seen in training; set data.label_column to the column of classes (columns: "
            f"{', '.join(columns)})")
    seen = np.unique(train.labels)
    if seen.size < 2:
        only = names[int(seen[0])] if seen.size else None
        cut = " of the rows data.max_train_samples keeps" if subsampled else ""
        raise ConfigError(
            f"{where[0]}: column {column!r} holds one label ({only!r}) in all {len(train)} training rows{cut}: "
            f"classification needs ≥ 2 labels (with one, every prediction is right); is data.label_column the "
            f"right column (columns: {', '.join(columns)}), or was the file filtered to one class?")
    unseen = ~np.isin(test.labels, seen)
    if unseen.any() and not allow_unseen:
        labels = [names[int(c)] for c in np.unique(test.labels[unseen])]
        cut = " (data.max_train_samples keeps a part of them)" if subsampled else ""
        raise ConfigError(
            f"{where[1]}: {int(unseen.sum())} of the {len(test)} test rows have a label no training row has"
            f"{cut} ({_some(labels)}; the training rows' labels: {_some([names[int(c)] for c in seen], 5)}): "
            f"no client trains on it, so they would be left out of every test set; give the training data rows "
            f"of those labels, or set data.allow_unseen_test_labels: true to leave them out")


# ============================================================================ client splits
def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers ≥ 0 summing to ``total``, proportional to integer ``weights`` (Hamilton's method).

    Floors of ``total·w_j / Σw`` first; the leftover units go to the largest remainders (ties: the
    lower client index).  A zero weight gets zero.  Exact integer arithmetic.
    """
    w = np.asarray(weights, dtype=np.int64)
    W = int(w.sum())
    num = total * w
    alloc = num // W
    rem = num % W
    left = total - int(alloc.sum())
    order = np.lexsort((np.arange(w.size), -rem))
    alloc[order[:left]] += 1
    return alloc


def split_clients(
    train: TextDataset,
    test: TextDataset,
    *,
    partition: str,
    n_clients: int | None,
    seed: int,
    val_fraction: float = 0.1,
    min_val: int = 1,
) -> list[ClientSplit]:
    """Per-client train / validation / test index arrays.

    1. The TRAIN set is partitioned with ``fedlora.partition.partition(partition, labels=train.labels,
       n_clients=n_clients, seed=seed, keys=train.keys)`` (docs/design.md §5; ``by_key`` uses ``train.keys``,
       the ``client_key`` column; ``n_clients=None`` there means one client per key).
    2. Each client's share is split at random into ``train`` and a held-out ``val`` of
       ``max(min_val, round(val_fraction·n_k))`` samples (``val_fraction=0``: no validation split).
    3. Each client gets its own ``test`` split with its own label mix: for every class c, the test
       samples of class c are divided among the clients in proportion to their share counts of c
       (train + val) by largest-remainder rounding; a client without class c gets none of it, and
       test samples of a class no client trained on are left out.  For ``by_key`` partitions with
       keyed test data, a client instead gets the test samples whose key it holds (others are left
       out).  Every test sample goes to at most one client.

    Returns: ``n_clients`` ClientSplit (sorted int64 arrays).
    Raises: ConfigError when the partition is impossible for this data (naming the data size and
    what would work).
    """
    if not isinstance(train, TextDataset) or not isinstance(test, TextDataset):
        raise ConfigError("split_clients: train and test must be TextDataset (from load_text_data)")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"split_clients: seed must be a non-negative integer (got {seed!r})")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real) or not 0 <= val_fraction < 1:
        raise ConfigError(f"split_clients: val_fraction must be a number in [0, 1) (got {val_fraction!r})")
    if isinstance(min_val, bool) or not isinstance(min_val, numbers.Integral) or min_val < 0:
        raise ConfigError(f"split_clients: min_val must be an integer ≥ 0 (got {min_val!r})")
    if n_clients is not None and (isinstance(n_clients, bool) or not isinstance(n_clients, numbers.Integral) or n_clients < 1):
        raise ConfigError(f"split_clients: n_clients must be a positive integer (got {n_clients!r})")
    n = len(train)
    if n == 0:
        raise ConfigError("split_clients: the training set is empty")
    name, params = parse_partition(partition)
    n_classes_present = int(np.unique(train.labels).size)
    what = (f"partition {partition!r} of {n} training samples ({plural(n_classes_present, 'class', 'classes')}) into "
            + (plural(n_clients, "client") if n_clients is not None else "one client per key"))
    if name == "by_key" and train.keys is None:
        raise ConfigError(f"{what}: by_key needs a client key column; set data.client_column")
    if name == "pathological":
        k = params.get("k", 2)
        if isinstance(k, numbers.Integral) and k > n_classes_present:
            raise ConfigError(
                f"{what}: pathological(k={k}) deals each client {k} label-sorted shards but the data has only "
                f"{plural(n_classes_present, 'class', 'classes')}; use k ≤ {n_classes_present} (k = 1 or 2 is the usual setting)"
            )
    if n_clients is not None and n_clients > n:
        raise ConfigError(f"{what}: more clients than training samples; use n_clients ≤ {n} (or more data)")
    try:
        parts = _partition(
            partition, labels=train.labels, keys=np.asarray(train.keys, dtype=object) if train.keys is not None else None,
            n_clients=n_clients, seed=int(seed),
        )
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    K = len(parts)

    need = (int(min_val) if val_fraction > 0 else 0) + 1
    sizes = np.array([len(p) for p in parts])
    if sizes.min() < need:
        j = int(sizes.argmin())
        hint = ("; use fewer clients, a milder partition, or val_fraction=0" if need > 1
                else "; use fewer clients or a milder partition (e.g. dirichlet with min_size ≥ 1)")
        raise ConfigError(
            f"{what}: client {j} gets {int(sizes[j])} training sample(s) but needs ≥ {need} "
            f"({'1 to train on' if need == 1 else f'{need - 1} for validation and 1 to train on'}){hint}"
        )

    rng_val = np.random.default_rng(seed_of(int(seed), DATA_VAL))
    train_idx: list[np.ndarray] = []
    val_idx: list[np.ndarray] = []
    for p in parts:
        m = len(p)
        n_val = max(int(min_val), int(round(val_fraction * m))) if val_fraction > 0 else 0
        n_val = min(n_val, m - 1)
        perm = rng_val.permutation(np.asarray(p, dtype=np.int64))
        val_idx.append(np.sort(perm[:n_val]))
        train_idx.append(np.sort(perm[n_val:]))

    owner = np.full(len(test), -1, dtype=np.int64)
    if name == "by_key" and test.keys is not None:
        key_client: dict[str, int] = {}
        for j, p in enumerate(parts):
            for i in np.asarray(p).tolist():
                key_client[train.keys[i]] = j  # type: ignore[index]
        owner = np.array([key_client.get(k, -1) for k in test.keys], dtype=np.int64)
    elif len(test):
        n_cls = max(train.num_labels, test.num_labels)  # every label id is below its set's num_labels
        hist = label_histograms(train.labels, parts, n_classes=n_cls)  # (K, C) share counts
        rng_test = np.random.default_rng(seed_of(int(seed), DATA_TEST))
        for c in range(n_cls):
            idx = np.flatnonzero(test.labels == c)
            if idx.size == 0 or hist[:, c].sum() == 0:
                continue
            alloc = _largest_remainder(idx.size, hist[:, c])
            owner[rng_test.permutation(idx)] = np.repeat(np.arange(K), alloc)
    test_idx = [np.flatnonzero(owner == j).astype(np.int64) for j in range(K)]
    return [ClientSplit(train=t, val=v, test=s) for t, v, s in zip(train_idx, val_idx, test_idx)]


def describe_split(splits: Sequence[ClientSplit], train: TextDataset, test: TextDataset) -> dict[str, Any]:
    """Per-client sizes and label histograms (JSON-ready) for a run's records.

    Returns keys: n_clients, label_names, train_sizes / val_sizes / test_sizes (lists of K ints),
    train_hist / val_hist / test_hist (K × C lists), test_unassigned (test samples no client got),
    train_unassigned (training samples in no client's train or val; 0 for split_clients output).
    """
    C = max(train.num_labels, test.num_labels)
    out: dict[str, Any] = {"n_clients": len(splits), "label_names": list(train.label_names)}
    for part, ds in (("train", train), ("val", train), ("test", test)):
        arrays = [np.asarray(getattr(s, part), dtype=np.int64) for s in splits]
        for a in arrays:
            if a.size and (a.min() < 0 or a.max() >= len(ds)):
                raise ConfigError(f"describe_split: a client's {part} indices fall outside the {len(ds)} samples")
        out[f"{part}_sizes"] = [int(a.size) for a in arrays]
        hist = label_histograms(ds.labels, arrays, n_classes=C) if len(ds) else np.zeros((len(arrays), C), np.int64)
        out[f"{part}_hist"] = hist.tolist()
    used_train = np.concatenate([np.concatenate([s.train, s.val]) for s in splits]) if splits else np.array([], np.int64)
    used_test = np.concatenate([s.test for s in splits]) if splits else np.array([], np.int64)
    out["train_unassigned"] = int(len(train) - np.unique(used_train).size)
    out["test_unassigned"] = int(len(test) - np.unique(used_test).size)
    return out


# ============================================================================ tokenising
def encode(dataset: TextDataset, tokenizer: Any, max_length: int) -> dict[str, Any]:
    """Tokenise a dataset into tensors padded to its longest sample (at most ``max_length``).

    Pairs are tokenised as pairs (``tokenizer(texts, text_pairs)``; truncation longest-first).
    Returns ``{"input_ids": (n, L) long, "attention_mask": (n, L), ["token_type_ids": (n, L)],
    "labels": (n,) long}`` with L ≤ max_length.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 2:
        raise ConfigError(f"encode: max_length must be an integer ≥ 2 (got {max_length!r})")
    if len(dataset) == 0:
        raise ConfigError("encode: the dataset is empty")
    try:
        enc = tokenizer(
            list(dataset.texts),
            list(dataset.text_pairs) if dataset.text_pairs is not None else None,
            padding="longest",
            truncation=True,
            max_length=int(max_length),
            return_tensors="pt",
        )
    except ValueError as e:
        msg = " ".join(str(e).split())
        if "pad" in msg.lower():
            raise ConfigError(
                f"encode: the tokenizer cannot pad ({msg[:160]}); set tokenizer.pad_token (e.g. to its eos_token)"
            ) from None
        raise
    out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if "token_type_ids" in enc:
        out["token_type_ids"] = enc["token_type_ids"]
    out["labels"] = torch.as_tensor(dataset.labels, dtype=torch.long)
    return out


#: the stand-in's words: a label's texts draw mostly from its own slice of this list (so a model can learn)
STAND_IN_WORDS = tuple("""river stone cloud apple engine market garden letter window silver paper
    forest bridge candle doctor island ladder mirror needle orange pencil rocket saddle ticket violin
    wallet yellow anchor basket cactus dragon eagle feather guitar hammer jacket kettle lemon magnet
    napkin oyster parrot quartz rabbit sponge tomato umbrella valley walnut yogurt zebra blanket cotton
    desert falcon glacier harbor igloo jungle kitten lantern meadow nickel orchard pepper quiver radish
    saffron thunder tulip velvet whistle bamboo cobalt dolphin ember fossil granite hazel ivory jasmine""".split())


def stand_in_data(task: TaskSpec, *, n_train: int = 120, n_test: int = 60,
                  seed: int = 0) -> tuple[TextDataset, TextDataset, TaskSpec]:
    """The tiny variant's data (``tiny: true``): ``n_train`` / ``n_test`` generated rows with ``task``'s
    shape — one text or a pair, its number of classes (its label names) — so a config of a Hub task runs
    offline. Each text is 6–12 words; most words come from a slice of a fixed word list that depends on the
    label, so the labels can be learned. Not the task's data: only for checking that a config runs."""
    names = list(task.label_names) if task.label_names is not None else (
        [f"class_{i}" for i in range(task.n_labels)] if task.n_labels else None)
    if names is None:
        raise ConfigError(f"tiny: task {task.name!r} names no classes to build stand-in data for")
    rng = np.random.default_rng(seed)
    W, C = len(STAND_IN_WORDS), len(names)

    def text(label: int) -> str:
        n = int(rng.integers(6, 13))
        own = [(label * 7 + int(rng.integers(0, 5))) % W for _ in range(n)]
        any_ = rng.integers(0, W, size=n)
        return " ".join(STAND_IN_WORDS[o if rng.random() < 0.7 else int(a)] for o, a in zip(own, any_))

    def make(n: int) -> TextDataset:
        labels = np.arange(n) % C
        rng.shuffle(labels)
        texts = [text(int(y)) for y in labels]
        pairs = [text(int(y)) for y in labels] if task.text_pair_column is not None else None
        return TextDataset(texts, pairs, labels, None, names)

    return make(n_train), make(n_test), task

"""Named text-classification tasks (docs/design.md §8): where the data lives, its columns, its metrics.

A :class:`TaskSpec` says nothing about models or training; :func:`fedlora.llm.data.load_text_data` reads
it. Column names are those of the HuggingFace datasets as published:

=================  ===============================  ==========================  ==================
task               HF dataset [config]              text (, pair) → label       test split
=================  ===============================  ==========================  ==================
glue/cola          nyu-mll/glue [cola]              sentence → label            validation
glue/sst2          nyu-mll/glue [sst2]              sentence → label            validation
glue/mnli          nyu-mll/glue [mnli]              premise, hypothesis → label validation_matched
glue/qqp           nyu-mll/glue [qqp]               question1, question2        validation
glue/qnli          nyu-mll/glue [qnli]              question, sentence          validation
glue/rte           nyu-mll/glue [rte]               sentence1, sentence2        validation
banking77          PolyAI/banking77                 text → label                test
20newsgroups       SetFit/20_newsgroups             text → label (label_text)   test
debian-sections    bundled (llm/datasets/)          text → label                test
=================  ===============================  ==========================  ==================

GLUE's test splits carry hidden labels (-1), so the validation split is the test split (RoLoRA
§4: "use the original validation set as the new test set"; a client's own validation data is carved
from its training share by ``fedlora.llm.data.split_clients``).  Metrics follow PF2LoRA's GLUE experiments:
CoLA Matthews correlation, MNLI/SST-2/QQP/QNLI accuracy (RTE accuracy as in RoLoRA Table 1);
BANKING77 and 20 Newsgroups accuracy (LoRA-A² Table 1) plus macro-F1.

``PolyAI/banking77`` is read from the Hub's parquet export (``revision="refs/convert/parquet"``):
its main branch held a loading script, which ``datasets`` ≥ 4 no longer runs.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from fedlora.errors import ConfigError

from .datasets import DEBIAN_SECTIONS_DIR

__all__ = ["TaskSpec", "TASKS", "get_task", "available_tasks"]


@dataclass(frozen=True)
class TaskSpec:
    """One classification task.

    Attributes:
        name: registry name (``"glue/sst2"``).
        hf_path: HuggingFace dataset id, or None for data shipped in ``local_dir``.
        hf_config: dataset configuration (GLUE sub-task) or None.
        text_column / text_pair_column: input text column(s); the pair column is None for
            single-sentence tasks.
        label_column: class label column (ints or strings).
        train_split / test_split: split names (files ``<split>.*`` for local folders).
        metrics: metric names reported (see ``fedlora.llm.metrics.METRICS``).
        main_metric: the one used for model selection / headline tables.
        label_names: class names in id order, or None to read them from the dataset's features.
        description: one line for listings.
        hf_revision: Hub revision to load (None: the default branch).
        label_text_column: a column holding the class name of every row (used to name the
            classes when the features carry no names, e.g. SetFit/20_newsgroups).
        local_dir: folder with ``train.*`` / ``test.*`` files for bundled data sets.
        n_labels: the number of classes where ``label_names`` is None (the tiny variant's stand-in data
            needs it without reading the dataset).
    """

    name: str
    hf_path: str | None
    hf_config: str | None
    text_column: str
    text_pair_column: str | None
    label_column: str
    train_split: str
    test_split: str
    metrics: tuple[str, ...]
    main_metric: str
    label_names: tuple[str, ...] | None
    description: str
    hf_revision: str | None = None
    label_text_column: str | None = None
    local_dir: str | None = None
    n_labels: int | None = None

    def __post_init__(self) -> None:
        if self.main_metric not in self.metrics:
            raise ConfigError(f"task {self.name!r}: main_metric {self.main_metric!r} is not one of its metrics {self.metrics}")


def _glue(cfg: str, text: str, pair: str | None, names: tuple[str, ...], desc: str, *,
          metrics: tuple[str, ...] = ("accuracy",), main: str = "accuracy",
          test_split: str = "validation") -> TaskSpec:
    return TaskSpec(
        name=f"glue/{cfg}", hf_path="nyu-mll/glue", hf_config=cfg, text_column=text,
        text_pair_column=pair, label_column="label", train_split="train", test_split=test_split,
        metrics=metrics, main_metric=main, label_names=names, description=desc,
    )


_ALL: tuple[TaskSpec, ...] = (
    _glue("cola", "sentence", None, ("unacceptable", "acceptable"),
          "GLUE CoLA: grammatical acceptability (Matthews corr.)", metrics=("mcc", "accuracy"), main="mcc"),
    _glue("sst2", "sentence", None, ("negative", "positive"), "GLUE SST-2: movie-review sentiment"),
    _glue("mnli", "premise", "hypothesis", ("entailment", "neutral", "contradiction"),
          "GLUE MNLI: 3-way entailment (test = validation_matched)", test_split="validation_matched"),
    _glue("qqp", "question1", "question2", ("not_duplicate", "duplicate"), "GLUE QQP: duplicate Quora questions"),
    _glue("qnli", "question", "sentence", ("entailment", "not_entailment"),
          "GLUE QNLI: does the sentence answer the question"),
    _glue("rte", "sentence1", "sentence2", ("entailment", "not_entailment"), "GLUE RTE: textual entailment"),
    TaskSpec(
        name="banking77", hf_path="PolyAI/banking77", hf_config=None, text_column="text",
        text_pair_column=None, label_column="label", train_split="train", test_split="test",
        metrics=("accuracy", "macro_f1"), main_metric="accuracy", label_names=None,
        description="BANKING77: 77 fine-grained banking intents of customer queries",
        hf_revision="refs/convert/parquet", n_labels=77,
    ),
    TaskSpec(
        name="20newsgroups", hf_path="SetFit/20_newsgroups", hf_config=None, text_column="text",
        text_pair_column=None, label_column="label", train_split="train", test_split="test",
        metrics=("accuracy", "macro_f1"), main_metric="accuracy", label_names=None,
        description="20 Newsgroups: topic of a Usenet post (20 classes)", label_text_column="label_text",
        n_labels=20,
    ),
    TaskSpec(
        name="debian-sections", hf_path=None, hf_config=None, text_column="text",
        text_pair_column=None, label_column="label", train_split="train", test_split="test",
        metrics=("accuracy", "macro_f1"), main_metric="accuracy",
        label_names=("games", "graphics", "mail", "sound"),
        description="Debian package descriptions → archive section (bundled, offline; 4 classes)",
        local_dir=str(DEBIAN_SECTIONS_DIR),
    ),
)

TASKS: dict[str, TaskSpec] = {t.name: t for t in _ALL}

# Other spellings people type; each maps to a registry name.
_ALIASES: dict[str, str] = {
    **{cfg: f"glue/{cfg}" for cfg in ("cola", "sst2", "mnli", "qqp", "qnli", "rte")},
    "sst-2": "glue/sst2",
    "glue/sst-2": "glue/sst2",
    "20_newsgroups": "20newsgroups",
    "20ng": "20newsgroups",
    "debian_sections": "debian-sections",
    "banking-77": "banking77",
}


def available_tasks() -> list[str]:
    """Registered task names, sorted."""
    return sorted(TASKS)


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` registered as ``name`` (case-insensitive; short GLUE names accepted).

    Raises ConfigError naming the closest registered names when ``name`` is unknown.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"task must be a non-empty string, one of {available_tasks()} (got {name!r})")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in TASKS:
        return TASKS[key]
    close = difflib.get_close_matches(key, list(TASKS) + list(_ALIASES), n=3, cutoff=0.5)
    close = list(dict.fromkeys(_ALIASES.get(c, c) for c in close))
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"unknown task {name!r}{hint} Registered tasks: {available_tasks()}")

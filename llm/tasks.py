"""Named tasks (docs/design.md §8): where the data lives, its columns, its metrics.

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
debian-describe    bundled (llm/datasets/)          record → description       test
e2e                tuetschek/e2e_nlg                meaning_representation      test
                                                    → human_reference
webnlg             webnlg-challenge/web_nlg         modified_triple_sets → lex  test
                   [webnlg_challenge_2017]
squad              rajpurkar/squad [plain_text]     question, context → answers validation
squad_v2           rajpurkar/squad_v2 [squad_v2]    question, context → answers validation
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

import abc
import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from fedlora.errors import ConfigError

from .datasets import DEBIAN_DESCRIBE_DIR, DEBIAN_SECTIONS_DIR

__all__ = ["TaskSpec", "TASKS", "TASK_KINDS", "register_kind", "get_task", "available_tasks", "Task", "EvalContext",
           "slot_batches"]

#: the kinds of task: kind → its ``Task`` implementation. The implementation modules fill it (``register_kind``);
#: this module imports none of them. ``fedlora.llm.task_kinds`` imports them all and builds tasks from it.
TASK_KINDS: dict[str, type[Task]] = {}


@dataclass(frozen=True)
class TaskSpec:
    """One task's data: where it lives, its columns, its metrics (classification or generation).

    Attributes:
        name: registry name (``"glue/sst2"``).
        hf_path: HuggingFace dataset id, or None for data shipped in ``local_dir``.
        hf_config: dataset configuration (GLUE sub-task) or None.
        text_column / text_pair_column: input text column(s); the pair column is None for
            single-sentence tasks.
        label_column: class label column (ints or strings); None for generation; extractive QA: the topic
            column label-skewed partitions sort by (SQuAD's ``title``).
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
        kind: ``"classification"``, ``"generation"`` (prompt → target with a causal LM) or ``"qa"``
            (extractive question answering, SQuAD format): which :class:`Task` implementation runs it
            (``fedlora.llm.task_kinds.build_task``).
        target_column: generation: the column holding the target text (``text_column`` holds the source).
        linearise: generation: how a row's source becomes the prompt (``fedlora.llm.generation.LINEARISERS``:
            ``"text"``, the column as it is; ``"e2e"``; ``"webnlg"``).
        decoding: generation: the paper's decoding settings (``GenerationTask.DECODING`` keys), the
            defaults ``eval.decoding`` overrides key by key.
        doc_stride: qa: the overlap of a long context's windows in tokens (``data.doc_stride`` overrides;
            0: no windows).
        allow_no_answer: qa: questions may have no answer in their context (SQuAD v2.0).
    """

    name: str
    hf_path: str | None
    hf_config: str | None
    text_column: str
    text_pair_column: str | None
    label_column: str | None
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
    kind: str = "classification"
    target_column: str | None = None
    linearise: str = "text"
    decoding: tuple[tuple[str, Any], ...] = ()
    doc_stride: int = 0
    allow_no_answer: bool = False

    def __post_init__(self) -> None:
        if self.kind == "generation" and not self.target_column:
            raise ConfigError(f"task {self.name!r}: a generation task names its target_column")
        if self.kind == "qa" and not (self.text_pair_column and self.target_column):
            raise ConfigError(f"task {self.name!r}: a QA task names its context (text_pair_column) and answers "
                              f"(target_column) columns")
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

# Data-to-text generation (PF2LoRA §6.2 / App. F.3, following LoRA (Hu et al., ICLR 2022) §5.5 and its
# gpt2_beam.py command: beam 10, length penalty 0.8, no repeated 4-grams, 64 new tokens at most).
_NLG_DECODING = (("num_beams", 10), ("length_penalty", 0.8), ("no_repeat_ngram_size", 4), ("max_new_tokens", 64))
_ALL = _ALL + (
    TaskSpec(
        name="e2e", hf_path="tuetschek/e2e_nlg", hf_config=None, text_column="meaning_representation",
        text_pair_column=None, label_column=None, train_split="train", test_split="test",
        metrics=("bleu", "nist", "meteor", "rouge_l", "cider", "ter", "chrf"), main_metric="bleu", label_names=None,
        description="E2E NLG Challenge: restaurant meaning representation → text (key 'restaurant': the name)",
        hf_revision="refs/convert/parquet", kind="generation", target_column="human_reference", linearise="e2e",
        decoding=_NLG_DECODING,
    ),
    TaskSpec(
        name="webnlg", hf_path="webnlg-challenge/web_nlg", hf_config="webnlg_challenge_2017",
        text_column="modified_triple_sets", text_pair_column=None, label_column=None, train_split="train",
        test_split="test", metrics=("bleu", "nist", "meteor", "rouge_l", "cider", "ter", "chrf"), main_metric="bleu",
        label_names=None, description="WebNLG 2017: DBpedia triples → text (key 'category': the domain)",
        hf_revision="refs/convert/parquet", kind="generation", target_column="lex", linearise="webnlg",
        decoding=_NLG_DECODING,
    ),
)

# The offline data-to-text demo: a Debian package's record → its short description (bundled; real text)
_ALL = _ALL + (
    TaskSpec(
        name="debian-describe", hf_path=None, hf_config=None, text_column="record", text_pair_column=None,
        label_column=None, train_split="train", test_split="test",
        metrics=("bleu", "rouge_l", "chrf", "ter", "nist", "meteor", "cider"), main_metric="bleu", label_names=None,
        description="Debian package record → its maintainers' short description (bundled, offline; key 'section')",
        local_dir=str(DEBIAN_DESCRIBE_DIR), kind="generation", target_column="description",
        decoding=(("num_beams", 1), ("max_new_tokens", 24))),
)

# Extractive QA (PF2LoRA §6.2 / Table 2: DeBERTa on SQuAD v1.1 and v2.0, EM / F1; test = the dev sets, whose
# questions carry several gold answers). Windows of a long context overlap by 128 tokens (run_qa.py's default).
_ALL = _ALL + tuple(
    TaskSpec(
        name=name, hf_path=f"rajpurkar/{name}", hf_config=config, text_column="question", text_pair_column="context",
        label_column="title", train_split="train", test_split="validation", metrics=("exact", "f1"), main_metric="f1",
        label_names=None, description=desc, kind="qa", target_column="answers", doc_stride=128,
        allow_no_answer=name == "squad_v2")
    for name, config, desc in (
        ("squad", "plain_text", "SQuAD v1.1: the answer's span in a Wikipedia paragraph (key 'title': the article)"),
        ("squad_v2", "squad_v2", "SQuAD v2.0: v1.1 and unanswerable questions (key 'title': the article)"))
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
    "debian_describe": "debian-describe",
    "e2e_nlg": "e2e",
    "e2e-nlg": "e2e",
    "web_nlg": "webnlg",
    "web-nlg": "webnlg",
    "squad1": "squad",
    "squad_v1": "squad",
    "squad-v1.1": "squad",
    "squad2": "squad_v2",
    "squad-v2": "squad_v2",
    "squad-v2.0": "squad_v2",
}


def available_tasks() -> list[str]:
    """Registered task names, sorted."""
    return sorted(TASKS)


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` registered as ``name`` (case-insensitive; short GLUE names accepted).

    Raises ConfigError naming the closest registered names when ``name`` is unknown.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"task must be a non-empty string, one of {', '.join(available_tasks())} (got {name!r})")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in TASKS:
        return TASKS[key]
    close = difflib.get_close_matches(key, list(TASKS) + list(_ALIASES), n=3, cutoff=0.5)
    close = list(dict.fromkeys(_ALIASES.get(c, c) for c in close))
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigError(f"unknown task {name!r}{hint}; registered tasks: {', '.join(available_tasks())} (or give "
                      f"data.path for your own file, data.hf_name for a HF dataset)")


@dataclasses.dataclass
class EvalContext:
    """What a task's ``predict`` needs of the runtime: ``forward(params, batch) -> logits`` (the slot model,
    ``params`` a ``functional_call`` mapping or None), ``rows(enc, idx) -> batch`` (the encoded rows at
    ``idx``, padding trimmed, on the device), ``slots`` S, ``batch_size`` rows per slot per forward, the
    ``model`` and ``tokenizer`` (generation), the run's ``decoding`` settings."""

    forward: Any
    rows: Any
    slots: int
    batch_size: int
    model: Any = None
    tokenizer: Any = None
    decoding: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def slot_batches(row_sets: Sequence[np.ndarray], b: int):
    """Slot p's rows ``row_sets[p]`` in steps of ``b``: per step the (S·b,) row indices, slot-major, each slot
    padded to ``b`` with its first row (slots must be equal in number), and each slot's real count."""
    import torch  # here, not at the top: reading a run folder (fedlora.llm.runfolder) reads the tasks, without torch

    n_iter = max(math.ceil(len(r) / b) for r in row_sets) if any(len(r) for r in row_sets) else 0
    for it in range(n_iter):
        idx, real = [], []
        for rows in row_sets:
            part = rows[it * b:(it + 1) * b]
            real.append(len(part))
            pad = part if len(part) == b else np.concatenate(
                [part, np.full(b - len(part), rows[0] if len(rows) else 0, dtype=np.int64)])
            idx.append(torch.as_tensor(pad, dtype=torch.long))
        yield torch.cat(idx), real


class Task(abc.ABC):
    """One kind of task, the only thing the runtime knows of what it trains (docs/design.md §9, "the house";
    the model owns its loss, as in nanoGPT). Implementations: ``ClassificationTask``
    (``fedlora.llm.classification``), ``GenerationTask`` (``fedlora.llm.generation``), ``QATask``
    (``fedlora.llm.qa``).

    The runtime calls, in this order: ``load_data`` (train / test rows and the spec actually used),
    ``build_model`` (the frozen base and its tokenizer), ``encode`` (rows → padded tensors), then per
    step ``loss`` on the model's ``logits`` for S slots of rows concatenated slot-major (one loss per slot,
    the ``Objective`` contract of ``fedlora.methods``) and ``outputs`` (what H²Tune's eq. 7 compares), and
    for evaluation ``predict`` (S slots' rows in one batched pass or one batched ``generate``) and ``score``.
    ``train_rows`` maps a client's dataset rows to the rows it trains on (QA: the features of its questions).
    """

    #: the PEFT ``task_type`` of an exported adapter
    peft_task_type: str = ""
    #: the model has a classifier head that a method may train (``model.head``)
    has_head: bool = False
    #: the batch's keys that are targets, not model inputs
    label_keys: tuple[str, ...] = ("labels",)

    @property
    def not_computed(self) -> dict[str, str]:
        """Metrics of the task that could not be computed here, with the reason (e.g. METEOR without WordNet)."""
        return dict(self.__dict__.get("_not_computed", {}))

    def __init__(self, spec: TaskSpec | None) -> None:
        self.spec = spec

    # the spec's names, so run code reads ``task.name`` / ``task.main_metric`` whatever the kind
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.spec.metrics

    @property
    def main_metric(self) -> str:
        return self.spec.main_metric

    @property
    def kind(self) -> str:
        return self.spec.kind

    @abc.abstractmethod
    def load_data(self, cfg, columns: Mapping[str, str] | None) -> tuple[Any, Any]:
        """(train, test) ``TextDataset``s from the run config ``cfg``'s data section (``columns``: the
        config's column fields); sets ``self.spec`` to the spec actually used."""

    @abc.abstractmethod
    def build_model(self, mc: Mapping[str, Any], seed: int, *, model=None, tokenizer=None) -> tuple[Any, Any]:
        """(frozen base model, tokenizer) from the model section ``mc`` (a dict); ready ones given are used
        (tests), after the task checks they fit it."""

    @abc.abstractmethod
    def encode(self, dataset, tokenizer, max_length: int) -> dict[str, Any]:
        """Every row as padded tensors (n, L) with the right padding ``rows`` trims; what ``loss`` reads."""

    def collate(self, enc: Mapping[str, Any], idx, device) -> dict[str, Any]:
        """The training batch of rows ``idx`` (a 1-D index tensor) on ``device``: every tensor of ``enc`` but
        those named ``prompt_*`` (a task's own evaluation inputs), the right padding all rows share trimmed
        from the (n, L) ones."""
        batch = {k: v[idx] for k, v in enc.items() if not k.startswith("prompt_")}
        if "attention_mask" in batch:  # trim the padding every row of this batch shares
            L = int(batch["attention_mask"].sum(1).max())
            batch = {k: (v[:, :L] if v.dim() == 2 else v) for k, v in batch.items()}
        return {k: v.to(device) for k, v in batch.items()}

    def train_rows(self, enc: Mapping[str, Any], rows: np.ndarray) -> np.ndarray:
        """The rows of ``enc`` a client holding dataset rows ``rows`` trains on: the same rows, or (extractive
        QA) the features of those questions; their count is the client's weight n_k."""
        return np.asarray(rows)

    def model_output(self, out) -> Any:
        """What ``loss`` / ``outputs`` / ``predict`` read of the model's forward output (``out.logits``)."""
        return out.logits

    @abc.abstractmethod
    def loss(self, logits, batch: Mapping[str, Any], slots: int):
        """(S,) each slot's mean loss on its rows of ``batch`` (S·b rows, slot-major)."""

    @abc.abstractmethod
    def outputs(self, logits, batch: Mapping[str, Any], slots: int):
        """H²Tune's model outputs (eq. 7): (S, …, C) logits, or (logits, mask) with mask (S, …) = 1 where the
        output is scored (``fedlora.methods.h2tune``'s ``output_fn`` contract)."""

    @abc.abstractmethod
    def predict(self, ctx: EvalContext, enc: Mapping[str, Any], row_sets: Sequence[np.ndarray], params) -> list:
        """Each slot's predictions on its own rows (slot p: ``row_sets[p]`` of ``enc``), all slots at once."""

    @abc.abstractmethod
    def score(self, prediction, dataset, rows: np.ndarray) -> dict[str, float]:
        """The task's metrics (and ``loss``) of one slot's ``prediction`` on ``dataset``'s ``rows``; {} for none."""

    def restore(self, resolved: Mapping[str, Any]) -> None:
        """Take back what ``describe`` recorded (``fedlora.llm.task_kinds.task_from_resolved``)."""

    def describe(self) -> dict[str, Any]:
        """What config.json's ``resolved`` records of the task."""
        return {"task": self.name, "task_kind": self.kind, "metrics": list(self.metrics)}


def register_kind(kind: str):
    """Class decorator of a ``Task`` implementation: it runs the tasks of ``kind`` (``TASK_KINDS[kind]``). A kind
    has one implementation; registering another class under it is an error."""
    def register(cls: type[Task]) -> type[Task]:
        old = TASK_KINDS.get(kind)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"task kind {kind!r} is {old.__module__}.{old.__qualname__}'s already, not "
                             f"{cls.__module__}.{cls.__qualname__}'s")
        TASK_KINDS[kind] = cls
        return cls

    return register

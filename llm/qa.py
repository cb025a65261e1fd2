"""Extractive question answering (SQuAD v1.1 / v2.0 format) as a ``Task`` (docs/design.md §9).

PF2LoRA (Hao et al., "Personalized Federated Fine-Tuning for LLMs via Two-Level LoRA", 2025) §6.2 / Table 2
fine-tunes DeBERTa on SQuAD v1.1 and v2.0 and reports EM / F1; the pipeline is the one of HuggingFace's
``run_qa.py`` that the LoRA code it follows uses, which the paper does not restate — ours, stated here:

* **Features** (``encode``): question and context are tokenized as a pair, the context truncated; a context
  that does not fit ``model.max_length`` is cut into windows that overlap by ``data.doc_stride`` tokens
  (each window one feature, the question repeated). ``data.doc_stride: 0`` turns windows off: then a question
  with its context longer than ``model.max_length`` is refused before training, naming the row.
* **Training rows are features**: a client's training rows are the features of its questions
  (``Task.train_rows``); the label of a feature is the answer's first and last token, or the first token
  (CLS) where the window does not hold the whole answer, and for unanswerable questions (v2.0). A slot's loss
  is the mean over its features of (CE(start) + CE(end)) / 2, as ``*ForQuestionAnswering`` computes it.
  A client's weight in the average (FedAvg's n_k) is its number of features.
* **Answers** (``predict``): per question, over all its windows, the ``n_best_size`` best start and end
  tokens inside the context, spans with end ≥ start and at most ``max_answer_length`` tokens; the best
  start + end logit wins and its characters are cut from the context (offsets). v2.0: the question is
  answered "" (no answer) when the best null score (CLS start + CLS end, the minimum over windows) exceeds
  the best span's by more than ``null_threshold``. Settings: ``eval.decoding`` (``QA_DECODING``).
* **Metrics**: SQuAD's official EM and F1 (``fedlora.llm.textmetrics.squad_metrics``; several gold answers,
  the max over them; an unanswerable question is right only with the empty answer), per client and for
  the global model.

The classifier head is ``qa_outputs`` (hidden → 2), a head like a classifier's: ``model.head`` says who trains
it (its method's default, as for classification).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError
from fedlora.seeds import MODEL, seed_of

from .data import STAND_IN_WORDS, ColumnMap, Table, TextDataset, check_columns, column_texts, read_tables, subsample
from .decoding import QA_DECODING, check_qa_decoding  # noqa: F401  (QA's settings: fedlora.llm.qa's too)
from .model import load_qa_model, load_tokenizer
from .tasks import EvalContext, Task, TaskSpec, register_kind, slot_batches
from .textmetrics import squad_metrics

__all__ = ["QATask", "QA_DECODING", "check_qa_decoding", "answers_of", "best_answer"]

#: the tiny variant's window overlap (its model reads 32 tokens)
TINY_DOC_STRIDE = 8


def answers_of(cell: Any) -> tuple[list[str], list[int]]:
    """A SQuAD ``answers`` cell → (texts, character starts): ``{"text": [...], "answer_start": [...]}`` (the HF
    datasets' and our files' format) or a list of ``{"text": …, "answer_start": …}`` (the official JSON's)."""
    if isinstance(cell, Mapping):
        texts, starts = cell.get("text"), cell.get("answer_start")
    elif isinstance(cell, Sequence) and not isinstance(cell, str) and all(isinstance(a, Mapping) for a in cell):
        texts = [a.get("text") for a in cell]
        starts = [a.get("answer_start") for a in cell]
    else:
        raise ValueError("expected {'text': [...], 'answer_start': [...]} or a list of {'text', 'answer_start'}")
    texts, starts = list(texts or []), list(starts or [])
    if len(texts) != len(starts):
        raise ValueError(f"{len(texts)} answer texts but {len(starts)} answer_start values")
    for t, s in zip(texts, starts):
        if not isinstance(t, str) or isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise ValueError(f"an answer is a text and an integer start, got {t!r} at {s!r}")
    return texts, [int(s) for s in starts]


def best_answer(context: str, starts: Sequence[np.ndarray], ends: Sequence[np.ndarray],
                offsets: Sequence[np.ndarray], *, n_best_size: int, max_answer_length: int, null_threshold: float,
                allow_empty: bool) -> str:
    """One question's answer from its windows' logits (module docstring, "Answers"): ``starts[w]`` /
    ``ends[w]`` (L_w,) window w's start and end logits, ``offsets[w]`` (L_w, 2) its tokens' character spans in
    ``context`` (−1 for tokens outside the context). "" when ``allow_empty`` and the null score wins, or when no
    window holds a valid span."""
    best, best_score, null = "", -math.inf, math.inf
    for s, e, off in zip(starts, ends, offsets):
        null = min(null, float(s[0] + e[0]))
        top_s = np.argsort(-s, kind="stable")[:n_best_size]
        top_e = np.argsort(-e, kind="stable")[:n_best_size]
        for i in top_s:
            if off[i, 0] < 0:
                continue
            for j in top_e:
                if off[j, 0] < 0 or j < i or j - i + 1 > max_answer_length:
                    continue
                score = float(s[i] + e[j])
                if score > best_score:
                    best_score, best = score, context[int(off[i, 0]):int(off[j, 1])]
    if allow_empty and (best_score == -math.inf or null - best_score > null_threshold):
        return ""
    return best


@register_kind("qa")
class QATask(Task):
    """Question + context → the answer's span in the context (``*ForQuestionAnswering`` models: BERT, RoBERTa,
    DeBERTa-v2/v3, …)."""

    peft_task_type = "QUESTION_ANS"
    has_head = True
    label_keys = ("start_positions", "end_positions")

    # -------------------------------------------------------------------------------------- data
    def load_data(self, cfg, columns):
        """(train, test) TextDatasets: ``texts`` the questions, ``text_pairs`` the contexts, ``references`` each
        question's gold answers ([] for an unanswerable v2.0 question), ``answer_starts`` their character
        offsets. The answers of every row are checked against the context."""
        dc = cfg.data
        spec = self.spec
        self.decoding = check_qa_decoding(cfg.eval.decoding)
        stride = spec.doc_stride if dc.doc_stride is None else dc.doc_stride
        self.doc_stride = min(stride, TINY_DOC_STRIDE) if cfg.tiny and dc.doc_stride is None else stride
        cols = {"text": spec.text_column, "text_pair": spec.text_pair_column, "target": spec.target_column,
                "label": spec.label_column, **(columns or {})}
        if dc.labels is not None:
            raise ConfigError("data.labels: an extractive-QA task has no classes (data.label_column names the topic "
                              "column that label-skewed partitions sort by); drop data.labels")
        if cfg.tiny and dc.path is None and spec.hf_path is not None:
            tables = _stand_in_tables(spec, n_train=max(120, 40 * cfg.federation.clients), n_test=60, seed=cfg.seed)
        else:
            tr, te, _ = read_tables(spec, path=dc.path, hf_name=dc.hf_name, hf_config=dc.hf_config,
                                      train_split=dc.train_split, test_split=dc.test_split,
                                      default_test=tuple(dict.fromkeys((spec.test_split, "test", "validation"))),
                                      test_fraction=dc.test_fraction, seed=cfg.seed, label_col=None)
            tables = (tr, te)
        topic = cols.get("label")
        if topic is not None and "label" not in (columns or {}) and any(topic not in t.columns for t in tables):
            topic = cols["label"] = None  # the task's topic column, absent from these files: one class
        for t in tables:
            if topic is not None and topic not in t.columns:
                raise ConfigError(f"{t.where} has no column {topic!r} (data.label_column: the topic that label-skewed "
                                  f"partitions sort by; null for none); its columns: {list(t.columns)}")
        topics = sorted({str(v) for t in tables for v in t.columns[topic]}) if topic else ["answer"]
        train = _rows(tables[0], cols, spec, topics, max_rows=dc.max_train_samples, seed=cfg.seed, stream=11)
        test = _rows(tables[1], cols, spec, topics, max_rows=dc.max_test_samples, seed=cfg.seed, stream=12)
        return train, test

    def build_model(self, mc: Mapping[str, Any], seed: int, *, model=None, tokenizer=None):
        tok = tokenizer or load_tokenizer(mc.get("tokenizer") or mc["name"],
                                          "model.tokenizer" if mc.get("tokenizer") else "model.name")
        if not getattr(tok, "is_fast", False):
            raise ConfigError(f"model.tokenizer: an extractive-QA task needs a fast tokenizer (character offsets of "
                              f"every token); {type(tok).__name__} is not one")
        if getattr(tok, "padding_side", "right") != "right":
            raise ConfigError("model.tokenizer: an extractive-QA task reads question then context, padded on the "
                              f"right; this tokenizer pads on the {tok.padding_side}")
        torch.manual_seed(seed_of(seed, MODEL))  # the new head's init: part of the run's seed
        model = model or load_qa_model(mc["name"], from_config=mc.get("from_config"), dtype=mc["dtype"],
                                       pad_token_id=tok.pad_token_id)
        qa = getattr(model, "qa_outputs", None)
        if not isinstance(qa, torch.nn.Linear) or qa.out_features != 2:
            raise ConfigError(f"model.name: {mc['name']!r} is a {type(model).__name__}, not a model for extractive "
                              f"QA (a *ForQuestionAnswering with a qa_outputs head of 2 outputs)")
        return model, tok

    def encode(self, dataset, tokenizer, max_length: int) -> dict[str, torch.Tensor]:
        """The features (module docstring): ``input_ids`` / ``attention_mask`` (/ ``token_type_ids``) (n_f, L),
        ``start_positions`` / ``end_positions`` (n_f,); for evaluation ``qa_example`` (n_f,) the question of
        every feature, ``qa_offsets`` (n_f, L, 2) its tokens' character spans in the context (−1 outside it) and
        ``qa_contexts`` the n contexts (a list of str)."""
        self.check_fits(dataset, tokenizer, max_length)
        questions = [q.lstrip() for q in dataset.texts]  # run_qa.py: leading spaces only waste tokens
        contexts = list(dataset.text_pairs)
        enc = tokenizer(questions, contexts, truncation="only_second", max_length=max_length,
                        stride=self.doc_stride, return_overflowing_tokens=self.doc_stride > 0,
                        return_offsets_mapping=True, padding="max_length")
        n_f = len(enc["input_ids"])
        example = list(enc["overflow_to_sample_mapping"]) if "overflow_to_sample_mapping" in enc else list(range(n_f))
        offsets = torch.full((n_f, max_length, 2), -1, dtype=torch.int32)  # characters: int32 halves SQuAD v2.0's 0.8 GB
        start_pos = torch.zeros(n_f, dtype=torch.long)
        end_pos = torch.zeros(n_f, dtype=torch.long)
        for f in range(n_f):
            seq = enc.sequence_ids(f)
            ctx_tokens = [t for t, sid in enumerate(seq) if sid == 1]
            for t in ctx_tokens:
                offsets[f, t] = torch.tensor(enc["offset_mapping"][f][t])
            ex = example[f]
            texts, starts = dataset.references[ex], dataset.answer_starts[ex]
            if not texts or not ctx_tokens:
                continue  # unanswerable: the CLS token (index 0)
            a0 = starts[0]
            a1 = a0 + len(texts[0])
            c0, c1 = int(offsets[f, ctx_tokens[0], 0]), int(offsets[f, ctx_tokens[-1], 1])
            if a0 < c0 or a1 > c1:
                continue  # this window does not hold the whole answer: CLS
            s = next(t for t in ctx_tokens if offsets[f, t, 1] > a0)
            e = next(t for t in reversed(ctx_tokens) if offsets[f, t, 0] < a1)
            start_pos[f], end_pos[f] = s, e
        out = {"input_ids": torch.tensor(enc["input_ids"], dtype=torch.long),
               "attention_mask": torch.tensor(enc["attention_mask"], dtype=torch.long)}
        if "token_type_ids" in enc:
            out["token_type_ids"] = torch.tensor(enc["token_type_ids"], dtype=torch.long)
        out.update(start_positions=start_pos, end_positions=end_pos,
                   qa_example=torch.tensor(example, dtype=torch.long), qa_offsets=offsets, qa_contexts=contexts)
        return out

    def check_fits(self, dataset, tokenizer, max_length: int) -> None:
        """One line before any training (``encode`` calls it, and a dry run, ``FederatedRun.check``): an empty
        dataset, a question that leaves no room for its context's window, a window overlap as long as the window,
        or (``doc_stride: 0``) a context that does not fit."""
        if len(dataset) == 0:
            raise ConfigError("encode: the dataset is empty")
        questions = [q.lstrip() for q in dataset.texts]
        contexts = list(dataset.text_pairs)
        specials = tokenizer.num_special_tokens_to_add(pair=True)
        q_len = [len(x) for x in tokenizer(questions, add_special_tokens=False)["input_ids"]]
        for i, q in enumerate(q_len):
            room = max_length - specials - q
            if room < 1:
                raise ConfigError(f"model.max_length: question {i} takes {q} tokens, which with {specials} special "
                                  f"tokens leaves no room for its context in {max_length}; raise model.max_length")
            if self.doc_stride and self.doc_stride >= room:
                raise ConfigError(f"data.doc_stride: {self.doc_stride} tokens of overlap, but question {i} leaves "
                                  f"only {room} tokens of model.max_length {max_length} for each context window; "
                                  f"the overlap must be shorter than the window: lower data.doc_stride or raise "
                                  f"model.max_length")
        if self.doc_stride == 0:
            c_len = [len(x) for x in tokenizer(contexts, add_special_tokens=False)["input_ids"]]
            for i, (q, c) in enumerate(zip(q_len, c_len)):
                if q + c + specials > max_length:
                    raise ConfigError(f"data.doc_stride: 0 (no sliding window), but question {i} with its context "
                                      f"takes {q + c + specials} tokens, more than model.max_length {max_length}; "
                                      f"set data.doc_stride (e.g. 128) to read long contexts in overlapping windows")

    def collate(self, enc: Mapping[str, Any], idx, device) -> dict[str, Any]:
        """The features ``idx``'s model inputs and labels (``qa_*`` stay: evaluation's own)."""
        return super().collate({k: v for k, v in enc.items() if not k.startswith("qa_")}, idx, device)

    def train_rows(self, enc: Mapping[str, Any], rows: np.ndarray) -> np.ndarray:
        """The features of the questions ``rows``, sorted."""
        return np.flatnonzero(np.isin(enc["qa_example"].numpy(), np.asarray(rows)))

    def model_output(self, out) -> torch.Tensor:
        """(n, L, 2): start and end logits stacked."""
        return torch.stack([out.start_logits, out.end_logits], dim=-1)

    # -------------------------------------------------------------------------------------- loss
    @staticmethod
    def _feature_losses(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        return (F.cross_entropy(logits[..., 0], batch["start_positions"], reduction="none")
                + F.cross_entropy(logits[..., 1], batch["end_positions"], reduction="none")) / 2

    def example_losses(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(S·b,) each feature's (CE(start) + CE(end)) / 2: one example's loss for sample-level DP-SGD (a feature is
        the unit a client's rows are drawn in, ``train_rows``)."""
        return self._feature_losses(logits, batch)

    def loss(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], slots: int) -> torch.Tensor:
        """(S,): each slot's mean over its features of (CE(start) + CE(end)) / 2."""
        return self._feature_losses(logits, batch).view(slots, -1).mean(1)

    def outputs(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], slots: int) -> torch.Tensor:
        """(S, 2·b, L): per feature the start and the end distributions over its tokens (H²Tune's eq. 7)."""
        return logits.transpose(-1, -2).reshape(slots, -1, logits.shape[1])

    # -------------------------------------------------------------------------------------- answers
    @torch.no_grad()
    def predict(self, ctx: EvalContext, enc: Mapping[str, torch.Tensor], row_sets: Sequence[np.ndarray],
                params) -> list[tuple[list[str], np.ndarray]]:
        """Every slot's answers to its own questions (slot p: ``row_sets[p]``, in that order) and each
        question's mean feature loss, the S slots in one batched forward per step."""
        b, S = ctx.batch_size, ctx.slots
        assert S == len(row_sets), "bind as many slots as row sets"
        d = check_qa_decoding({**self.decoding, **ctx.decoding})
        feats = [self.train_rows(enc, rows) for rows in row_sets]
        logit_of: list[dict[int, np.ndarray]] = [{} for _ in range(S)]
        loss_of: list[dict[int, float]] = [{} for _ in range(S)]
        for idx, real in slot_batches(feats, b):
            batch = ctx.rows(enc, idx)
            logits = ctx.forward(params, batch).float()
            ce = self._feature_losses(logits, batch).view(S, b).cpu().numpy()
            lg = logits.view(S, b, *logits.shape[1:]).cpu().numpy()
            for p in range(S):
                for j in range(real[p]):
                    f = int(idx[p * b + j])
                    logit_of[p][f] = lg[p, j]
                    loss_of[p][f] = float(ce[p, j])
        examples = enc["qa_example"].numpy()
        out = []
        for p in range(S):
            by_example: dict[int, list[int]] = {}
            for f in feats[p]:
                by_example.setdefault(int(examples[f]), []).append(int(f))
            answers, losses = [], []
            for ex in np.asarray(row_sets[p]).tolist():
                fs = by_example.get(int(ex), [])
                L = [logit_of[p][f].shape[0] for f in fs]
                answers.append(best_answer(
                    enc["qa_contexts"][ex], [logit_of[p][f][:, 0] for f in fs], [logit_of[p][f][:, 1] for f in fs],
                    [enc["qa_offsets"][f, :n].numpy() for f, n in zip(fs, L)],
                    allow_empty=self.spec.allow_no_answer, **d))
                losses.append(float(np.mean([loss_of[p][f] for f in fs])) if fs else float("nan"))
            out.append((answers, np.asarray(losses)))
        return out

    def score(self, prediction: tuple[list[str], np.ndarray], dataset, rows: np.ndarray) -> dict[str, float]:
        """SQuAD's ``exact`` and ``f1`` (0–100) of one slot's answers against every gold answer of their
        questions, and ``loss`` (mean feature loss per question); {} for no rows."""
        answers, losses = prediction
        if len(rows) == 0:
            return {}
        golds = [dataset.references[i] for i in np.asarray(rows).tolist()]
        m = squad_metrics(answers, golds)
        out = {k: float(m[k]) for k in self.metrics}
        out["loss"] = float(np.mean(losses))
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "decoding": dict(self.decoding), "doc_stride": self.doc_stride}

    def restore(self, resolved: Mapping[str, Any]) -> None:
        self.decoding = check_qa_decoding(resolved.get("decoding", {}))
        self.doc_stride = int(resolved.get("doc_stride", 0))


# ---------------------------------------------------------------------------------------------- rows
def _rows(table, cols: Mapping[str, str | None], spec: TaskSpec, topics: Sequence[str], *, max_rows: int | None,
          seed: int, stream: int):
    """A TextDataset of questions (``texts``), contexts (``text_pairs``), gold answers (``references``) and
    their character starts (``answer_starts``) from a table (``fedlora.llm.data.Table``), every answer
    checked against its context; labels are the rows' topics (``cols["label"]``, e.g. SQuAD's ``title``) as
    ids into ``topics`` — what label-skewed partitions (similarity, Dirichlet) sort by — or all 0."""
    cm = ColumnMap(text=cols["text"], text_pair=cols.get("text_pair"), label=None,
                   client_key=cols.get("client_key"), target=cols.get("target"))
    if cm.text_pair is None or cm.target is None:
        raise ConfigError("data.text_pair_column / data.target_column: an extractive-QA task reads a question, a "
                          "context and the answers (SQuAD: question, context, answers)")
    check_columns(table, cm)
    questions = column_texts(table, cm.text, "question")
    contexts = column_texts(table, cm.text_pair, "context")
    references, starts = [], []
    for i, (ctx, cell) in enumerate(zip(contexts, table.columns[cm.target])):
        where = f"{table.where}: {cm.target!r} at {table.locate(i)}"
        try:
            texts, st = answers_of(cell)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        for t, s in zip(texts, st):
            if not t.strip() or ctx[s:s + len(t)] != t:
                raise ConfigError(f"{where}: the answer {t!r} is not the context's text at character {s} "
                                  f"({ctx[s:s + len(t)]!r}); answer_start must point at the answer")
        if not texts and not spec.allow_no_answer:
            raise ConfigError(f"{where}: no answer; every question of {spec.name!r} (SQuAD v1.1) has one — use the "
                              f"task squad_v2 for data with unanswerable questions")
        references.append(texts)
        starts.append(st)
    keys = None if cm.client_key is None else [str(v) for v in table.columns[cm.client_key]]
    topic = cols.get("label")
    ids = {t: i for i, t in enumerate(topics)}
    labels = [ids[str(v)] for v in table.columns[topic]] if topic else [0] * len(questions)
    ds = TextDataset(questions, contexts, np.asarray(labels, dtype=np.int64), keys, list(topics),
                     references=references, answer_starts=starts)
    idx = subsample(len(ds), max_rows, seed, stream, "max_train_samples" if stream == 11 else "max_test_samples")
    return ds if idx is None else ds.subset(idx)


_STAND_IN_ATTRS = ("colour", "size", "home", "food", "friend", "tool")


def _stand_in_tables(spec: TaskSpec, *, n_train: int, n_test: int, seed: int):
    """The tiny variant's data for a Hub QA task: short contexts of facts "the A of N is V ." about a name N from
    the stand-in word list, a question "what is the A of N ?" whose answer is V (learnable, not the task's data);
    with ``allow_no_answer`` a third of the questions ask for an attribute the context does not hold."""
    rng = np.random.default_rng(seed)
    W = len(STAND_IN_WORDS)

    def table(n: int, where: str):
        q, c, a, keys = [], [], [], []
        for _ in range(n):
            name = STAND_IN_WORDS[int(rng.integers(0, 12))]  # 12 names: the key (title) recurs
            attrs = [_STAND_IN_ATTRS[j] for j in rng.choice(len(_STAND_IN_ATTRS), 3, replace=False)]
            vals = [STAND_IN_WORDS[int(rng.integers(12, W))] for _ in attrs]
            ctx = " ".join(f"the {x} of {name} is {v} ." for x, v in zip(attrs, vals))
            if spec.allow_no_answer and rng.random() < 1 / 3:
                missing = next(x for x in _STAND_IN_ATTRS if x not in attrs)
                q.append(f"what is the {missing} of {name} ?")
                a.append({"text": [], "answer_start": []})
            else:
                k = int(rng.integers(0, 3))
                start = ctx.index(f"the {attrs[k]} of {name} is ") + len(f"the {attrs[k]} of {name} is ")
                q.append(f"what is the {attrs[k]} of {name} ?")
                a.append({"text": [vals[k]], "answer_start": [start]})
            c.append(ctx)
            keys.append(name)
        return Table({spec.text_column: q, spec.text_pair_column: c, spec.target_column: a, "title": keys}, where)

    return table(n_train, f"stand-in {spec.name} train"), table(n_test, f"stand-in {spec.name} test")

"""Data-to-text generation with a causal LM as a ``Task`` (docs/design.md §9): E2E, WebNLG, any prompt → target
file or Hub dataset.

Training (PF2LoRA §6.2 / App. F.3, which follows LoRA (Hu et al., ICLR 2022) §5.5): a row is its prompt, one
separator token (the tokenizer's EOS, or [SEP] where a vocabulary has no EOS), the target and an EOS; the
loss is the cross-entropy of the target tokens and the closing EOS only (the prompt's labels are -100). A
slot's loss is the mean over all its target tokens.

Evaluation: every client of a pass decodes in ONE ``model.generate`` call on the one base model — the
prompts of the S slots are stacked slot-major, and since ``generate`` expands each row to its beams in place
(row i's beams stay contiguous), every forward of the decode, KV cache included, keeps slot p's rows in
slot p's adapters (``fedlora.llm.inject.SlotLoRALinear``). Prompts are left-padded, as decoder-only models
need for batched generation. Decoding follows the task's paper (``TaskSpec.decoding``), overridable by
``eval.decoding``. Generated texts are scored against every reference of their prompt
(``fedlora.llm.textmetrics``).

Linearisations (how a structured input becomes the prompt; the papers leave the format to LoRA's code —
ours is documented here and in docs/tutorials/generation.md):

* ``e2e``: the meaning representation ``name[The Vaults], eatType[pub]`` → ``name : The Vaults | eatType : pub``;
* ``webnlg``: the modified triples ``s | p | o`` → ``s : p : o`` joined by `` | ``;
* ``text``: the source column as it is.
"""
from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError
from fedlora.seeds import MODEL, seed_of

from .data import STAND_IN_WORDS, ColumnMap, Table, TextDataset, check_columns, read_tables, subsample
from .decoding import DECODING, check_decoding  # noqa: F401  (generation's settings: fedlora.llm.generation's too)
from .model import TINY_NEW_TOKENS, TINY_NUM_BEAMS, load_causal_lm, load_tokenizer
from .tasks import EvalContext, Task, TaskSpec, register_kind, slot_batches
from .textmetrics import generation_metrics

__all__ = ["GenerationTask", "DECODING", "LINEARISERS", "linearise_e2e", "linearise_webnlg", "check_decoding",
           "generate_slots"]

_E2E_PAIR = re.compile(r"\s*([^\[\],]+?)\s*\[([^\]]*)\]\s*,?")


def linearise_e2e(mr: str) -> str:
    """E2E's meaning representation as a prompt: ``name[The Vaults], eatType[pub]`` → ``name : The Vaults |
    eatType : pub`` (attribute order kept)."""
    pairs = _E2E_PAIR.findall(mr)
    if not pairs:
        raise ValueError(f"not an E2E meaning representation (attr[value], …): {mr[:80]!r}")
    return " | ".join(f"{k} : {v}" for k, v in pairs)


def e2e_restaurant(mr: str) -> str:
    """The ``name[...]`` value of an E2E meaning representation (PF2LoRA partitions clients by restaurant)."""
    for k, v in _E2E_PAIR.findall(mr):
        if k == "name":
            return v
    return ""


def _triples(value: Any) -> list[str]:
    """WebNLG's ``modified_triple_sets`` (HF: ``{"mtriple_set": [[triple, …]]}``; or a list of sets, or a
    list of triples, or one string) → the triples of its first set."""
    if isinstance(value, Mapping):
        value = value.get("mtriple_set", value.get("otriple_set"))
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and value and not isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, Sequence) or not value or not all(isinstance(t, str) for t in value):
        raise ValueError(f"not a WebNLG triple set: {str(value)[:80]!r}")
    return list(value)


def linearise_webnlg(value: Any) -> str:
    """WebNLG's triples as a prompt: ``Aarhus | leader | Jacob_Bundsgaard`` → ``Aarhus : leader :
    Jacob Bundsgaard``, triples joined by `` | `` (underscores of DBpedia names read as spaces)."""
    return " | ".join(" : ".join(p.strip().replace("_", " ") for p in t.split("|")) for t in _triples(value))


def _texts_of(value: Any) -> list[str]:
    """A target cell → its texts: a string; WebNLG's ``lex`` (``{"text": [...]}`` or a list of ``{"text": …}``);
    a list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        value = value.get("text", [])
    if isinstance(value, Sequence):
        out = [v.get("text") if isinstance(v, Mapping) else v for v in value]
        return [v for v in out if isinstance(v, str) and v.strip()]
    return []


LINEARISERS = {"text": lambda v: v if isinstance(v, str) else "", "e2e": linearise_e2e, "webnlg": linearise_webnlg}


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if eos is None:
        raise ConfigError("a generation task needs a tokenizer with an EOS (or SEP) token")
    return int(eos)


@contextlib.contextmanager
def _with_params(model, params: Mapping[str, torch.Tensor] | None):
    """The model with ``params`` in place of its own tensors of those names (a personalised model,
    ``Method.personalised_params``) for a call that is not one forward (``generate``); nothing is kept."""
    if not params:
        yield model
        return
    # what torch.func.functional_call uses: a private torch API, imported where it is used
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(model, dict(params), strict=False):
        yield model


@torch.no_grad()
def generate_slots(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, decoding: Mapping[str, Any],
                   params: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Decode S·b left-padded prompts (slot-major: slot p's adapters generate for rows p·b … p·b + b − 1)
    in ONE ``generate`` call; the generated texts (special tokens dropped), one per prompt."""
    d = check_decoding(decoding)
    eos = _eos_id(tokenizer)
    lead = int((prompt_mask.sum(0) == 0).sum())  # columns every row pads (left padding): drop them
    ids, mask = prompt_ids[:, lead:], prompt_mask[:, lead:]
    with _with_params(model, params):
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=d["num_beams"],
                             length_penalty=d["length_penalty"], no_repeat_ngram_size=d["no_repeat_ngram_size"],
                             max_new_tokens=d["max_new_tokens"], eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
                             early_stopping=True if d["num_beams"] > 1 else False)
    new = out[:, ids.shape[1]:].tolist()
    texts = []
    for row in new:
        cut = row.index(eos) if eos in row else len(row)
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return texts


@register_kind("generation")
class GenerationTask(Task):
    """Prompt → target text with a causal LM (GPT-2 ``Conv1D`` and LLaMA-type ``Linear`` targets)."""

    peft_task_type = "CAUSAL_LM"
    has_head = False

    def load_data(self, cfg, columns):
        """(train, test) TextDatasets: ``texts`` the prompts, ``targets`` one target per training row (a prompt
        with several references gives one row per reference), the test set one row per distinct prompt with
        every reference in ``references``. Labels are one class (generation has none; label-skewed partitions
        are refused by ``split_clients``'s checks, key partitions work)."""
        dc = cfg.data
        # the tiny variant: new tokens must fit the tiny model's positions beside the prompt, and at most
        # TINY_NUM_BEAMS beams (a check that the config runs; eval.decoding still overrides both)
        given = {**DECODING, **dict(self.spec.decoding if self.spec else ())}
        tiny = {"max_new_tokens": TINY_NEW_TOKENS, "num_beams": min(given["num_beams"], TINY_NUM_BEAMS)} if cfg.tiny else {}
        self.decoding = check_decoding({**given, **tiny, **cfg.eval.decoding})
        if dc.doc_stride is not None:
            raise ConfigError("data.doc_stride: windows of a context are for extractive QA; a generation task has none")
        spec = self.spec
        base = {"text": spec.text_column, "target": spec.target_column, "label": None} if spec else \
            {"text": "text", "target": dc.target_column, "label": None}
        cols = {**base, **{k: v for k, v in (columns or {}).items() if k != "label"}}
        if not cols.get("target"):
            raise ConfigError("data.target_column: a generation task needs the column holding the target text")
        if dc.labels is not None or dc.label_column is not None:
            raise ConfigError("data.labels / data.label_column: a generation task has no labels; drop them")
        lin = spec.linearise if spec else "text"
        if cfg.tiny and dc.path is None and spec is not None and spec.hf_path is not None:
            tables = _stand_in_tables(spec, n_train=max(120, 40 * cfg.federation.clients), n_test=60, seed=cfg.seed)
            source = None
        else:
            tr, te, source = read_tables(spec, path=dc.path, hf_name=dc.hf_name, hf_config=dc.hf_config,
                                           train_split=dc.train_split,
                                           test_split=dc.test_split,
                                           default_test=tuple(dict.fromkeys(((spec.test_split,) if spec else ())
                                                                            + ("test", "validation"))),
                                           test_fraction=dc.test_fraction, seed=cfg.seed, label_col=None)
            tables = (tr, te)
        if spec is None:
            spec = TaskSpec(name=source, hf_path=dc.hf_name, hf_config=dc.hf_config if dc.hf_name else None,
                            text_column=cols["text"], text_pair_column=None, label_column=None,
                            train_split=dc.train_split or "train", test_split=dc.test_split or "test",
                            metrics=("bleu", "rouge_l", "chrf", "ter", "nist", "meteor", "cider"), main_metric="bleu",
                            label_names=None, description=f"text generation from {source}", kind="generation",
                            target_column=cols["target"])
        self.spec = spec
        train = _rows(tables[0], cols, lin, per_reference=True, max_rows=dc.max_train_samples, seed=cfg.seed, stream=11)
        test = _rows(tables[1], cols, lin, per_reference=False, max_rows=dc.max_test_samples, seed=cfg.seed, stream=12)
        return train, test

    def build_model(self, mc: Mapping[str, Any], seed: int, *, model=None, tokenizer=None):
        tok = tokenizer or load_tokenizer(mc.get("tokenizer") or mc["name"],
                                          "model.tokenizer" if mc.get("tokenizer") else "model.name")
        eos = _eos_id(tok)
        if tok.pad_token_id is None:
            tok.pad_token = tok.convert_ids_to_tokens(eos)
        torch.manual_seed(seed_of(seed, MODEL))  # a random model's init: part of the run's seed
        model = model or load_causal_lm(mc["name"], from_config=mc.get("from_config"), dtype=mc["dtype"],
                                        pad_token_id=tok.pad_token_id, eos_token_id=eos)
        if not hasattr(model, "generate") or getattr(model, "can_generate", lambda: False)() is False:
            raise ConfigError(f"model.name: {mc['name']!r} is a {type(model).__name__}, not a causal language model; "
                              f"a generation task needs one (GPT-2, LLaMA, …)")
        n = getattr(model.config, "max_position_embeddings", None)
        need = int(mc["max_length"]) + self.decoding["max_new_tokens"]
        if isinstance(n, int) and not isinstance(n, bool) and need > n:
            raise ConfigError(f"eval.decoding.max_new_tokens: model.max_length {mc['max_length']} + max_new_tokens "
                              f"{self.decoding['max_new_tokens']} = {need} is more than the model's {n} positions; "
                              f"lower one of them")
        self._tok = tok
        return model, tok

    def encode(self, dataset, tokenizer, max_length: int) -> dict[str, torch.Tensor]:
        """``input_ids`` / ``attention_mask`` / ``labels`` (n, L), right-padded: prompt, separator, target, EOS,
        labels −100 but on the target and the EOS; ``prompt_ids`` / ``prompt_mask`` (n, Lp), left-padded:
        prompt and separator, what ``generate`` continues. The prompt keeps at most ``max_length`` − 2 tokens
        (then at least one target token and the EOS are trained)."""
        eos = _eos_id(tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if len(dataset) == 0:
            raise ConfigError("encode: the dataset is empty")
        prompts = tokenizer(list(dataset.texts), add_special_tokens=False)["input_ids"]
        targets = tokenizer(list(dataset.targets), add_special_tokens=False)["input_ids"]
        rows, labels, heads = [], [], []
        for p, t in zip(prompts, targets):
            p = p[:max_length - 2] + [eos]
            ids = (p + t + [eos])[:max_length]
            rows.append(ids)
            labels.append(([-100] * len(p) + t + [eos])[:max_length])
            heads.append(p)
        L, Lp = max(map(len, rows)), max(map(len, heads))
        n = len(rows)
        out = {"input_ids": torch.full((n, L), pad, dtype=torch.long), "attention_mask": torch.zeros(n, L, dtype=torch.long),
               "labels": torch.full((n, L), -100, dtype=torch.long),
               "prompt_ids": torch.full((n, Lp), pad, dtype=torch.long), "prompt_mask": torch.zeros(n, Lp, dtype=torch.long)}
        for i, (ids, lab, head) in enumerate(zip(rows, labels, heads)):
            out["input_ids"][i, :len(ids)] = torch.tensor(ids)
            out["attention_mask"][i, :len(ids)] = 1
            out["labels"][i, :len(lab)] = torch.tensor(lab)
            out["prompt_ids"][i, Lp - len(head):] = torch.tensor(head)
            out["prompt_mask"][i, Lp - len(head):] = 1
        return out

    @staticmethod
    def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token cross-entropy (rows, L − 1), 0 where nothing is scored, and its mask (the scored positions).

        Only the scored positions' logits are gathered and scored: the prompt and the padding (label −100) are most
        of a row, and reshaping every shifted position's logits copied a (rows·(L − 1), V) tensor, the largest of an
        evaluation. Each position's value is the same cross-entropy of its own logits as before."""
        logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        y = labels[:, 1:]
        mask = y != -100
        ce = logits.new_zeros(y.shape)
        ce[mask] = F.cross_entropy(logits[:, :-1][mask], y[mask], reduction="none")
        return ce, mask

    def example_losses(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(S·b,) each row's mean cross-entropy over its own target tokens (0 for a row without any): one example's
        loss for sample-level DP-SGD, which sums a slot's real rows (``fedlora.llm.slots``)."""
        ce, mask = self._token_losses(logits, batch["labels"])
        return ce.sum(1) / mask.sum(1).clamp_min(1)

    def loss(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], slots: int) -> torch.Tensor:
        """(S,): each slot's mean cross-entropy over all its target tokens."""
        ce, mask = self._token_losses(logits, batch["labels"])
        return ce.view(slots, -1).sum(1) / mask.view(slots, -1).sum(1).clamp_min(1)

    def outputs(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], slots: int):
        """(logits (S, b·(L−1), V), mask (S, b·(L−1))): the next-token distributions at the target positions."""
        lg = logits[:, :-1]
        mask = (batch["labels"][:, 1:] != -100).to(lg.dtype)
        return lg.reshape(slots, -1, lg.shape[-1]), mask.reshape(slots, -1)

    @torch.no_grad()
    def predict(self, ctx: EvalContext, enc: Mapping[str, torch.Tensor], row_sets: Sequence[np.ndarray],
                params) -> list[tuple[list[str], np.ndarray]]:
        """Every slot's generated texts and per-row mean target-token loss on its own rows, the S slots
        decoding together (``generate_slots``)."""
        b, S = ctx.batch_size, ctx.slots
        assert S == len(row_sets), "bind as many slots as row sets"
        decoding = check_decoding({**self.decoding, **ctx.decoding})
        texts: list[list[str]] = [[] for _ in range(S)]
        losses: list[list[np.ndarray]] = [[] for _ in range(S)]
        device = next(ctx.model.parameters()).device
        for idx, real in slot_batches(row_sets, b):
            batch = ctx.rows(enc, idx)
            ce, mask = self._token_losses(ctx.forward(params, batch), batch["labels"])
            per_row = (ce.sum(1) / mask.sum(1).clamp_min(1)).view(S, b).cpu().numpy()
            gen = generate_slots(ctx.model, ctx.tokenizer, enc["prompt_ids"][idx].to(device),
                                 enc["prompt_mask"][idx].to(device), decoding, params)
            for p in range(S):
                texts[p].extend(gen[p * b:p * b + real[p]])
                losses[p].append(per_row[p, :real[p]])
        return [(texts[p], np.concatenate(losses[p]) if losses[p] else np.zeros(0)) for p in range(S)]

    def score(self, prediction: tuple[list[str], np.ndarray], dataset, rows: np.ndarray) -> dict[str, float]:
        """The task's text metrics of the generated texts against every reference of their prompts
        (``fedlora.llm.textmetrics``; one that cannot be computed here is left out, ``describe`` says why),
        and ``loss`` (mean target-token cross-entropy per row); {} for no rows."""
        texts, losses = prediction
        if len(rows) == 0:
            return {}
        refs = [dataset.references[i] for i in np.asarray(rows).tolist()]
        scores, why = generation_metrics(texts, refs, names=self.metrics)
        self._not_computed = {**self.not_computed, **why}
        out = {k: float(v) for k, v in scores.items() if v is not None}
        out["loss"] = float(np.mean(losses))
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "decoding": dict(self.decoding), "linearise": self.spec.linearise}

    def restore(self, resolved: Mapping[str, Any]) -> None:
        self.decoding = check_decoding(resolved.get("decoding", {}))


# ---------------------------------------------------------------------------------------------- rows
def _rows(table, cols: Mapping[str, str | None], lin: str, *, per_reference: bool, max_rows: int | None,
          seed: int, stream: int):
    """A TextDataset of prompts (``texts``), targets and references from a table (``fedlora.llm.data.Table``)."""
    cm = ColumnMap(text=cols["text"], label=None, client_key=cols.get("client_key"), target=cols["target"])
    if lin == "e2e" and cm.text in table.columns and "restaurant" not in table.columns:
        table.columns["restaurant"] = [e2e_restaurant(v) if isinstance(v, str) else "" for v in table.columns[cm.text]]
    check_columns(table, cm)
    f = LINEARISERS[lin]
    groups: "OrderedDict[str, tuple[list[str], str | None]]" = OrderedDict()
    for i, (src, tgt) in enumerate(zip(table.columns[cm.text], table.columns[cm.target])):
        try:
            prompt = f(src)
        except ValueError as e:
            raise ConfigError(f"{table.where}: {cm.text!r} at {table.locate(i)}: {e}") from None
        if not prompt.strip():
            raise ConfigError(f"{table.where}: source column {cm.text!r} is empty at {table.locate(i)}; every row "
                              f"needs a source text")
        refs = _texts_of(tgt)
        if not refs:
            raise ConfigError(f"{table.where}: target column {cm.target!r} has no text at {table.locate(i)}")
        key = None if cm.client_key is None else str(table.columns[cm.client_key][i])
        entry = groups.setdefault(prompt, ([], key))
        entry[0].extend(r for r in refs if r not in entry[0])
    texts, targets, references, keys = [], [], [], []
    for prompt, (refs, key) in groups.items():
        for r in (refs if per_reference else refs[:1]):
            texts.append(prompt)
            targets.append(r)
            references.append(list(refs))
            keys.append(key)
    ds = TextDataset(texts, None, np.zeros(len(texts), dtype=np.int64), keys if cm.client_key else None, ["text"],
                     targets=targets, references=references)
    idx = subsample(len(ds), max_rows, seed, stream, "max_train_samples" if stream == 11 else "max_test_samples")
    return ds if idx is None else ds.subset(idx)


_STAND_IN_ATTRS = ("name", "food", "area", "price", "rating", "family")


def _stand_in_tables(spec: TaskSpec, *, n_train: int, n_test: int, seed: int):
    """The tiny variant's data for a Hub generation task: records of 2–4 attributes from the stand-in word
    list, in the task's own source format (so its lineariser runs), whose target says the values in order —
    learnable, not the task's data."""
    rng = np.random.default_rng(seed)
    W = len(STAND_IN_WORDS)

    def table(n: int, where: str):
        src, tgt, keys = [], [], []
        for _ in range(n):
            k = int(rng.integers(1, 4))  # the name, then 1–3 more attributes
            attrs = ["name"] + [_STAND_IN_ATTRS[1:][j] for j in sorted(rng.choice(len(_STAND_IN_ATTRS) - 1, k,
                                                                                   replace=False))]
            vals = [STAND_IN_WORDS[int(rng.integers(0, 12))]] + [STAND_IN_WORDS[int(rng.integers(0, W))]
                                                                   for _ in attrs[1:]]  # 12 names: keys recur
            if spec.linearise == "webnlg":
                src.append({"mtriple_set": [[f"{vals[0]} | {a} | {v}" for a, v in zip(attrs[1:], vals[1:])] or
                                            [f"{vals[0]} | is | {vals[0]}"]]})
                tgt.append({"text": [" ".join(vals) + " ."]})
            elif spec.linearise == "e2e":
                src.append(", ".join(f"{a}[{v}]" for a, v in zip(attrs, vals)))
                tgt.append(" ".join(vals) + " .")
            else:
                src.append(" ".join(vals))
                tgt.append(" ".join(vals) + " .")
            keys.append(vals[0])
        cols = {spec.text_column: src, spec.target_column: tgt, "category": keys}
        return Table(cols, where)

    return table(n_train, f"stand-in {spec.name} train"), table(n_test, f"stand-in {spec.name} test")

"""Sequence classification as a ``Task`` (docs/design.md §9): GLUE, BANKING77, 20 Newsgroups, the bundled
debian-sections, any labelled file or Hub dataset.

The model is ``AutoModelForSequenceClassification`` with a ``num_labels`` head (frozen, or trained per
``model.head``); a slot's loss is the mean cross-entropy over its rows; predictions are the argmax class;
scores are ``fedlora.llm.metrics.compute_metrics`` of the task's metrics plus the mean loss.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError

from .data import encode, load_text_data, stand_in_data
from .metrics import compute_metrics
from .model import load_base
from .tasks import EvalContext, Task, register_kind, slot_batches

__all__ = ["ClassificationTask"]


@register_kind("classification")
class ClassificationTask(Task):
    """Text (or text-pair) → one of C classes."""

    peft_task_type = "SEQ_CLS"
    has_head = True

    def load_data(self, cfg, columns):
        """(train, test) TextDatasets from the config's data section; the spec becomes the one actually
        used (label names filled in; a ``file:…`` / ``hf:…`` spec for sources without a task). With
        ``tiny: true`` a Hub task is replaced by generated stand-in rows of its shape."""
        dc, fc = cfg.data, cfg.federation
        if cfg.tiny and dc.path is None and self.spec is not None and self.spec.hf_path is not None:
            # enough rows that the config's own split (clients, Dirichlet α) can be drawn: 40 per client
            n = max(120, 40 * fc.clients)
            n_train, n_test = min(n, dc.max_train_samples or n), min(n // 2, dc.max_test_samples or n // 2)
            train, test, self.spec = stand_in_data(self.spec, n_train=n_train, n_test=n_test, seed=cfg.seed)
        else:
            train, test, self.spec = load_text_data(
                task=self.spec, path=dc.path, hf_name=dc.hf_name, hf_config=dc.hf_config, columns=columns,
                train_split=dc.train_split, test_split=dc.test_split, labels=dc.labels,
                test_fraction=dc.test_fraction, max_train_samples=dc.max_train_samples,
                max_test_samples=dc.max_test_samples, seed=cfg.seed,
                label_checks=True, allow_unseen_test_labels=dc.allow_unseen_test_labels)
        self.label_names = list(train.label_names)
        self.num_labels = len(self.label_names)
        return train, test

    def build_model(self, mc: Mapping[str, Any], seed: int, *, model=None, tokenizer=None):
        model, tok = load_base(mc, seed, self.num_labels, model=model, tokenizer=tokenizer)
        out_features = getattr(model.config, "num_labels", self.num_labels)
        if out_features != self.num_labels:
            raise ConfigError(f"the model's head has {out_features} labels, the data {self.num_labels}")
        return model, tok

    def encode(self, dataset, tokenizer, max_length: int) -> dict[str, torch.Tensor]:
        return encode(dataset, tokenizer, max_length)

    def loss(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], slots: int) -> torch.Tensor:
        """Mean cross-entropy per slot, (S,); half-precision logits are scored in float32."""
        logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        return F.cross_entropy(logits, batch["labels"], reduction="none").view(slots, -1).mean(1)

    def example_losses(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(S·b,) each row's cross-entropy: sample-level DP-SGD sums a slot's real rows (``fedlora.llm.slots``)."""
        logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        return F.cross_entropy(logits, batch["labels"], reduction="none")

    def outputs(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], slots: int) -> torch.Tensor:
        """(S, b, C): each slot's logits (H²Tune's eq. 7 compares these)."""
        return logits.view(slots, -1, logits.shape[-1])

    @torch.no_grad()
    def predict(self, ctx: EvalContext, enc: Mapping[str, torch.Tensor], row_sets: Sequence[np.ndarray],
                params) -> list[tuple[np.ndarray, np.ndarray]]:
        """Predicted class and per-row loss of every slot on its own rows (slot p: ``row_sets[p]``)."""
        b, S = ctx.batch_size, ctx.slots
        assert S == len(row_sets), "bind as many slots as row sets"
        preds: list[list[np.ndarray]] = [[] for _ in range(S)]
        losses: list[list[np.ndarray]] = [[] for _ in range(S)]
        for idx, real in slot_batches(row_sets, b):
            batch = ctx.rows(enc, idx)
            logits = ctx.forward(params, batch).float().view(S, b, -1)
            ce = F.cross_entropy(logits.reshape(S * b, -1), batch["labels"], reduction="none").view(S, b)
            pred, ce = logits.argmax(-1).cpu().numpy(), ce.cpu().numpy()  # one copy to the host per batch
            for p in range(S):
                preds[p].append(pred[p, :real[p]])
                losses[p].append(ce[p, :real[p]])
        return [(np.concatenate(preds[p]) if preds[p] else np.zeros(0, np.int64),
                 np.concatenate(losses[p]) if losses[p] else np.zeros(0)) for p in range(S)]

    def score(self, prediction: tuple[np.ndarray, np.ndarray], dataset, rows: np.ndarray) -> dict[str, float]:
        """The task's metrics of one client's (or the global model's) predictions on ``dataset``'s ``rows``,
        and ``loss`` (mean cross-entropy); {} for no rows."""
        preds, losses = prediction
        labels = np.asarray(dataset.labels)[rows]
        if len(labels) == 0:
            return {}
        out = compute_metrics(preds, labels, self.metrics, num_labels=self.num_labels)
        out["loss"] = float(losses.mean())
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "num_labels": self.num_labels, "label_names": list(self.label_names)}

    def restore(self, resolved: Mapping[str, Any]) -> None:
        self.label_names = list(resolved.get("label_names") or range(int(resolved["num_labels"])))
        self.num_labels = int(resolved["num_labels"])

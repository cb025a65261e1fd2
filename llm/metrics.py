"""Classification metrics (scikit-learn) and their aggregation over clients (docs/design.md §3, §8).

The papers report per-client metrics on each client's own test split averaged without weights
(PF2LoRA: "evaluate model on each client's test data and report averaged results"); we report that
mean, the mean weighted by test-split size, and the min / max over clients.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, quoted

__all__ = ["METRICS", "compute_metrics", "aggregate_client_metrics"]

# name → what it is (for listings and error messages)
METRICS: dict[str, str] = {
    "accuracy": "fraction of exact label matches",
    "macro_f1": "unweighted mean of per-class F1 over the classes present in labels or predictions",
    "mcc": "Matthews correlation coefficient (multi-class form, Gorodkin 2004)",
}


def _as_ids(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.ndim == 2:  # logits / scores (n, C) → predicted class ids
        if what != "preds":
            raise ConfigError(f"compute_metrics: {what} must be a 1-D array of class ids (got shape {arr.shape})")
        if arr.shape[1] == 0:
            raise ConfigError("compute_metrics: preds has 0 columns; logits need one column per class")
        arr = arr.argmax(axis=1)
    if arr.ndim != 1:
        raise ConfigError(f"compute_metrics: {what} must be 1-D class ids (or (n, C) logits for preds); got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ConfigError(f"compute_metrics: {what} must be integer class ids (got dtype {arr.dtype})")
    return arr.astype(np.int64, copy=False)


def compute_metrics(
    preds: Any, labels: Any, names: str | Iterable[str], num_labels: int | None = None
) -> dict[str, float]:
    """Metrics of predictions against labels.

    Args:
        preds: (n,) predicted class ids, or (n, C) logits (arg-max taken).
        labels: (n,) true class ids.
        names: metric names from :data:`METRICS` ("accuracy", "macro_f1", "mcc"), or one name.
        num_labels: number of classes; when given, every id must lie in [0, num_labels) (and logits
            must have num_labels columns).
    Returns: {name: float} in the order of ``names``.

    macro-F1 averages over the classes that occur in ``labels`` or ``preds`` (scikit-learn's
    default), so a client whose test split lacks a class is not scored 0 on it.
    """
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError(f"compute_metrics: no metric names given; choose from {', '.join(sorted(METRICS))}")
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ConfigError(f"compute_metrics: unknown metric(s) {quoted(unknown)}; allowed: {', '.join(sorted(METRICS))}")
    if num_labels is not None and (not isinstance(num_labels, numbers.Integral) or num_labels < 1):
        raise ConfigError(f"compute_metrics: num_labels must be a positive integer (got {num_labels!r})")
    if num_labels is not None:
        shape = np.shape(preds.detach().cpu() if hasattr(preds, "detach") else preds)
        if len(shape) == 2 and shape[1] != num_labels:
            raise ConfigError(f"compute_metrics: logits have {shape[1]} columns but num_labels={num_labels}")
    p = _as_ids(preds, "preds")
    y = _as_ids(labels, "labels")
    if y.size == 0 or p.size == 0:
        raise ConfigError("compute_metrics: empty predictions or labels; a metric needs at least one sample")
    if p.shape != y.shape:
        raise ConfigError(f"compute_metrics: {p.size} predictions for {y.size} labels")
    for arr, what in ((p, "preds"), (y, "labels")):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or (num_labels is not None and hi >= num_labels):
            allowed = f"[0, {num_labels})" if num_labels is not None else "≥ 0"
            raise ConfigError(f"compute_metrics: {what} hold class id {lo if lo < 0 else hi}, outside {allowed}")
    out: dict[str, float] = {}
    for name in names:
        if name == "accuracy":
            out[name] = float(accuracy_score(y, p))
        elif name == "macro_f1":
            out[name] = float(f1_score(y, p, average="macro", zero_division=0))
        else:  # mcc
            out[name] = float(matthews_corrcoef(y, p))
    return out


def aggregate_client_metrics(per_client: Sequence[dict[str, float]], sizes: Sequence[int]) -> dict[str, Any]:
    """Summaries of per-client metrics.

    Args:
        per_client: one {metric: value} dict per client (all with the same metric names).
        sizes: test-split size of every client. Clients of size 0 are skipped (their dict may be
            empty): they have nothing to be scored on.
    Returns: ``{"mean": {m: unweighted mean over clients}, "weighted_mean": {m: Σ n_k m_k / Σ n_k},
    "min": {...}, "max": {...}, "n_clients": scored clients, "n_skipped": clients of size 0}``.
    """
    per_client = list(per_client)
    sizes = list(sizes)
    if len(per_client) != len(sizes):
        raise ConfigError(f"aggregate_client_metrics: {len(per_client)} metric dicts but {len(sizes)} sizes")
    for k, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise ConfigError(f"aggregate_client_metrics: sizes[{k}] must be an integer ≥ 0 (got {s!r})")
    scored = [(m, int(s)) for m, s in zip(per_client, sizes) if s > 0]
    if not scored:
        raise ConfigError("aggregate_client_metrics: no client with a non-empty test split; nothing to aggregate")
    keys = list(scored[0][0])
    for k, (m, _) in enumerate(scored):
        if set(m) != set(keys):
            raise ConfigError(
                f"aggregate_client_metrics: clients report different metrics ({sorted(keys)} vs {sorted(m)})"
            )
    out: dict[str, Any] = {"mean": {}, "weighted_mean": {}, "min": {}, "max": {}}
    w = np.array([s for _, s in scored], dtype=np.float64)
    for key in keys:
        v = np.array([float(m[key]) for m, _ in scored], dtype=np.float64)
        out["mean"][key] = float(v.mean())
        out["weighted_mean"][key] = float((w * v).sum() / w.sum())
        out["min"][key], out["max"][key] = float(v.min()), float(v.max())  # NaN propagates
    out["n_clients"] = len(scored)
    out["n_skipped"] = len(per_client) - len(scored)
    return out

"""fedlora.llm.metrics against values computed by hand (not against scikit-learn itself)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.llm.metrics import aggregate_client_metrics, compute_metrics

# 3 classes. Confusion matrix (rows true, cols predicted): [[2,0,0],[0,1,1],[0,1,1]].
PRED = [0, 1, 1, 2, 2, 0]
TRUE = [0, 1, 2, 2, 1, 0]


def test_accuracy_macro_f1_mcc_by_hand():
    m = compute_metrics(PRED, TRUE, ["accuracy", "macro_f1", "mcc"])
    assert m["accuracy"] == pytest.approx(4 / 6)
    # F1: class 0 tp 2 fp 0 fn 0 → 1; class 1 tp 1 fp 1 fn 1 → 1/2; class 2 likewise 1/2
    assert m["macro_f1"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    # Gorodkin: (c·s − Σ p_k t_k) / sqrt((s² − Σ p_k²)(s² − Σ t_k²)), c = 4, s = 6, p = t = (2, 2, 2)
    assert m["mcc"] == pytest.approx((4 * 6 - 12) / math.sqrt((36 - 12) * (36 - 12)))
    assert list(m) == ["accuracy", "macro_f1", "mcc"]


def test_binary_mcc_by_hand():
    # tp 2, fp 1, tn 2, fn 0 → (tp·tn − fp·fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = 4 / 6
    m = compute_metrics([1, 1, 0, 0, 1], [1, 0, 0, 0, 1], "mcc")
    assert m == {"mcc": pytest.approx(4 / 6)}
    # all predictions one class: MCC is defined as 0 (no information)
    assert compute_metrics([1, 1, 1], [0, 1, 1], "mcc")["mcc"] == 0.0


def test_logits_are_argmaxed_and_tensors_accepted():
    logits = torch.tensor([[2.0, 0.1, 0.0], [0.0, 1.0, 0.5], [0.0, 3.0, 0.1],
                           [0.0, 0.0, 1.0], [0.1, 0.0, 0.9], [5.0, 1.0, 1.0]])
    assert compute_metrics(logits, torch.tensor(TRUE), "accuracy", num_labels=3)["accuracy"] == pytest.approx(4 / 6)


def test_macro_f1_ignores_classes_absent_from_a_client():
    # a client that only sees classes 0 and 1 of 5: perfect predictions score 1, not 2/5
    assert compute_metrics([0, 0, 1, 1], [0, 0, 1, 1], "macro_f1", num_labels=5)["macro_f1"] == 1.0
    # a class only predicted (never true) counts, with F1 0; class 0: tp 1, fp 0, fn 1 → F1 2/3
    assert compute_metrics([0, 1], [0, 0], "macro_f1")["macro_f1"] == pytest.approx((2 / 3 + 0) / 2)


@pytest.mark.parametrize("args, pattern", [
    (([0], [0], ["accuracy", "bleu"]), r"unknown metric\(s\) 'bleu'; allowed: accuracy, macro_f1, mcc$"),
    (([], [], "accuracy"), "empty"),
    (([0, 1], [0], "accuracy"), "2 predictions for 1 labels"),
    (([0, 3], [0, 1], "accuracy", 3), r"class id 3, outside \[0, 3\)"),
    (([0.5, 1], [0, 1], "accuracy"), "integer class ids"),
    (([0], [0], []), "no metric names"),
])
def test_bad_input(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        compute_metrics(*args)


def test_aggregate_unweighted_weighted_min_max():
    per = [{"accuracy": 0.5, "mcc": 0.1}, {"accuracy": 1.0, "mcc": 0.4}, {"accuracy": 0.8, "mcc": 0.1},
           {"accuracy": 0.0, "mcc": 0.0}]  # the last client has no test samples: skipped
    agg = aggregate_client_metrics(per, [10, 30, 60, 0])
    assert agg["mean"]["accuracy"] == pytest.approx((0.5 + 1.0 + 0.8) / 3)
    assert agg["weighted_mean"]["accuracy"] == pytest.approx((5 + 30 + 48) / 100)
    assert agg["weighted_mean"]["mcc"] == pytest.approx((1 + 12 + 6) / 100)
    assert (agg["min"]["accuracy"], agg["max"]["accuracy"]) == (0.5, 1.0)
    assert (agg["n_clients"], agg["n_skipped"]) == (3, 1)


def test_aggregate_errors():
    with pytest.raises(ConfigError, match="2 metric dicts but 1 sizes"):
        aggregate_client_metrics([{"accuracy": 1.0}, {"accuracy": 0.0}], [3])
    with pytest.raises(ConfigError, match="different metrics"):
        aggregate_client_metrics([{"accuracy": 1.0}, {"mcc": 0.0}], [3, 4])
    with pytest.raises(ConfigError, match="no client"):
        aggregate_client_metrics([{}], [0])
    with pytest.raises(ConfigError, match=r"sizes\[0\]"):
        aggregate_client_metrics([{"accuracy": 1.0}], [-1])
    assert np.isnan(aggregate_client_metrics([{"a": float("nan")}], [2])["min"]["a"])

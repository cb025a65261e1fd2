"""Decoding settings (``eval.decoding``) of the task kinds that decode: their defaults and their checks.

* ``DECODING`` / ``check_decoding`` — text generation (``fedlora.llm.generation``): beams, length penalty,
  repeated n-grams, new tokens;
* ``QA_DECODING`` / ``check_qa_decoding`` — extractive QA's span selection (``fedlora.llm.qa``).

A leaf: it imports no torch and nothing of ``fedlora.llm``, so the configuration checks ``eval.decoding``
(``fedlora.llm.config.check_decoding_settings``) before a task is chosen, from the tables the tasks use.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from fedlora.errors import ConfigError, quoted

__all__ = ["DECODING", "check_decoding", "QA_DECODING", "check_qa_decoding"]

#: decoding settings and their defaults (greedy when a task names none): key → (default, check)
DECODING: dict[str, Any] = {"num_beams": 1, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "max_new_tokens": 64}

#: span decoding settings (HF ``run_qa.py``'s defaults)
QA_DECODING: dict[str, Any] = {"n_best_size": 20, "max_answer_length": 30, "null_threshold": 0.0}


def check_decoding(settings: Mapping[str, Any], where: str = "eval.decoding") -> dict[str, Any]:
    """``settings`` over ``DECODING``'s defaults, each checked: ``num_beams`` ≥ 1, ``max_new_tokens`` ≥ 1 and
    ``no_repeat_ngram_size`` ≥ 0 integers, ``length_penalty`` a finite number."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where}: expected a table of decoding settings ({', '.join(DECODING)}), got {settings!r}")
    unknown = sorted(set(settings) - set(DECODING))
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {quoted(unknown)}; allowed: {', '.join(DECODING)}")
    out = {**DECODING, **settings}
    for key, low in (("num_beams", 1), ("max_new_tokens", 1), ("no_repeat_ngram_size", 0)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{where}.{key}: an integer ≥ {low}, got {v!r}")
    lp = out["length_penalty"]
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
        raise ConfigError(f"{where}.length_penalty: a finite number, got {lp!r}")
    out["length_penalty"] = float(lp)
    return out


def check_qa_decoding(settings: Mapping[str, Any], where: str = "eval.decoding") -> dict[str, Any]:
    """``settings`` over ``QA_DECODING``'s defaults, each checked: ``n_best_size`` and ``max_answer_length``
    integers ≥ 1, ``null_threshold`` a finite number."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where}: expected a table of span settings ({', '.join(QA_DECODING)}), got {settings!r}")
    unknown = sorted(set(settings) - set(QA_DECODING))
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {quoted(unknown)} for an extractive-QA task; allowed: "
                          f"{', '.join(QA_DECODING)}")
    out = {**QA_DECODING, **settings}
    for key in ("n_best_size", "max_answer_length"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}.{key}: an integer ≥ 1, got {v!r}")
    t = out["null_threshold"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ConfigError(f"{where}.null_threshold: a finite number, got {t!r}")
    out["null_threshold"] = float(t)
    return out

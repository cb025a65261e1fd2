"""Step-size/step-count grid for the ``tuned`` preset (like [PF2LoRA] App. C).

Selection uses the final *training* MSE on held-out seeds (by default 100–104, disjoint from the
evaluation seeds 0…N−1), never test data. Criterion (``select``): the worst held-out seed's gap
train MSE / best attainable train MSE (the two-level best fit, ``best_two_level_fit``, on that
seed's training data) — the run must converge on *every* seed, not on average — then the fewest
steps among the trials within 1 % of the smallest worst gap. Every method gets the grid. PF2LoRA's grid includes a cosine decay of the upper-level step (``upper_schedule``); a
constant-step trial is run once at the largest step count and read off at the smaller ones, a
cosine trial (whose schedule depends on the step count) is run once per step count.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from fedlora.errors import ConfigError

from .closed_forms import best_two_level_fit, mse
from .rank_recovery import RankRecoveryConfig, _data_for, run_rank_recovery

__all__ = ["GRID", "tune_rank_recovery", "reference_train_mse", "select", "validate_testbed", "TUNED_OPTIONS"]

#: what the grid chooses: a testbed option may not set these
TUNED_OPTIONS = ("steps", "upper_lr", "lower_lr", "upper_schedule", "het_lr")
#: rank-recovery options that are not the testbed's (the seeds are tune's own; methods run one at a time)
_NOT_TESTBED = (*TUNED_OPTIONS, "seeds", "seed_offset", "methods", "preset")

GRID: dict[str, Any] = {
    "steps": (2000, 3000, 4000),
    "pf2lora": {"upper_lr": (0.005, 0.01, 0.02, 0.05), "lower_lr": (0.05, 0.1),
                "upper_schedule": ("constant", "cosine")},
    "hetlora": {"het_lr": (0.002, 0.005, 0.01, 0.02, 0.05)},
}


def validate_testbed(seeds: int = 5, seed_offset: int = 100, **testbed: Any) -> RankRecoveryConfig:
    """The rank-recovery configuration every trial starts from (``ConfigError`` naming the flag if an
    option is bad). ``testbed``: ``RankRecoveryConfig`` fields other than what the grid chooses
    (``TUNED_OPTIONS``), the seeds and the methods; ground truth defaults to shared-private."""
    bad = sorted(k for k in testbed if k in _NOT_TESTBED)
    if bad:
        raise ConfigError(f"tune: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not testbed options "
                          f"(tune chooses {', '.join(TUNED_OPTIONS)}; the seeds are --seeds/--seed-offset)")
    testbed.setdefault("ground_truth", "shared-private")
    interval = testbed.get("interval")
    if isinstance(interval, int) and interval >= 1 and any(n % interval for n in GRID["steps"]):
        # tune has no --steps: say it in terms of what the user typed
        raise ConfigError(f"--interval: must divide every step count of tune's grid "
                          f"({', '.join(map(str, GRID['steps']))}), got {interval}")
    base = RankRecoveryConfig.from_preset("paper", seeds=seeds, seed_offset=seed_offset, **testbed)
    for steps in GRID["steps"]:
        dataclasses.replace(base, steps=steps).validate()
    return base


def tune_rank_recovery(ground_truth: str = "shared-private", seeds: int = 5, seed_offset: int = 100,
                       log=print, **testbed: Any) -> dict[str, Any]:
    """Run the grid on the testbed ``testbed`` describes (``validate_testbed``); return every trial,
    the held-out reference train MSEs and the choice per method (``select``)."""
    base = validate_testbed(seeds, seed_offset, ground_truth=ground_truth, **testbed)
    reference = reference_train_mse(base)
    trials = []
    for method, space in (("pf2lora", GRID["pf2lora"]), ("hetlora", GRID["hetlora"])):
        names = list(space)
        for values in itertools.product(*(space[n] for n in names)):
            hp = dict(zip(names, values))

            def trial(steps):
                cfg = dataclasses.replace(base, methods=(method,), steps=steps, **hp).validate()
                return run_rank_recovery(cfg, log=lambda *a: None)

            # A constant-step run gives every shorter budget (the state after `steps` steps is the
            # same); a cosine schedule depends on the total, so it is run once per budget.
            long_run = trial(max(GRID["steps"])) if hp.get("upper_schedule", "constant") == "constant" else None
            for steps in GRID["steps"]:
                res = long_run if long_run is not None else trial(steps)
                per_seed = []
                for run in res["runs"]:
                    h = run["history"]
                    row = h["train_mse"][h["step"].index(steps)]
                    per_seed.append(sum(row) / len(row))
                trials.append({"method": method, "steps": steps, **hp,
                               "train_mse": sum(per_seed) / len(per_seed), "train_mse_per_seed": per_seed})
            log(f"[tune] {method} {hp}: " + ", ".join(
                f"{t['steps']}→{t['train_mse']:.4g}" for t in trials[-len(GRID['steps']):]))
    return {"experiment": "tune", "schema_version": 1,
            "config": {k: v for k, v in dataclasses.asdict(base).items() if k not in _NOT_TESTBED},
            "ground_truth": base.ground_truth, "seeds": list(range(seed_offset, seed_offset + seeds)),
            "grid": {k: (list(v) if isinstance(v, tuple) else {kk: list(vv) for kk, vv in v.items()})
                     for k, v in GRID.items()},
            "reference_train_mse": reference, "trials": trials, "choice": select(trials, reference)}


def reference_train_mse(cfg: RankRecoveryConfig) -> list[float]:
    """Per seed of ``cfg``, the client-mean train MSE of the two-level best fit (training data only)."""
    data = _data_for(cfg)
    K = data.n_clients
    X, Y = (t.reshape(cfg.seeds, K, *t.shape[1:]) for t in (data.X_train, data.Y_train))
    W = best_two_level_fit(X, Y, cfg.rank, cfg.client_rank)
    return mse(X, Y, W).mean(1).tolist()


def select(trials: list[dict], reference: list[float], tol: float = 0.01) -> dict[str, dict]:
    """Per method: the fewest steps among trials whose worst-seed gap max_s train_s / reference_s is
    within ``tol`` of the smallest; ties by that gap. Adds ``worst_gap`` to the chosen trial."""
    choice = {}
    for method in sorted({t["method"] for t in trials}):
        ts = [{**t, "worst_gap": max(a / b for a, b in zip(t["train_mse_per_seed"], reference))}
              for t in trials if t["method"] == method]
        best = min(t["worst_gap"] for t in ts)
        ok = [t for t in ts if t["worst_gap"] <= (1 + tol) * best]
        choice[method] = min(ok, key=lambda t: (t["steps"], t["worst_gap"]))
    return choice

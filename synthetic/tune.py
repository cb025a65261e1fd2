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

import itertools
from typing import Any


from .closed_forms import best_two_level_fit, mse
from .rank_recovery import RankRecoveryConfig, _data_for, run_rank_recovery

__all__ = ["GRID", "tune_rank_recovery", "reference_train_mse", "select"]

GRID: dict[str, Any] = {
    "steps": (2000, 3000, 4000),
    "pf2lora": {"upper_lr": (0.005, 0.01, 0.02, 0.05), "lower_lr": (0.05, 0.1),
                "upper_schedule": ("constant", "cosine")},
    "hetlora": {"het_lr": (0.002, 0.005, 0.01, 0.02, 0.05)},
}


def tune_rank_recovery(ground_truth: str = "shared-private", seeds: int = 5, seed_offset: int = 100,
                       log=print) -> dict[str, Any]:
    """Run the grid; return every trial, the held-out reference train MSEs and the choice per
    method (``select``)."""
    reference = reference_train_mse(ground_truth, seeds, seed_offset)
    trials = []
    for method, space in (("pf2lora", GRID["pf2lora"]), ("hetlora", GRID["hetlora"])):
        names = list(space)
        for values in itertools.product(*(space[n] for n in names)):
            hp = dict(zip(names, values))

            def trial(steps):
                cfg = RankRecoveryConfig.from_preset("paper", ground_truth=ground_truth, seeds=seeds,
                                                     seed_offset=seed_offset, methods=(method,),
                                                     steps=steps, **hp)
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
    return {"ground_truth": ground_truth, "seeds": list(range(seed_offset, seed_offset + seeds)),
            "grid": {k: (list(v) if isinstance(v, tuple) else {kk: list(vv) for kk, vv in v.items()})
                     for k, v in GRID.items()},
            "reference_train_mse": reference, "trials": trials, "choice": select(trials, reference)}


def reference_train_mse(ground_truth: str, seeds: int, seed_offset: int) -> list[float]:
    """Per held-out seed, the client-mean train MSE of the two-level best fit (training data only)."""
    cfg = RankRecoveryConfig.from_preset("paper", ground_truth=ground_truth, seeds=seeds, seed_offset=seed_offset)
    data = _data_for(cfg)
    K = data.n_clients
    X, Y = (t.reshape(seeds, K, *t.shape[1:]) for t in (data.X_train, data.Y_train))
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

"""Step-size/step-count grid for the ``tuned`` preset (like 000_c6c65d73352e5f2c.txt App. C).

Selection uses the final *training* MSE on held-out seeds (by default 100–102, disjoint from the
evaluation seeds 0…N−1), never test data: the client- and seed-mean train MSE. Every method gets
the grid. (A worst-seed criterion picks the same step sizes with 2000 steps, which converges on
fewer evaluation seeds; see README.)
"""
from __future__ import annotations

import itertools
from typing import Any

from .rank_recovery import RankRecoveryConfig, run_rank_recovery

__all__ = ["GRID", "tune_rank_recovery"]

GRID: dict[str, Any] = {
    "steps": (2000, 3000, 4000),
    "pf2lora": {"upper_lr": (0.005, 0.01, 0.02), "lower_lr": (0.002, 0.01, 0.05, 0.1)},
    "hetlora": {"het_lr": (0.002, 0.005, 0.01, 0.02, 0.05)},
}


def tune_rank_recovery(ground_truth: str = "shared-private", seeds: int = 3, seed_offset: int = 100,
                       log=print) -> dict[str, Any]:
    """Run the grid; return every trial and the choice per method: the fewest steps whose mean
    final train MSE is within 1 % of the best trial's (more steps never hurt train loss, only time)."""
    trials = []
    for method, space in (("pf2lora", GRID["pf2lora"]), ("hetlora", GRID["hetlora"])):
        names = list(space)
        for values in itertools.product(*(space[n] for n in names)):
            hp = dict(zip(names, values))
            cfg = RankRecoveryConfig.from_preset("paper", ground_truth=ground_truth, seeds=seeds,
                                                 seed_offset=seed_offset, methods=(method,),
                                                 steps=max(GRID["steps"]), **hp)
            res = run_rank_recovery(cfg, log=lambda *a: None)
            for steps in GRID["steps"]:
                # one long run gives every shorter budget: the state after `steps` steps is the same
                per_seed = []
                for run in res["runs"]:
                    h = run["history"]
                    row = h["train_mse"][h["step"].index(steps)]
                    per_seed.append(sum(row) / len(row))
                trials.append({"method": method, "steps": steps, **hp,
                               "train_mse": sum(per_seed) / len(per_seed), "train_mse_per_seed": per_seed})
            log(f"[tune] {method} {hp}: " + ", ".join(
                f"{t['steps']}→{t['train_mse']:.4g}" for t in trials[-len(GRID['steps']):]))
    choice = {}
    for method in ("pf2lora", "hetlora"):
        ts = [t for t in trials if t["method"] == method]
        best = min(t["train_mse"] for t in ts)
        ok = [t for t in ts if t["train_mse"] <= 1.01 * best]
        choice[method] = min(ok, key=lambda t: (t["steps"], t["train_mse"]))
    return {"ground_truth": ground_truth, "seeds": list(range(seed_offset, seed_offset + seeds)),
            "grid": {k: (list(v) if isinstance(v, tuple) else {kk: list(vv) for kk, vv in v.items()})
                     for k, v in GRID.items()},
            "trials": trials, "choice": choice}

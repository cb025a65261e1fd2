"""Does PF2LoRA's bilevel step matter on the testbed? The measurements behind docs/tutorials/rank-recovery.md, "The
'without bilevel' ablation". Run from the repository root:

    python synthetic/results/hypergradient_ablation.py [--seeds 5] [--speed-seeds 20] [--out FILE.json]

Part 1, a bounded regime search: PF2LoRA with the exact hypergradient (eq. 4) against
``--hypergradient none`` (the paper's "without bilevel" ablation, h = ∇_x F(x, y)), from ``--preset
tuned`` on the shared + private ground truth, one knob at a time where the mixed second-order term
α∇²_xy F·∇_y F(x, y⁺) could matter: lower-level step, local steps per round, budget, common rank,
client-specific rank, clients, minibatches, the upper optimizer. Per regime: final test MSE / oracle,
rank recovery, and the largest per-seed relative difference of the final test MSE.

Part 2, speed on more seeds: steps until every client's test MSE is within 1.1× its oracle, per seed
(paired), for the exact hypergradient, ``none``, h = ∇_x F(x, y⁺) (no mixed term but evaluated at the
lower level's new point: isolates the mixed term) and eq. (6)'s printed "+" sign. The last two are
not options of the library (they are wrong on purpose): this script wraps
``bilevel_direction`` for them, changing nothing else.

About 5 minutes (303 s measured) on a 2-core machine (2 × 14 regimes × 5 seeds, then 3 regimes × 4 variants × 20 seeds).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import fedlora.methods.pf2lora as pf2lora_module  # noqa: E402
from fedlora.methods.hypergradient import bilevel_direction  # noqa: E402
from fedlora.synthetic.rank_recovery import RankRecoveryConfig, run_rank_recovery  # noqa: E402

#: part 1: name → overrides of --preset tuned (shared-private); None = the paper's step sizes
REGIMES: dict[str, dict] = {
    "tuned (baseline)": {},
    "paper step sizes (--preset paper)": None,
    "--lower-lr 0.3": dict(lower_lr=0.3),
    "--lower-lr 0.5": dict(lower_lr=0.5),
    "--interval 1": dict(interval=1),
    "--interval 50": dict(interval=50),
    "--steps 300": dict(steps=300),
    "--lower-lr 0.3 --steps 300": dict(lower_lr=0.3, steps=300),
    "common rank = shared rank: --rank 2 --client-rank 1 --true-ranks 3,3":
        dict(rank=2, client_rank=1, true_ranks=(3, 3)),
    "client-heavy: --shared-rank 1 --true-ranks 3,3 --rank 3 --client-rank 2":
        dict(shared_rank=1, true_ranks=(3, 3), rank=3, client_rank=2),
    "client-heavy, 4 clients: --true-ranks 3,3,3,3 (noise 0.1)":
        dict(shared_rank=1, true_ranks=(3, 3, 3, 3), noise_std=(0.1,), het_initial_ranks=(2,), rank=3, client_rank=2),
    "--batch-size 32": dict(batch_size=32),
    "--batch-size 32 --lower-lr 0.3": dict(batch_size=32, lower_lr=0.3),
    "--upper-optimizer sgd": dict(upper_optimizer="sgd"),
}
#: part 2
SPEED_REGIMES = ("tuned (baseline)", "common rank = shared rank: --rank 2 --client-rank 1 --true-ranks 3,3",
                 "client-heavy, 4 clients: --true-ranks 3,3,3,3 (noise 0.1)")
VARIANTS = ("exact", "none", "at y⁺, no mixed term", "eq. (6) sign")

_variant = {"name": "exact"}


def _patched_direction(F, x, y, alpha, batches, mode="exact", fd_eps=1e-3, per_replica=False):
    """bilevel_direction, or (for the two wrong variants) built from its exact output."""
    v = _variant["name"]
    if v in ("exact", "none"):
        return bilevel_direction(F, x, y, alpha, batches, v if mode == "exact" else mode, fd_eps, per_replica)
    h, y_plus = bilevel_direction(F, x, y, alpha, batches, "exact", fd_eps, per_replica)
    xs = [t.detach().requires_grad_(True) for t in x]
    g = torch.autograd.grad(F(xs, y_plus, batches[1]), xs)    # ∇_x F(x, y⁺), the outer batch
    if v == "at y⁺, no mixed term":
        return [t.detach() for t in g], y_plus
    return [(2 * gi - hi).detach() for gi, hi in zip(g, h)], y_plus  # ∇_x F + α∇²_xy F ∇_y F


def _cfg(over, seeds, offset=0):
    base = dict(ground_truth="shared-private", seeds=seeds, seed_offset=offset, methods=("pf2lora",), jobs=1)
    if over is None:
        return RankRecoveryConfig.from_preset("paper", **base)
    return RankRecoveryConfig.from_preset("tuned", **base, **over)


def _measure(cfg) -> dict:
    try:
        res = run_rank_recovery(cfg, log=lambda *a: None)
    except (RuntimeError, ValueError) as e:
        return {"error": str(e).splitlines()[0][:160]}
    runs = res["runs"]
    test = np.array([[c["test_mse"] for c in r["clients"]] for r in runs])
    oracle = np.array([[c["oracle_mse"] for c in r["clients"]] for r in runs])
    if not np.isfinite(test).all():
        return {"error": "diverged (non-finite test MSE)"}
    recovered = sum(c["rank90"] == c["true_rank"] and c["numerical_rank"] == c["true_rank"]
                    for r in runs for c in r["clients"])
    reach = []
    for r in runs:
        h, o = np.array(r["history"]["test_mse"]), np.array([c["oracle_mse"] for c in r["clients"]])
        ok = np.nonzero((h <= 1.1 * o).all(1))[0]
        reach.append(int(r["history"]["step"][ok[0]]) if ok.size else None)
    return {"test_mse": test.tolist(), "test_over_oracle_mean": float((test / oracle).mean()),
            "recovered": int(recovered), "client_seeds": int(test.size), "steps_to_1.1x_oracle": reach}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--speed-seeds", type=int, default=20)
    ap.add_argument("--out", default="runs/hypergradient_ablation.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pf2lora_module.bilevel_direction = _patched_direction  # what PF2LoRA's local step calls
    t0 = time.perf_counter()
    out: dict = {"search": {}, "speed": {}}

    print(f"# part 1: exact vs none, {args.seeds} seeds (final test MSE / oracle, rank recovered client-seeds, "
          f"max per-seed |Δ test MSE| / test MSE)")
    for name, over in REGIMES.items():
        row = {}
        for v in ("exact", "none"):
            _variant["name"] = v
            row[v] = _measure(_cfg(over, args.seeds))
        e, n = row["exact"], row["none"]
        if "error" in e or "error" in n:
            print(f"{name}: exact {e.get('error', 'ok')}; none {n.get('error', 'ok')}")
        else:
            a, b = np.array(e["test_mse"]), np.array(n["test_mse"])
            row["max_rel_diff"] = float(np.max(np.abs(a - b) / a))
            print(f"{name}: {e['test_over_oracle_mean']:.4g} / {n['test_over_oracle_mean']:.4g}, recovered "
                  f"{e['recovered']}/{e['client_seeds']} / {n['recovered']}/{n['client_seeds']}, "
                  f"max |Δ|/MSE {100 * row['max_rel_diff']:.2g} %")
        out["search"][name] = row

    print(f"\n# part 2: steps until every client is within 1.1x its oracle, {args.speed_seeds} seeds "
          f"(median; seeds where exact is earlier / later)")
    for name in SPEED_REGIMES:
        reach, row = {}, {}
        for v in VARIANTS:
            _variant["name"] = v
            m = _measure(_cfg(REGIMES[name], args.speed_seeds))
            reach[v] = np.array([np.nan if s is None else s for s in m["steps_to_1.1x_oracle"]], dtype=float)
            row[v] = {"steps": m["steps_to_1.1x_oracle"], "median": float(np.nanmedian(reach[v])),
                      "test_over_oracle_mean": m["test_over_oracle_mean"],
                      "recovered": f"{m['recovered']}/{m['client_seeds']}"}
        a = reach["exact"]
        cells = []
        for v in VARIANTS:
            row[v]["exact_earlier"] = int((a < reach[v]).sum())
            row[v]["exact_later"] = int((a > reach[v]).sum())
            cells.append(f"{v} {row[v]['median']:.0f}" + ("" if v == "exact" else
                         f" ({row[v]['exact_earlier']}/{row[v]['exact_later']})"))
        print(f"{name}: " + ", ".join(cells) + "; final test/oracle " +
              ", ".join(f"{row[v]['test_over_oracle_mean']:.4f}" for v in VARIANTS))
        out["speed"][name] = row
    out["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

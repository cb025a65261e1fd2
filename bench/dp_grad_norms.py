"""The per-example gradient norms that sample-level DP-SGD clips, to choose its clipping norm C (``privacy.clip_norm``).

A ``fedlora run`` config is run with sample-level DP-SGD switched on but neither clipped nor noised (σ = 0, C = 10¹²,
so the run trains as DP-SGD's Poisson batches would without privacy); every local step's per-example gradient norms —
over all the trained tensors jointly, exactly the norm the clipping sees (``fedlora.privacy.clipping.per_sample_norms``)
— are recorded. Printed: their quantiles per round and overall, and the fraction of examples each candidate C would
clip. DP-SGD's noise has std σ·C per coordinate while an unclipped example contributes its whole gradient, so a C far
above the typical norm only adds noise; a C far below clips every example to the same length (Abadi et al., "Deep
Learning with Differential Privacy", CCS 2016, §5.3: the median of the unclipped norms is a reasonable choice).

**These numbers are not differentially private**: they are a function of every example. Use them on public or proxy
data, or say that C was chosen this way; the privacy sweeps choose C on validation from a fixed grid instead.

    python bench/dp_grad_norms.py minilm-debian --method fedavg --lr 1e-2 --rounds 2 --out runs/norms.json
    python bench/dp_grad_norms.py tiny-smoke --rounds 1 --clip-norms 0.1,1    # seconds
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedlora.errors import ConfigError

QUANTILES = (0.1, 0.5, 0.9, 0.99)


def overrides(out: Path, *, method: str | None = None, lr: float | None = None, rounds: int = 2,
              sets: Sequence[str] = (), clip_norm: float = 1e12) -> list[str]:
    """The run's ``--set`` list: ``sets``, the method and step size, DP-SGD's batches with σ = 0 and C =
    ``clip_norm`` (10¹²: nothing clipped), no checkpoints, the model evaluated after the last round only."""
    extra = ([f"method.name={method}"] if method else []) + ([f"method.lr={lr!r}"] if lr is not None else [])
    return [*sets, *extra, f"train.rounds={rounds}", f"eval.every={rounds}", "privacy.level=sample",
            "privacy.noise_multiplier=0", f"privacy.clip_norm={clip_norm!r}", "train.checkpoint_every=0",
            f"output_dir={json.dumps(str(out))}"]


def part_of(name: str) -> str:
    """The part of the model a trained tensor belongs to: ``lora_A``, ``lora_B``, ``head`` (a trained classifier
    head's weight and bias) or, for anything else, its last name component."""
    last = name.rsplit(".", 1)[-1]
    return "head" if last.startswith("head_") else last


def measure(config: str, *, method: str | None = None, lr: float | None = None, rounds: int = 2,
            sets: Sequence[str] = (), clip_norms: Sequence[float] = (0.5, 1.0, 2.0, 5.0, 10.0)) -> dict[str, Any]:
    """Run ``config`` (``rounds`` rounds, ``method``/``lr`` if given, ``sets`` as ``--set``) with DP-SGD's batches but
    no clipping nor noise, recording every step's per-example gradient norms. Returns the quantiles per round and
    overall and, per C of ``clip_norms``, the fraction of examples above it."""
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun
    from fedlora.privacy.clipping import per_sample_norms

    if rounds < 1:
        raise ConfigError(f"--rounds: at least 1, got {rounds}")
    if not clip_norms or any(not math.isfinite(c) or c <= 0 for c in clip_norms):
        raise ConfigError(f"--clip-norms: positive numbers, got {list(clip_norms)}")
    norms: dict[int, list[np.ndarray]] = {}
    parts: dict[str, list[np.ndarray]] = {}  # part → the norm over that part's tensors alone of each example it had
    shares: dict[str, float] = {}  # part → Σ over examples of its share of the example's squared norm

    def observe(rnd, client, per):  # DP-SGD's release of one step, one client's examples before clipping
        # a slot's batch is padded to its pass's largest Poisson draw with rows whose gradient is exactly 0
        # (fedlora.privacy.dpsgd.private_gradients): those are not examples
        whole = per_sample_norms(per)
        real = whole > 0
        if not real.any():
            return
        norms.setdefault(rnd, []).append(whole[real].numpy())
        for part in sorted({part_of(n) for n in per}):  # a step may train some parts only (RoLoRA: A or B)
            own = per_sample_norms({n: t[real.to(t.device)] for n, t in per.items() if part_of(n) == part}).numpy()
            parts.setdefault(part, []).append(own)
            shares[part] = shares.get(part, 0.0) + float(np.sum(own ** 2 / np.maximum(whole[real].numpy() ** 2, 1e-300)))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, overrides(Path(tmp) / "run", method=method, lr=lr, rounds=rounds, sets=sets))
        run = FederatedRun(cfg).prepare()
        run.slots.sample_dp.observe = observe  # the run's own DP-SGD (a level: sample config always has one)
        summary = run.run()
    if not norms:
        raise ConfigError(f"{config}: no DP-SGD step recorded a gradient (no trained tensor?)")

    def stats(xs: np.ndarray) -> dict[str, Any]:
        return {"examples": int(xs.size), "quantiles": {f"{q:g}": float(np.quantile(xs, q)) for q in QUANTILES},
                "mean": float(xs.mean()), "max": float(xs.max()),
                "clipped_fraction": {f"{c:g}": float((xs > c).mean()) for c in clip_norms}}

    every = np.concatenate([x for r in sorted(norms) for x in norms[r]])
    return {"config": config, "method": cfg.method.name, "lr": cfg.method.lr, "rounds": rounds,
            "batch_size": cfg.train.batch_size, "local_steps": cfg.train.local_steps, "sets": list(sets),
            "final_test": summary["final_test"]["mean"], "per_round": {str(r + 1): stats(np.concatenate(norms[r]))
                                                                      for r in sorted(norms)}, "all": stats(every),
            # each part's share of the squared norm (mean over ALL examples: 0 where a step did not train it), its
            # own median over the examples whose step trained it, and how many those were: which tensors C clips
            "by_part": {part: {"median": float(np.median(np.concatenate(v))), "examples": int(sum(x.size for x in v)),
                               "share_of_squared_norm": shares[part] / every.size}
                        for part, v in sorted(parts.items())}}


def to_text(res: dict[str, Any]) -> str:
    qs = [f"{q:g}" for q in QUANTILES]
    cs = list(res["all"]["clipped_fraction"])
    lines = [f"{res['method']} (lr {res['lr']}) on {res['config']}: per-example gradient norms over all trained tensors "
             f"(DP-SGD's batches, no clipping, no noise; not private)",
             "| round | examples | " + " | ".join(f"q{q}" for q in qs) + " | " + " | ".join(f"> C={c}" for c in cs) + " |",
             "|" + "---|" * (2 + len(qs) + len(cs))]
    for name, s in [*res["per_round"].items(), ("all", res["all"])]:
        lines.append(f"| {name} | {s['examples']} | " + " | ".join(f"{s['quantiles'][q]:.3g}" for q in qs) + " | " +
                     " | ".join(f"{s['clipped_fraction'][c]:.0%}" for c in cs) + " |")
    lines.append("by part: " + "; ".join(f"{part} median {v['median']:.3g} over {v['examples']} examples, "
                                         f"{v['share_of_squared_norm']:.0%} of the squared norm"
                                         for part, v in res["by_part"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a fedlora run config (file or bundled name)")
    ap.add_argument("--method", default=None, help="method.name (default: the config's)")
    ap.add_argument("--lr", type=float, default=None, help="method.lr (default: the config's or the method's)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds to record (default 2)")
    ap.add_argument("--clip-norms", default="0.5,1,2,5,10", help="the C whose clipped fraction is shown")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config field")
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    a = ap.parse_args(argv)
    try:
        try:
            cs = [float(x) for x in a.clip_norms.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--clip-norms: numbers separated by commas, got {a.clip_norms!r}") from None
        if a.out:  # before the run: a bad folder costs one line
            from fedlora.io import check_output_dir

            check_output_dir(Path(a.out).parent, "--out")
        res = measure(a.config, method=a.method, lr=a.lr, rounds=a.rounds, sets=a.set, clip_norms=cs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_text(res))
    if a.out:
        from fedlora.io import write_json_atomic

        write_json_atomic(Path(a.out), res)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

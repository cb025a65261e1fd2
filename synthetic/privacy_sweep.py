"""The privacy–utility sweep on the synthetic testbed (issue 29 item 5): sample-level DP-SGD (``.privacy``) at
several ε, each method's step size chosen on validation.

The sweep (``sweep``) compares FedAvg-LoRA, FFA-LoRA (Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving
Federated Learning", ICLR 2024), RoLoRA, FedSVD and Fed-SB at several ε: per (method, ε) the step size is the one
of the method's grid with the lowest mean VALIDATION loss over the seeds (``select_step_size``); the test metric
is read only for that step size.
"""
from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError
from fedlora.methods import get_method
from fedlora.privacy.clipping import per_sample_lora_grads

from .compare import method_spec
from .data import make_heterogeneous_clients
from .privacy import TestbedPrivacy
from .runner import build_run, run_method, stack_federations

__all__ = ["select_step_size", "sweep", "SWEEP_METHODS", "sweep_markdown", "plot_sweep", "per_example_grad_norms",
           "method_entry"]

#: the methods of the sweep, in table order
SWEEP_METHODS = ("fedavg", "ffa", "rolora", "fedsvd", "fedsb")


def _option_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _sgd(name: str) -> dict[str, Any]:
    """Plain SGD for the sweep's steps (its grid is SGD's): the method's ``optimizer`` option, PF2LoRA's upper one;
    Fed-SB keeps its own."""
    from fedlora.methods.base import method_parameters

    if name == "fedsb":
        return {}
    params = method_parameters(name)
    return {key: "sgd" for key in ("optimizer", "upper_optimizer") if key in params}


def method_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """A sweep entry ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE…]`` (a method with constructor options, e.g.
    ``perfedavg:variant=hessian-free``) → (name, options). Its table row is labelled with the entry itself; a key the
    method's constructor does not take, or a value it refuses, is a one-line ``ConfigError``."""
    from fedlora.methods.base import method_parameters

    name, *pairs = [t.strip() for t in entry.split(":")]
    options: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"method entry {entry!r}: options are KEY=VALUE after the name, e.g. "
                              f"perfedavg:variant=hessian-free")
        options[key.strip()] = _option_value(value.strip())
    unknown = sorted(set(options) - set(method_parameters(name)))
    if unknown:
        raise ConfigError(f"method entry {entry!r}: {name} takes no option {', '.join(unknown)} (it takes "
                          f"{', '.join(method_parameters(name))})")
    try:  # a bad value (pf2lora:hypergradient=nope) is this line's, before any run, not a failure mid-sweep
        get_method(name)(**options)
    except ConfigError as e:
        raise ConfigError(f"method entry {entry!r}: {e}") from None
    return name, options


def per_example_grad_norms(data, rank: int = 4) -> torch.Tensor:
    """‖∂ℓᵢ/∂(A, B)‖ of every training example of every replica for FedAvg-LoRA's factors after one noiseless
    full-batch step from PEFT's init (B ≠ 0, so A has a gradient): what the clipping norm is measured against."""
    run = build_run("fedavg", data, lr=0.01, options={"rank": rank, "optimizer": "sgd"})
    run.method.begin_round(0)
    run.method.local_step(run.objective, run.sample)
    layer = run.layer
    X, Y, mask = data.X_train, data.Y_train, data.mask_train
    params = dict(layer.named_parameters())
    out = layer.forward_with(params, X)
    if data.task == "regression":
        per = ((out - Y) ** 2).mean(-1)
    else:
        per = F.cross_entropy(out.reshape(-1, data.d_out), Y.reshape(-1), reduction="none").view(Y.shape)
    (g,) = torch.autograd.grad(per.sum(), out)
    norms = []
    for p in range(X.shape[0]):
        dA, dB = per_sample_lora_grads(X[p][:, None], g[p][:, None], layer.lora_A[p].detach(),
                                       layer.lora_B[p].detach(), layer.scale)
        n = (dA.flatten(1).pow(2).sum(1) + dB.flatten(1).pow(2).sum(1)).sqrt()
        norms.append(n[mask[p] > 0])
    return torch.cat(norms)


# ---- the sweep -----------------------------------------------------------------------------------------------

def select_step_size(val_by_lr: Mapping[float, float]) -> float:
    """The step size with the lowest validation loss (non-finite losses never win; ties: the smaller step).
    It is given validation numbers only: the sweep never hands it a test metric."""
    finite = {lr: v for lr, v in val_by_lr.items() if math.isfinite(v)}
    if not finite:
        return min(val_by_lr)
    return min(finite, key=lambda lr: (finite[lr], lr))


def _mean(xs) -> float:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else float("nan")


def sweep(*, methods: Sequence[str] = SWEEP_METHODS, epsilons: Sequence[float] = (math.inf, 6.0, 3.0, 1.0),
          delta: float = 1e-5, clip_norm: float = 1.0, batch_size: int = 32, seeds: Sequence[int] = (0, 1),
          lr_grid: Sequence[float] = (0.1, 0.3, 1.0, 3.0), ffa_grid_factor: float = 10.0,
          task: str = "classification", clients: int = 4, n_train: int = 500, rounds: int = 20,
          local_steps: int = 5, rank: int = 4, heterogeneity: float = 0.5, log=print) -> dict[str, Any]:
    """Every method at every ε on ``clients`` clients of compare's heterogeneous testbed (``task``), all seeds
    stacked in one run. Per (method, ε): every step size of the grid (FFA-LoRA's: the grid × ``ffa_grid_factor``,
    since it trains B alone from a zero start), the one with the lowest mean validation loss over the seeds kept
    (``select_step_size``), and that run's mean test metrics reported (test loss; test accuracy for
    classification). Returns ``{"config", "rows": [{method, epsilon, sigma, lr, val_loss, test_loss,
    [test_accuracy], test_by_seed (the table's metric per federation), grid: {lr: val_loss}, grid_test (reported,
    never selected on), eps_spent, error}], "wall_s"}``."""
    if not methods or not epsilons or not seeds or not lr_grid:
        raise ConfigError("privacy sweep: methods, epsilons, seeds and lr_grid must each have at least one value")
    d_out = 10 if task == "regression" else 6
    feds = [make_heterogeneous_clients(task, int(s), heterogeneity, n_clients=clients, d_in=10, d_out=d_out,
                                       n_train=(n_train,) * clients, n_test=500,
                                       singular_value=1.0 if task == "regression" else 4.0) for s in seeds]
    data = stack_federations(task, feds, [int(s) for s in seeds], d_out, val_fraction=0.2)
    t0 = time.perf_counter()
    rows = []
    for entry in methods:  # a name, or a name with options (method_entry): the row is labelled with the entry
        name, extra = method_entry(entry)
        spec = method_spec(name, rank, clients, {**_sgd(name), **extra} or None)
        releases = get_method(name).sample_dp_releases_for(dict(spec.options or {}))
        grid = [lr * (ffa_grid_factor if name == "ffa" else 1.0) for lr in lr_grid]
        for eps in epsilons:
            priv = TestbedPrivacy(float(eps), delta, clip_norm, batch_size).validate()
            results = {}
            for lr in grid:
                results[lr] = run_method(name, data, lr=lr, rounds=rounds, local_steps=local_steps,
                                         options=spec.options, adapter=spec.adapter, lr_arg=spec.lr_arg,
                                         privacy=priv)
            lr = select_step_size({lr: _mean(r.final["val_loss"]) for lr, r in results.items()})
            best = results[lr]
            row = {"method": entry, "epsilon": float(eps), "lr": lr, "grid": {lr_: _mean(r.final["val_loss"])
                                                                              for lr_, r in results.items()},
                   "grid_test": {lr_: _mean(r.final["test_loss"]) for lr_, r in results.items()},  # reported only
                   # σ for every DP-SGD release the run makes: its local steps × the method's releases per step
                   "sigma": priv.noise_multiplier(data.client_sizes, rounds * local_steps * releases),
                   "val_loss": _mean(best.final["val_loss"]), "test_loss": _mean(best.final["test_loss"]),
                   "eps_spent": best.history[-1]["privacy"]["epsilon"] if best.history else float("nan"),
                   "error": best.error}
            if "test_accuracy" in best.final:
                row["test_accuracy"] = _mean(best.final["test_accuracy"])
            metric = best.final["test_accuracy" if "test_accuracy" in best.final else "test_loss"]
            row["test_by_seed"] = [_mean(metric[g * clients:(g + 1) * clients]) for g in range(len(seeds))]
            rows.append(row)
            log(f"[privacy-sweep] {entry} ε={eps:g}: lr {lr:g}, val {row['val_loss']:.4f}, test {row['test_loss']:.4f}"
                + (f", acc {row['test_accuracy']:.3f}" if "test_accuracy" in row else ""))
    config = {"methods": list(methods), "epsilons": [float(e) for e in epsilons], "delta": delta,
              "clip_norm": clip_norm, "batch_size": batch_size, "seeds": [int(s) for s in seeds],
              "lr_grid": list(lr_grid), "ffa_grid_factor": ffa_grid_factor, "task": task, "clients": clients,
              "n_train": n_train, "rounds": rounds, "local_steps": local_steps, "rank": rank,
              "heterogeneity": heterogeneity, "client_sizes": data.client_sizes}
    return {"config": config, "rows": rows, "wall_s": time.perf_counter() - t0}


def _eps_label(e: float) -> str:
    return "∞" if math.isinf(e) else f"{e:g}"


def sweep_markdown(result: Mapping[str, Any]) -> str:
    """The table: one row per method, one column per ε, the test metric of the step size chosen on validation
    (accuracy for classification, else loss), each seed's in brackets, then the step size."""
    cfg, rows = result["config"], result["rows"]
    metric = "test_accuracy" if cfg["task"] == "classification" else "test_loss"
    eps = cfg["epsilons"]
    lines = ["| method | " + " | ".join(f"ε = {_eps_label(e)}" for e in eps) + " |",
             "|---|" + "---|" * len(eps)]
    for name in cfg["methods"]:
        cells = []
        for e in eps:
            r = next(r for r in rows if r["method"] == name and r["epsilon"] == e)
            seeds = ", ".join(f"{v:.3f}" for v in r.get("test_by_seed", []))
            cells.append(f"{r[metric]:.3f} [{seeds}] lr {r['lr']:g}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    groups: dict[tuple[float, ...], list[str]] = {}  # σ per ε → the methods run with it (2 releases per step: larger)
    for name in cfg["methods"]:
        sig = tuple(next(r for r in rows if r["method"] == name and r["epsilon"] == e)["sigma"] for e in eps)
        groups.setdefault(sig, []).append(name)

    def sigmas(sig: tuple[float, ...]) -> str:
        return ", ".join(f"{_eps_label(e)}: {v:.3f}" for e, v in zip(eps, sig))

    lines.append("")
    lines.append(f"{metric.replace('_', ' ')}, mean over seeds {cfg['seeds']} and {cfg['clients']} clients [per seed], "
                 "the step size chosen on validation loss; σ per ε: "
                 + (sigmas(next(iter(groups))) if len(groups) == 1 else
                    "; ".join(f"{', '.join(names)}: {sigmas(sig)}" for sig, names in groups.items())) + ".")
    return "\n".join(lines)


def plot_sweep(result: Mapping[str, Any], path) -> None:
    """Test metric against ε per method (ε = ∞ drawn at the right edge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, rows = result["config"], result["rows"]
    metric = "test_accuracy" if cfg["task"] == "classification" else "test_loss"
    eps = cfg["epsilons"]
    finite = [e for e in eps if math.isfinite(e)]
    x_inf = 2 * max(finite) if finite else 1.0
    xs = [x_inf if math.isinf(e) else e for e in eps]
    many = len(cfg["methods"]) > 10  # beyond matplotlib's 10 colours: tab20's, a marker each, the legend outside
    fig, ax = plt.subplots(figsize=(7.5, 4.2) if many else (5.5, 3.6))
    colours = plt.get_cmap("tab20").colors if many else [None] * len(cfg["methods"])
    for i, name in enumerate(cfg["methods"]):
        ys = [next(r[metric] for r in rows if r["method"] == name and r["epsilon"] == e) for e in eps]
        ax.plot(xs, ys, marker="osv^D<>ph*"[i % 10] if many else "o", color=colours[i % len(colours)], label=name)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([_eps_label(e) for e in eps])
    ax.set_xlabel("ε (δ = %g)" % cfg["delta"])
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title("sample-level DP-SGD on the synthetic testbed")
    if many:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

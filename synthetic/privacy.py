"""Sample-level DP-SGD on the synthetic testbed, and its privacy–utility sweep (issue 29 item 5).

DP-SGD is Abadi et al., "Deep Learning with Differential Privacy" (CCS 2016), Algorithm 1, run by the library's
mechanism (``fedlora.privacy.dpsgd``): each local step of client k of federation g draws a Poisson batch (each of
its n_k training rows with probability q_k = min(1, b/n_k)), takes per-example gradients of the factors the method
trains, clips each example jointly to C, sums, adds N(0, σ²C² I) and divides by q_k·n_k. The testbed's ordinary
objective is full-batch (and, for regression, reduced to sufficient statistics), so under DP both the sampler and
the objective are replaced here: ``dp_objective`` gives each replica the SUM of its batch's per-example losses (a
regression row's ℓᵢ = ‖ŷᵢ − yᵢ‖²/d_out, a classification row's cross-entropy; padded rows exactly 0), and its
forward records the layer's input, output and the factors used (a ``Capture``, layout "stack": (G, N, d)).

Streams: replica g·K + k draws its batch and noise from ``seed_of(s_g, DP_SAMPLE, kind, k, round, step)``, s_g the
seed of federation g (``SampleDP.set_slot_seeds``): the replicas of client k in two stacked federations (two seeds)
draw independently, and one federation's numbers do not depend on what else is stacked with it.

The sweep (``sweep``) compares FedAvg-LoRA, FFA-LoRA (Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving
Federated Learning", ICLR 2024), RoLoRA, FedSVD and Fed-SB at several ε: per (method, ε) the step size is the one
of the method's grid with the lowest mean VALIDATION loss over the seeds (``select_step_size``); the test metric
is read only for that step size.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError
from fedlora.privacy.accounting import check_delta, noise_multiplier_for
from fedlora.privacy.dpsgd import Capture, SampleDP

__all__ = ["TestbedPrivacy", "dp_objective", "dp_sampler", "make_sample_dp", "select_step_size", "sweep",
           "SWEEP_METHODS", "sweep_markdown", "plot_sweep", "per_example_grad_norms"]

#: the methods of the sweep, in table order
SWEEP_METHODS = ("fedavg", "ffa", "rolora", "fedsvd", "fedsb")


@dataclass(frozen=True)
class TestbedPrivacy:
    """Sample-level DP on the testbed: target ``epsilon`` (``math.inf``: σ = 0 — the same Poisson batches and
    clipping, no noise), ``delta``, clipping norm ``clip_norm`` C, expected batch size ``batch_size`` b (q_k =
    min(1, b/n_k)). σ is the smallest with which every client, drawn in every round, ends at most at ε."""

    __test__ = False  # not a pytest class, despite its name

    epsilon: float
    delta: float = 1e-5
    clip_norm: float = 1.0
    batch_size: int = 16

    def validate(self) -> "TestbedPrivacy":
        e = self.epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or math.isnan(e) or e <= 0:
            raise ConfigError(f"privacy epsilon must be a number > 0 (or inf: no noise), got {e!r}")
        check_delta(self.delta)
        c = self.clip_norm
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ConfigError(f"privacy clip_norm must be a finite number > 0, got {c!r}")
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(f"privacy batch_size must be an integer ≥ 1, got {b!r}")
        return self

    def rates(self, client_sizes: Sequence[int]) -> list[float]:
        return [min(1.0, self.batch_size / n) for n in client_sizes]

    def noise_multiplier(self, client_sizes: Sequence[int], steps: int) -> float:
        """σ for ``steps`` local steps in all (rounds × local steps): the largest any client needs (0 at ε = ∞)."""
        if math.isinf(self.epsilon):
            return 0.0
        return max(_sigma_for(float(self.epsilon), float(self.delta), q, int(steps))
                   for q in set(self.rates(client_sizes)))


@functools.lru_cache(maxsize=256)
def _sigma_for(epsilon: float, delta: float, q: float, steps: int) -> float:
    # calibration takes seconds (a bisection over RDP curves); a sweep asks the same (ε, δ, q, steps) per step size
    return noise_multiplier_for(epsilon, delta, q, steps)


def make_sample_dp(privacy: TestbedPrivacy, client_sizes: Sequence[int], group_seeds: Sequence[int], rounds: int,
                   local_steps: int) -> SampleDP:
    """The ``SampleDP`` of a testbed run: rates by client, sizes n_k, σ for rounds × local_steps, one stream key
    (the federation's seed) per replica, group-major."""
    privacy.validate()
    sdp = SampleDP(privacy.clip_norm, privacy.noise_multiplier(client_sizes, rounds * local_steps),
                   privacy.rates(client_sizes), seed=0)
    sdp.set_client_sizes(list(client_sizes))
    sdp.set_slot_seeds([int(s) for s in group_seeds for _ in client_sizes])
    return sdp


def _forward(layer, params: Mapping[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
    """``layer.forward_with``, recorded for per-example gradients inside ``fedlora.privacy.dpsgd.capture`` with the
    factors actually used (Fed-SB substitutes its folded B·R)."""
    y = layer.forward_with(params, X)
    if layer.dp_capture is not None:
        layer.dp_capture.append(Capture(layer, X, y, "stack", params.get("lora_A", layer.lora_A),
                                        params.get("lora_B", layer.lora_B)))
    return y


def dp_objective(layer, task: str, d_out: int) -> Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]:
    """objective(params, (X (G, m, d_in), Y, mask (G, m))) → (G,): per replica the SUM over its real rows of
    ℓᵢ (regression ‖ŷᵢ − yᵢ‖²/d_out, so that Σᵢ ℓᵢ / n is the testbed's MSE; classification CE); a padded row's
    ℓ is exactly 0 (``torch.where``), so its per-example gradient is 0."""
    def objective(params, batch):
        X, Y, mask = batch
        out = _forward(layer, params, X)
        if task == "regression":
            per = ((out - Y) ** 2).mean(-1)
        else:
            per = F.cross_entropy(out.reshape(-1, d_out), Y.reshape(-1), reduction="none").view(Y.shape)
        return torch.where(mask > 0, per, torch.zeros_like(per)).sum(-1)
    return objective


def dp_sampler(data, sdp: SampleDP) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """sample() → (X, Y, mask): replica i = g·K + k's Poisson batch at the current (round, step) from its
    federation's stream (``SampleDP.poisson_rows``), padded to the largest draw (at least one row) with copies of
    row 0, marked 0 in ``mask``."""
    K = data.n_clients
    sizes = [int(n) for n in data.n_train]

    def sample():
        rows = [sdp.poisson_rows(i % K, sizes[i], seed=sdp.slot_seed(i)) for i in range(len(sizes))]
        m = max(1, max(len(r) for r in rows))
        idx = torch.zeros(len(rows), m, dtype=torch.int64)
        mask = torch.zeros(len(rows), m, dtype=torch.float64)
        for i, r in enumerate(rows):
            idx[i, : len(r)] = r
            mask[i, : len(r)] = 1.0
        X = torch.gather(data.X_train, 1, idx[..., None].expand(-1, -1, data.X_train.shape[-1]))
        if data.Y_train.dim() == 3:
            Y = torch.gather(data.Y_train, 1, idx[..., None].expand(-1, -1, data.Y_train.shape[-1]))
        else:
            Y = torch.gather(data.Y_train, 1, idx)
        return X, Y, mask
    return sample


def per_example_grad_norms(data, rank: int = 4) -> torch.Tensor:
    """‖∂ℓᵢ/∂(A, B)‖ of every training example of every replica for FedAvg-LoRA's factors after one noiseless
    full-batch step from PEFT's init (B ≠ 0, so A has a gradient): what the clipping norm is measured against."""
    from fedlora.privacy.clipping import per_sample_lora_grads

    from .runner import build_run

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
    from .compare import method_spec
    from .data import make_heterogeneous_clients
    from .runner import run_method, stack_federations

    if not methods or not epsilons or not seeds or not lr_grid:
        raise ConfigError("privacy sweep: methods, epsilons, seeds and lr_grid must each have at least one value")
    d_out = 10 if task == "regression" else 6
    feds = [make_heterogeneous_clients(task, int(s), heterogeneity, n_clients=clients, d_in=10, d_out=d_out,
                                       n_train=(n_train,) * clients, n_test=500,
                                       singular_value=1.0 if task == "regression" else 4.0) for s in seeds]
    data = stack_federations(task, feds, [int(s) for s in seeds], d_out, val_fraction=0.2)
    t0 = time.perf_counter()
    rows = []
    for name in methods:
        spec = method_spec(name, rank, clients, {"optimizer": "sgd"} if name != "fedsb" else None)
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
            row = {"method": name, "epsilon": float(eps), "lr": lr, "grid": {lr_: _mean(r.final["val_loss"])
                                                                              for lr_, r in results.items()},
                   "grid_test": {lr_: _mean(r.final["test_loss"]) for lr_, r in results.items()},  # reported only
                   "sigma": priv.noise_multiplier(data.client_sizes, rounds * local_steps),
                   "val_loss": _mean(best.final["val_loss"]), "test_loss": _mean(best.final["test_loss"]),
                   "eps_spent": best.history[-1]["privacy"]["epsilon"] if best.history else float("nan"),
                   "error": best.error}
            if "test_accuracy" in best.final:
                row["test_accuracy"] = _mean(best.final["test_accuracy"])
            metric = best.final["test_accuracy" if "test_accuracy" in best.final else "test_loss"]
            row["test_by_seed"] = [_mean(metric[g * clients:(g + 1) * clients]) for g in range(len(seeds))]
            rows.append(row)
            log(f"[privacy-sweep] {name} ε={eps:g}: lr {lr:g}, val {row['val_loss']:.4f}, test {row['test_loss']:.4f}"
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
    sig = {_eps_label(r["epsilon"]): r["sigma"] for r in rows}
    lines.append("")
    lines.append(f"{metric.replace('_', ' ')}, mean over seeds {cfg['seeds']} and {cfg['clients']} clients [per seed], "
                 "the step size chosen on validation loss; σ per ε: "
                 + ", ".join(f"{k}: {v:.3f}" for k, v in sig.items()) + ".")
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
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in cfg["methods"]:
        ys = [next(r[metric] for r in rows if r["method"] == name and r["epsilon"] == e) for e in eps]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([_eps_label(e) for e in eps])
    ax.set_xlabel("ε (δ = %g)" % cfg["delta"])
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title("sample-level DP-SGD on the synthetic testbed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

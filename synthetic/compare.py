"""``fedlora synthetic compare``: every registered method on M heterogeneous clients (docs/design.md §6).

Clients k = 1..M hold W_k* = S + h·P_k (``fedlora.synthetic.data.make_heterogeneous_clients``): a shared
part S and a private part P_k scaled by the heterogeneity knob h (h = 0: identical clients). Two
tasks: ``regression`` (MSE) and ``classification`` (labels drawn from softmax(X W_k*), cross-entropy,
accuracy). Every seed × h is one federation; all of them train at once as the replicas of one
stacked ``LoRALinear`` (W0 = 0) through ``fedlora.simulator.run_rounds`` — the Method classes the
LLM path uses, unchanged.

Step sizes (no tuning towards an ordering): every method runs every value of one common grid
``lr_grid`` (its main step size: ``lr``, PF2LoRA's ``upper_lr``). Per (task, h, method) we keep the
value with the lowest validation loss — unweighted mean over seeds and clients, on a split carved
from each client's training data (``val_fraction``) and never trained on; ties go to the smaller
step; a run that diverged counts as +∞. Test metrics are those of the chosen run.

Per-method structure (``method_spec``): the common rank r (``rank``) for every method that takes
one; PF2LoRA r̃ = ⌊r/2⌋ (client adapter), HetLoRA ranks in [1, 2r]; options of the paper otherwise.
``method_options`` (config file) overrides any constructor option per method.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from fedlora.adapter import refuse_rslora
from fedlora.errors import ConfigError, did_you_mean, plural
from fedlora.methods import available_methods, get_method, method_parameters

from .closed_forms import ols
from .data import TASKS, make_heterogeneous_clients, per_client
from .runner import StackedData, build_method, run_method, stack_federations

__all__ = ["CompareConfig", "MethodSpec", "method_spec", "run_compare", "to_markdown", "plot_compare",
           "DEFAULT_LR_GRID"]

DEFAULT_LR_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)

#: client-side plain-SGD steps that are not the method's main step size (PF2LoRA's lower level,
#: Alg. 1 line 5; Per-FedAvg's inner/personalisation step): one fixed value for both, the repo's
#: tuned rank-recovery lower_lr (``fedlora synthetic tune``), not on the grid.
CLIENT_SGD_LR = 0.1

#: per-method defaults as a function of the common rank r and the number of clients M (besides
#: ``rank`` = r itself, which every method whose constructor takes one receives). Everything not
#: listed keeps the constructor's (paper's) default. Reasons: docs/results/synthetic-compare.md.
_DEFAULTS: dict[str, Any] = {
    "pf2lora": lambda r, M: {"lower_lr": CLIENT_SGD_LR},
    "perfedavg": lambda r, M: {"inner_lr": CLIENT_SGD_LR},
    # ranks r_k ∈ [1, 2r] by PF2LoRA's recipe (the paper's synthetic run uses r_max = 3r); AdamW as
    # most methods here, so that the step-size grid means much the same (the paper's default is SGD).
    # H²Tune keeps its constructor default, plain SGD as App. A's Algorithm 1 writes it (docs/results/synthetic-compare.md).
    "hetlora": lambda r, M: {"r_min": 1, "r_max": 2 * r, "optimizer": "adamw"},
    # global rank r_G = 2r, every client's budget r_k = r: the same upload as RoLoRA at rank r, and
    # the adaptive selection has something to choose from
    "lora-a2": lambda r, M: {"rank": 2 * r, "client_ranks": [r] * M},
}


@dataclass(frozen=True)
class MethodSpec:
    """How one method is built: constructor options (without the step size), the adapter
    structure (``LoRALinear`` kwargs; ``None`` = ``method.adapter_kwargs()``), the step-size argument."""

    name: str
    options: dict[str, Any]
    adapter: dict[str, Any] | None
    lr_arg: str = "lr"


def method_spec(name: str, rank: int, n_clients: int, overrides: Mapping[str, Any] | None = None,
                rslora: bool = False) -> MethodSpec:
    """The config-table entry of ``name`` at common rank ``rank`` for ``n_clients`` clients;
    ``overrides`` (constructor options) win; ``rslora``: the adapter with rsLoRA's s = α/√r
    (``fedlora.adapter.lora_scale``; refused for a method whose paper fixes the scale). ``ConfigError`` on bad input."""
    if rslora:
        refuse_rslora(name, get_method(name).fixed_lora_scale, "--rslora")
        spec = method_spec(name, rank, n_clients, overrides)
        # the adapter structure does not depend on the step size: any lr builds the method to ask it
        adapter = spec.adapter if spec.adapter is not None else \
            build_method(name, 1e-3, spec.options, spec.lr_arg).adapter_kwargs()
        return dataclasses.replace(spec, adapter={**adapter, "rslora": True})
    accepted = set(method_parameters(name))
    overrides = dict(overrides or {})
    options: dict[str, Any] = {"rank": rank} if "rank" in accepted else {}
    options.update(_DEFAULTS.get(name, lambda r, M: {})(rank, n_clients))
    if name == "pf2lora":
        # r and r̃ shape the model (common and client adapter); the constructor gets them where it takes them
        r = overrides.pop("rank", rank)
        r_tilde = overrides.pop("client_rank", max(1, r // 2))
        if not (isinstance(r, int) and isinstance(r_tilde, int) and 1 <= r_tilde < r):
            raise ConfigError(f"pf2lora: client_rank r̃ must be an integer with 1 ≤ r̃ < rank r = {r}, got {r_tilde}")
        options.update({k: v for k, v in (("rank", r), ("client_rank", r_tilde)) if k in accepted})
        options.update(overrides)
        return MethodSpec(name, options, {"rank": r, "client_rank": r_tilde}, "upper_lr")
    options.update(overrides)
    if name == "hetlora":
        return MethodSpec(name, options, {"rank": int(options["r_max"])})
    return MethodSpec(name, options, None)


def _personalised(name: str) -> bool:
    """The method's ``personalised`` flag; False for a name no longer registered (a plugin's, plotted later)."""
    try:
        return get_method(name).personalised
    except ConfigError:
        return False


def _with_suggestions(keys, allowed) -> str:
    """'a' (did you mean 'b'?), 'c' — each unknown key with the closest allowed one, if any is close."""
    return ", ".join(f"{k!r}{did_you_mean(k, allowed)}" for k in keys)


def _auto_n_train(clients: int) -> tuple[int, ...]:
    return tuple(75 + 25 * k for k in range(clients))


@dataclass
class CompareConfig:
    """One validated configuration of ``fedlora synthetic compare``."""

    methods: tuple[str, ...] = ()  # empty: every registered method
    tasks: tuple[str, ...] = TASKS
    heterogeneity: tuple[float, ...] = (0.0, 0.5, 1.0)
    seeds: int = 3
    seed_offset: int = 0
    rounds: int = 30
    local_steps: int = 5
    clients: int = 4
    dim: int = 10  # d_in (= d_out for regression)
    classes: int = 6  # d_out for classification
    shared_rank: int = 2
    private_rank: int = 2
    n_train: tuple[int, ...] = ()  # per client; empty: 75, 100, 125, … (unequal n_k)
    n_test: int = 500
    val_fraction: float = 0.2
    noise_std: float = 0.5
    signal: float = 1.0  # singular value of S and P_k, regression
    logit_scale: float = 4.0  # singular value of S and P_k, classification (logits X W_k*)
    rank: int = 4
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID
    rank_tol: float = 0.02
    sample_fraction: float = 1.0  # clients drawn per round and federation (McMahan's C)
    rslora: bool = False  # every method's adapter with rsLoRA's s = α/√r (left out of the record when off)
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def validate(self) -> "CompareConfig":
        def need(cond: bool, flag: str, allowed: str, got: Any) -> None:
            if not cond:
                raise ConfigError(f"--{flag}: must be {allowed}, got {got!r}")

        known = available_methods()
        if not self.methods:
            self.methods = tuple(known)
        for m in self.methods:
            need(m in known, "methods", f"a comma-separated list from {', '.join(known)}", m)
        need(len(set(self.methods)) == len(self.methods), "methods", "a list without repeats", ",".join(self.methods))
        need(len(self.tasks) >= 1 and all(t in TASKS for t in self.tasks), "task",
             "regression, classification or both", ",".join(self.tasks))
        need(len(self.heterogeneity) >= 1 and all(isinstance(h, (int, float)) and math.isfinite(h) and h >= 0
                                                   for h in self.heterogeneity),
             "heterogeneity", "a comma-separated list of numbers ≥ 0", self.heterogeneity)
        need(len(set(self.heterogeneity)) == len(self.heterogeneity), "heterogeneity", "a list without repeats",
             self.heterogeneity)
        for flag, v, low in (("seeds", self.seeds, 1), ("seed-offset", self.seed_offset, 0), ("rounds", self.rounds, 1),
                             ("local-steps", self.local_steps, 1), ("clients", self.clients, 1),
                             ("dim", self.dim, 1), ("classes", self.classes, 2), ("rank", self.rank, 1),
                             ("shared-rank", self.shared_rank, 1), ("private-rank", self.private_rank, 0),
                             ("n-test", self.n_test, 1)):
            need(isinstance(v, int) and not isinstance(v, bool) and v >= low, flag, f"an integer ≥ {low}", v)
        if not self.n_train:
            self.n_train = _auto_n_train(self.clients)
        self.n_train = per_client(self.n_train, self.clients)  # one --n-train value is every client's
        need(len(self.n_train) == self.clients and all(isinstance(n, int) and n >= 2 for n in self.n_train),
             "n-train", f"one integer ≥ 2 per client ({self.clients})", self.n_train)
        need(0 < self.val_fraction < 1, "val-fraction", "in (0, 1)", self.val_fraction)
        need(all(math.ceil(self.val_fraction * n) < n for n in self.n_train), "val-fraction",
             "small enough to leave every client a training sample", self.val_fraction)
        d_out_min = min(self.dim, self.classes) if "classification" in self.tasks else self.dim
        need(self.shared_rank <= d_out_min, "shared-rank", f"≤ min(dim, classes) = {d_out_min}", self.shared_rank)
        need(self.shared_rank + self.private_rank <= d_out_min, "private-rank",
             f"≤ min(dim, classes) − shared rank = {d_out_min - self.shared_rank}", self.private_rank)
        need(self.rank <= self.dim, "rank", f"in [1, dim = {self.dim}]", self.rank)
        need(self.noise_std >= 0 and math.isfinite(self.noise_std), "noise-std", "a finite number ≥ 0", self.noise_std)
        for flag, v in (("signal", self.signal), ("logit-scale", self.logit_scale)):
            need(v > 0 and math.isfinite(v), flag, "a finite number > 0", v)
        need(len(self.lr_grid) >= 1 and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                                             for v in self.lr_grid), "lr-grid",
             "a comma-separated list of finite numbers > 0", self.lr_grid)
        need(0 < self.rank_tol < 1, "rank-tol", "in (0, 1)", self.rank_tol)
        need(isinstance(self.rslora, bool), "rslora", "true or false", self.rslora)
        need(isinstance(self.sample_fraction, (int, float)) and 0 < self.sample_fraction <= 1, "sample-fraction",
             "in (0, 1]", self.sample_fraction)
        need(self.sample_fraction == 1 or "centralized" not in self.methods, "sample-fraction",
             "1 when centralized is compared (pooled training has no clients to sample)", self.sample_fraction)
        need(isinstance(self.method_options, dict), "config", "a table method_options = {method: {option: value}}",
             self.method_options)
        bad = sorted(set(self.method_options) - set(known))
        if bad:
            raise ConfigError(f"--config: method_options for unknown method(s) {_with_suggestions(bad, known)}; "
                              f"methods: {', '.join(known)}")
        bad = sorted(k for k, v in self.method_options.items() if not isinstance(v, dict))
        need(not bad, "config", "method_options = {method: {option: value}} (a table per method)", bad)
        for name in self.methods:  # every constructor validates its options: fail before running anything
            spec = method_spec(name, self.rank, self.clients, self.method_options.get(name), self.rslora)
            for lr in self.lr_grid:
                m = build_method(name, float(lr), spec.options, spec.lr_arg)
            if spec.adapter is None:
                try:
                    m.adapter_kwargs()
                except NotImplementedError:
                    raise ConfigError(f"{name}: no adapter structure known (define adapter_kwargs())") from None
        return self

    @classmethod
    def from_options(cls, **options: Any) -> "CompareConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ConfigError(f"unknown compare option(s) {_with_suggestions(unknown, fields)}; "
                              f"allowed: {', '.join(sorted(fields))}")
        return cls(**options).validate()


# --------------------------------------------------------------------------------------------------
def _make_data(cfg: CompareConfig, task: str) -> StackedData:
    """Groups h-major then seed: group g = i_h·S + s."""
    d_out = cfg.dim if task == "regression" else cfg.classes
    sv = cfg.signal if task == "regression" else cfg.logit_scale
    feds, seeds = [], []
    for h in cfg.heterogeneity:
        for s in range(cfg.seeds):
            seed = cfg.seed_offset + s
            feds.append(make_heterogeneous_clients(
                task, seed, float(h), n_clients=cfg.clients, d_in=cfg.dim, d_out=d_out,
                shared_rank=cfg.shared_rank, private_rank=cfg.private_rank, n_train=tuple(cfg.n_train),
                n_test=cfg.n_test, noise_std=cfg.noise_std, singular_value=sv))
            seeds.append(seed)
    return stack_federations(task, feds, seeds, d_out, cfg.val_fraction)


def _references(data: StackedData) -> dict[str, torch.Tensor]:
    """Per-replica test loss (and accuracy) of the truth W_k* (Bayes) and, for regression, of each
    client's own least-squares fit (no sharing, no rank constraint) on its training split."""
    out: dict[str, torch.Tensor] = {}
    if data.task == "regression":
        def mse_of(W):
            err = ((data.X_test @ W - data.Y_test) ** 2).sum(-1) * data.mask_test
            return err.sum(-1) / (data.n_test * data.d_out)

        out["bayes_test_loss"] = mse_of(data.W_star)
        out["local_ols_test_loss"] = mse_of(ols(data.X_train, data.Y_train))  # zero rows do not change OLS
    else:
        logits = data.X_test @ data.W_star
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, data.d_out), data.Y_test.reshape(-1),
                                               reduction="none").view(logits.shape[:2])
        out["bayes_test_loss"] = (ce * data.mask_test).sum(-1) / data.n_test
        out["bayes_test_accuracy"] = ((logits.argmax(-1) == data.Y_test).double() * data.mask_test).sum(-1) / data.n_test
    return out


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _mean_std(xs: list[float]) -> dict[str, float | None]:
    t = torch.tensor(xs, dtype=torch.float64)
    return {"mean": _finite_or_none(float(t.mean())),
            "std": _finite_or_none(float(t.std())) if len(xs) > 1 else 0.0}


def _mean(xs) -> float:
    return float(torch.tensor(list(xs), dtype=torch.float64).mean())


def run_compare(cfg: CompareConfig, *, log=print) -> dict[str, Any]:
    """Run the comparison; return the JSON-serialisable result (schema: docs/results/synthetic-compare.md, "compare.json")."""
    cfg.validate()
    S, K, H = cfg.seeds, cfg.clients, len(cfg.heterogeneity)
    results, references, runs_log = [], [], []
    t_all = time.perf_counter()
    for task in cfg.tasks:
        data = _make_data(cfg, task)
        weights = torch.tensor(data.client_sizes, dtype=torch.float64)
        weights = weights / weights.sum()
        refs = _references(data)
        for ih, h in enumerate(cfg.heterogeneity):
            reps = slice(ih * S * K, (ih + 1) * S * K)
            entry: dict[str, Any] = {"task": task, "heterogeneity": float(h)}
            for key, v in refs.items():
                per_seed = v[reps].view(S, K)
                entry[key] = {"unweighted": _mean_std(per_seed.mean(1).tolist()),
                              "weighted": _mean_std((per_seed @ weights).tolist())}
            references.append(entry)
        for name in cfg.methods:
            spec = method_spec(name, cfg.rank, cfg.clients, cfg.method_options.get(name), cfg.rslora)
            by_lr = {}
            for lr in cfg.lr_grid:
                res = run_method(name, data, lr=float(lr), rounds=cfg.rounds, local_steps=cfg.local_steps,
                                 options=spec.options, adapter=spec.adapter, lr_arg=spec.lr_arg,
                                 rank_tol=cfg.rank_tol, sample_fraction=cfg.sample_fraction,
                                 sample_seed=cfg.seed_offset)
                by_lr[float(lr)] = res
                runs_log.append({"task": task, "method": name, "lr": float(lr), "wall_s": res.wall_s,
                                 "error": res.error})
                if res.error:
                    log(f"[compare] {task} {name} lr={lr}: {res.error}")
            grid_s = sum(r.wall_s for r in by_lr.values())
            log(f"[compare] {task} {name}: {plural(len(cfg.lr_grid), 'step size')} × {H} h × {plural(S, 'seed')}, {grid_s:.1f} s")
            for ih, h in enumerate(cfg.heterogeneity):
                entry = _entry(cfg, task, ih, float(h), name, spec, by_lr, data, weights)
                entry["wall_s_grid"] = grid_s  # every step size of the grid, all h and seeds at once
                results.append(entry)
    return {"experiment": "compare", "schema_version": 1,
            "config": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k != "rslora" or v},
                       "methods": list(cfg.methods)},
            "selection": ("per (task, heterogeneity, method): the lr of lr_grid with the lowest validation "
                          "loss (unweighted mean over seeds and clients; split carved from training data); "
                          "ties → smaller lr; diverged runs = +inf"),
            "results": results, "references": references, "runs": runs_log,
            "timing": {"total_s": time.perf_counter() - t_all}}


def _entry(cfg: CompareConfig, task: str, ih: int, h: float, name: str, spec: MethodSpec,
           by_lr: dict[float, Any], data: StackedData, weights: torch.Tensor) -> dict[str, Any]:
    S, K = cfg.seeds, cfg.clients
    lo, hi = ih * S * K, (ih + 1) * S * K

    def val_score(res) -> float:
        v = torch.tensor(res.final["val_loss"][lo:hi], dtype=torch.float64)
        return float(v.mean()) if torch.isfinite(v).all() else math.inf

    scores = {lr: val_score(r) for lr, r in by_lr.items()}
    lr = min(scores, key=lambda k: (scores[k], k))
    res = by_lr[lr]
    f = res.final
    rounds = len(res.history)
    seeds = []
    for s in range(S):
        clients = []
        for k in range(K):
            i = lo + s * K + k
            up = [rec["bytes_up"][i] for rec in res.history]
            down = [rec["bytes_down"][i] for rec in res.history]
            c = {"client": k + 1, "n_train": int(data.n_train[i]), "weight": float(weights[k]),
                 "true_rank": int(torch.linalg.matrix_rank(data.W_star[i])),
                 "train_loss": _finite_or_none(f["train_loss"][i]), "val_loss": _finite_or_none(f["val_loss"][i]),
                 "test_loss": _finite_or_none(f["test_loss"][i]),
                 "rank90": f["rank90"][i], "numerical_rank": f["numerical_rank"][i],
                 "distance_to_truth": _finite_or_none(f["distance"][i]),
                 "bytes_up_per_round": up, "bytes_down_per_round": down,
                 "bytes_up_total": sum(up), "bytes_down_total": sum(down)}
            if "test_accuracy" in f:
                c["test_accuracy"] = _finite_or_none(f["test_accuracy"][i])
            clients.append(c)
        reps = range(lo + s * K, lo + (s + 1) * K)
        curve = [_finite_or_none(_mean(rec["train_loss"][i] for i in reps)) for rec in res.history]
        seed_entry = {"seed": data.group_seeds[ih * S + s], "clients": clients,
                      "train_loss_per_round": curve}
        for metric in ("test_loss", "test_accuracy"):
            if metric in f:
                v = torch.tensor(f[metric][lo + s * K: lo + (s + 1) * K], dtype=torch.float64)
                seed_entry[f"{metric}_mean"] = _finite_or_none(float(v.mean()))
                seed_entry[f"{metric}_weighted"] = _finite_or_none(float(v @ weights))
        seeds.append(seed_entry)
    summary: dict[str, Any] = {}
    for metric in ("test_loss", "test_accuracy"):
        if metric in f:
            for agg in ("mean", "weighted"):
                summary[f"{metric}_{agg}"] = _mean_std([s[f"{metric}_{agg}"] if s[f"{metric}_{agg}"] is not None
                                                        else math.nan for s in seeds])
    cl = [c for s in seeds for c in s["clients"]]
    summary["rank90_mean"] = _mean(c["rank90"] for c in cl)
    summary["numerical_rank_mean"] = _mean(c["numerical_rank"] for c in cl)
    summary["bytes_up_per_round_per_client"] = _mean(b for c in cl for b in c["bytes_up_per_round"]) if rounds else None
    summary["bytes_down_per_round_per_client"] = _mean(b for c in cl for b in c["bytes_down_per_round"]) if rounds else None
    return {"task": task, "heterogeneity": h, "method": name, "lr": lr,
            "val_loss_by_lr": {str(k): _finite_or_none(v) for k, v in scores.items()},
            "options": spec.options, "lr_arg": spec.lr_arg,
            "adapter": spec.adapter if spec.adapter is not None else
            build_method(name, lr, spec.options, spec.lr_arg).adapter_kwargs(),
            "rounds": cfg.rounds, "local_steps": cfg.local_steps,
            "wall_s": res.wall_s, "error": res.error, "summary": summary, "seeds": seeds}


# --------------------------------------------------------------------------------------------------
def _fmt(ms: dict[str, float | None], digits: int = 3) -> str:
    if ms["mean"] is None:
        return "diverged"
    return f"{ms['mean']:.{digits}f} ± {ms['std']:.{digits}f}"


def to_markdown(result: dict[str, Any]) -> str:
    """One table per task: methods × heterogeneity (test loss, mean ± std over seeds; unweighted
    mean over clients), then rank, bytes per round per client, chosen step sizes, wall time."""
    cfg = result["config"]
    hs = cfg["heterogeneity"]
    lines = [f"# synthetic compare — {cfg['clients']} clients, {cfg['seeds']} seed(s), {cfg['rounds']} rounds × "
             f"{cfg['local_steps']} local steps, rank r = {cfg['rank']}"
             + (", rsLoRA (every adapter scaled by α/√r)" if cfg.get("rslora") else ""), "",
             f"Step size per (task, h, method) from {list(cfg['lr_grid'])} by validation loss. "
             "Test metrics: unweighted mean over clients, mean ± std over seeds.", ""]
    for task in cfg["tasks"]:
        rows = [r for r in result["results"] if r["task"] == task]
        refs = {r["heterogeneity"]: r for r in result["references"] if r["task"] == task}
        metric = "test MSE" if task == "regression" else "test CE"
        lines.append(f"## {task}")
        lines.append("")
        cols = [f"{metric} h={h:g}" for h in hs]
        if task == "classification":
            cols += [f"acc h={h:g}" for h in hs]
        cols += [f"rank90 h={hs[-1]:g}", "up B/round/client", "down B/round/client", "lr (per h)", "wall s (grid)"]
        lines.append("| method | " + " | ".join(cols) + " |")
        lines.append("|---|" + "---|" * len(cols))
        for name in cfg["methods"]:
            by_h = {r["heterogeneity"]: r for r in rows if r["method"] == name}
            cells = [_fmt(by_h[h]["summary"]["test_loss_mean"]) for h in hs]
            if task == "classification":
                cells += [_fmt(by_h[h]["summary"]["test_accuracy_mean"]) for h in hs]
            last = by_h[hs[-1]]["summary"]
            up, down = last["bytes_up_per_round_per_client"], last["bytes_down_per_round_per_client"]
            cells += [f"{last['rank90_mean']:.2f}", "–" if up is None else f"{up:.0f}",
                      "–" if down is None else f"{down:.0f}",
                      ", ".join(f"{by_h[h]['lr']:g}" for h in hs), f"{by_h[hs[0]]['wall_s_grid']:.1f}"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        ref_cells = [_fmt(refs[h]["bayes_test_loss"]["unweighted"]) for h in hs]
        if task == "classification":
            ref_cells += [_fmt(refs[h]["bayes_test_accuracy"]["unweighted"]) for h in hs]
        lines.append("| (truth W_k\\*, Bayes) | " + " | ".join(ref_cells) + " |" + " |" * 5)
        if task == "regression":
            lines.append("| (local OLS, no rank limit) | " + " | ".join(
                _fmt(refs[h]["local_ols_test_loss"]["unweighted"]) for h in hs) + " |" + " |" * 5)
        lines.append("")
    lines.append(f"Total wall time {result['timing']['total_s']:.1f} s.")
    return "\n".join(lines) + "\n"


def plot_compare(result: dict[str, Any], path) -> Any:
    """Test loss (and accuracy) vs heterogeneity h, one line per method (error bars: std over seeds)."""
    from pathlib import Path

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cfg = result["config"]
    panels = [(t, "test_loss_mean", "test MSE" if t == "regression" else "test cross-entropy") for t in cfg["tasks"]]
    if "classification" in cfg["tasks"]:
        panels.append(("classification", "test_accuracy_mean", "test accuracy"))
    fig = Figure(figsize=(5.2 * len(panels) + 1.6, 4.4))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    cmap = __import__("matplotlib").colormaps["tab20"]
    markers = "osD^v<>phX*P8"
    for ax, (task, key, title) in zip(axes, panels):
        for j, name in enumerate(cfg["methods"]):
            rows = sorted((r for r in result["results"] if r["task"] == task and r["method"] == name),
                          key=lambda r: r["heterogeneity"])
            hs = [r["heterogeneity"] for r in rows]
            m = [r["summary"][key]["mean"] for r in rows]
            sd = [r["summary"][key]["std"] for r in rows]
            m = [np.nan if v is None else v for v in m]
            sd = [np.nan if v is None else v for v in sd]
            # personalised methods (each client keeps its own model: ``Method.personalised``) solid,
            # one-global-model ones dashed
            personal = _personalised(name)
            ax.errorbar(np.asarray(hs) + 0.006 * (j - len(cfg["methods"]) / 2), m, yerr=sd, label=name,
                        color=cmap(j % 20), marker=markers[j % len(markers)], ms=4, capsize=2,
                        lw=1.8 if personal else 1.0, ls="-" if personal else "--")
        refs = sorted((r for r in result["references"] if r["task"] == task), key=lambda r: r["heterogeneity"])
        ref_key = "bayes_test_accuracy" if key == "test_accuracy_mean" else "bayes_test_loss"
        ax.plot([r["heterogeneity"] for r in refs], [r[ref_key]["unweighted"]["mean"] for r in refs],
                "k--", lw=1, label="truth $W_k^*$")
        ax.set_xlabel("heterogeneity h  ($W_k^* = S + h P_k$)")
        ax.set_title(f"{task}: {title}")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"synthetic compare — {plural(cfg['clients'], 'client')}, {plural(cfg['seeds'], 'seed')}, "
                 f"rank {cfg['rank']}, {plural(cfg['rounds'], 'round')} × {plural(cfg['local_steps'], 'step')}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / (5.2 * len(panels) + 1.6), 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path

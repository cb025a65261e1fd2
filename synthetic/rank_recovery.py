"""The rank-recovery experiment: PF2LoRA vs HetLoRA ([PF2LoRA] §5, Fig. 2, App. C).

Every seed is an independent two-client federation; all seeds × clients train at once as the
replicas of one stacked ``LoRALinear`` (W0 = 0), driven by the same simulator and Method classes
the LLM path uses. Per round (after synchronisation) we record, for each client, train/test MSE,
‖Ŵ_k − W_k*‖_F, both rank estimates, and the bytes up/down measured from the payloads.
"""
from __future__ import annotations

import dataclasses
import math
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError, did_you_mean
from fedlora.methods import build
from fedlora.seeds import RANK_RECOVERY, seed_of
from fedlora.simulator import Federation, run_rounds

from . import _worker
from .closed_forms import best_two_level_fit, mse, reduced_rank_regression
from .data import GROUND_TRUTHS, make_clients, per_client
from .rank import numerical_rank, rank90

__all__ = ["RankRecoveryConfig", "PRESETS", "run_rank_recovery", "summarise"]

METHODS = ("pf2lora", "hetlora")

#: ``paper``: App. C verbatim. ``tuned``: chosen by the grid of ``fedlora synthetic tune``
#: (selection on training loss of held-out seeds; see docs/tutorials/rank-recovery.md, "Choosing the tuned preset").
PRESETS: dict[str, dict[str, Any]] = {
    "paper": dict(steps=2000, upper_lr=0.005, lower_lr=0.002, het_lr=0.002),
    "tuned": dict(steps=3000, upper_lr=0.05, lower_lr=0.1, upper_schedule="cosine", het_lr=0.05),
}


@dataclass
class RankRecoveryConfig:
    """One validated configuration of ``fedlora synthetic rank-recovery`` (paper's defaults)."""

    ground_truth: str = "independent"
    seeds: int = 1
    seed_offset: int = 0
    methods: tuple[str, ...] = METHODS
    steps: int = 2000
    interval: int = 10
    dim: int = 10
    n_samples: int = 1000
    n_train: int = 700
    true_ranks: tuple[int, ...] = (3, 4)
    noise_std: tuple[float, ...] = (0.1, 0.2)
    shared_rank: int = 2
    batch_size: int = 0  # 0 = full batch (deterministic gradients)
    # PF2LoRA (App. C): r = 4, r̃ = 2, upper lr 0.005 (AdamW), lower lr 0.002 (SGD)
    rank: int = 4
    client_rank: int = 2
    upper_lr: float = 0.005
    lower_lr: float = 0.002
    upper_optimizer: str = "adamw"
    upper_schedule: str = "constant"  # or "cosine": decay the upper step to 0 over --steps
    hypergradient: str = "exact"
    # HetLoRA (App. C): r_min 1, r_max 12, ranks 2 and 10, penalty 0.1 on the last 30 %, lr 0.002
    het_lr: float = 0.002
    het_r_min: int = 1
    het_r_max: int = 12
    het_initial_ranks: tuple[int, ...] = (2, 10)
    het_penalty: float = 0.1
    het_gamma: float = 0.7  # penalise/prune the last 30 % of the ranks (App. C: "γ = 0.3" read as 1 − γ)
    rank_tol: float = 0.02
    preset: str = "paper"
    # Worker processes for the methods (0 = one per method, capped by the CPU count; 1 = all in this
    # process). The methods are independent and each is seeded on its own, so the numbers do not
    # depend on it; a process runs one method on one core (the steps are too small to use threads).
    jobs: int = 0

    def validate(self) -> "RankRecoveryConfig":
        def need(cond: bool, flag: str, allowed: str, got: Any) -> None:
            if not cond:
                raise ConfigError(f"--{flag}: must be {allowed}, got {got!r}")

        # one value of a per-client option (--noise-std 0.3) is every client's; the true ranks say how
        # many clients there are
        if isinstance(self.true_ranks, int) and not isinstance(self.true_ranks, bool):
            self.true_ranks = (self.true_ranks,)
        need(isinstance(self.true_ranks, (list, tuple)), "true-ranks", "one rank per client", self.true_ranks)
        self.true_ranks = tuple(self.true_ranks)
        self.noise_std = per_client(self.noise_std, len(self.true_ranks))
        self.het_initial_ranks = per_client(self.het_initial_ranks, len(self.true_ranks))

        need(self.ground_truth in GROUND_TRUTHS, "ground-truth", f"one of {', '.join(GROUND_TRUTHS)}", self.ground_truth)
        need(self.preset in PRESETS, "preset", f"one of {', '.join(PRESETS)}", self.preset)
        need(isinstance(self.seeds, int) and self.seeds >= 1, "seeds", "an integer ≥ 1", self.seeds)
        need(self.seed_offset >= 0, "seed-offset", "≥ 0", self.seed_offset)
        need(len(self.methods) >= 1 and all(m in METHODS for m in self.methods), "methods",
             f"a non-empty list from {', '.join(METHODS)}", ",".join(self.methods))
        need(self.steps >= 1, "steps", "an integer ≥ 1", self.steps)
        need(self.interval >= 1, "interval", "an integer ≥ 1", self.interval)
        need(self.steps % self.interval == 0, "steps", f"a multiple of --interval ({self.interval})", self.steps)
        need(self.dim >= 1, "dim", "≥ 1", self.dim)
        need(0 < self.n_train < self.n_samples, "n-train", f"in (0, n_samples={self.n_samples})", self.n_train)
        need(len(self.true_ranks) >= 1, "true-ranks", "one rank per client", self.true_ranks)
        need(all(1 <= r <= self.dim for r in self.true_ranks), "true-ranks", f"in [1, dim={self.dim}]", self.true_ranks)
        need(len(self.noise_std) == len(self.true_ranks), "noise-std", f"one value per client ({len(self.true_ranks)})", self.noise_std)
        need(all(s >= 0 for s in self.noise_std), "noise-std", "≥ 0", self.noise_std)
        need(0 <= self.shared_rank <= min(self.true_ranks), "shared-rank", f"in [0, min(true ranks)={min(self.true_ranks)}]", self.shared_rank)
        need(0 <= self.batch_size <= self.n_train, "batch-size", f"0 (full batch) or in [1, n_train={self.n_train}]", self.batch_size)
        need(1 <= self.rank <= self.dim, "rank", f"in [1, dim={self.dim}]", self.rank)
        need(1 <= self.client_rank < self.rank, "client-rank", f"in [1, --rank={self.rank}) (r̃ < r)", self.client_rank)
        for flag, v in (("upper-lr", self.upper_lr), ("lower-lr", self.lower_lr), ("het-lr", self.het_lr)):
            need(v > 0 and math.isfinite(v), flag, "a finite number > 0", v)
        need(self.upper_optimizer in ("adamw", "sgd"), "upper-optimizer", "adamw or sgd", self.upper_optimizer)
        need(self.upper_schedule in ("constant", "cosine"), "upper-schedule", "constant or cosine", self.upper_schedule)
        need(self.hypergradient in ("exact", "finite-difference", "none"), "hypergradient",
             "exact, finite-difference or none", self.hypergradient)
        need(1 <= self.het_r_min <= self.het_r_max, "het-r-max",
             "≥ --het-r-min ≥ 1 (r_max may exceed dim: App. C uses 12 on 10×10)", (self.het_r_min, self.het_r_max))
        need(len(self.het_initial_ranks) == len(self.true_ranks), "het-initial-ranks",
             f"one rank per client ({len(self.true_ranks)})", self.het_initial_ranks)
        need(all(self.het_r_min <= r <= self.het_r_max for r in self.het_initial_ranks), "het-initial-ranks",
             f"in [r_min={self.het_r_min}, r_max={self.het_r_max}]", self.het_initial_ranks)
        need(self.het_penalty >= 0, "het-penalty", "≥ 0", self.het_penalty)
        need(0 < self.het_gamma < 1, "het-gamma", "in (0, 1)", self.het_gamma)
        need(0 < self.rank_tol < 1, "rank-tol", "in (0, 1)", self.rank_tol)
        need(isinstance(self.jobs, int) and self.jobs >= 0, "jobs", "an integer ≥ 0 (0 = automatic)", self.jobs)
        return self

    @classmethod
    def from_preset(cls, preset: str = "paper", **overrides: Any) -> "RankRecoveryConfig":
        if preset not in PRESETS:
            raise ConfigError(f"--preset: must be one of {', '.join(PRESETS)}, got {preset!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            named = ", ".join(f"{k!r}{did_you_mean(k, fields)}" for k in unknown)
            raise ConfigError(f"unknown rank-recovery option(s) {named}; allowed: {', '.join(sorted(fields))}")
        return cls(**{**PRESETS[preset], **overrides, "preset": preset}).validate()


@dataclass
class _Stacked:
    """All seeds × clients as replicas: tensors (G, n, d), G = seeds·K, group-major."""

    X_train: torch.Tensor
    Y_train: torch.Tensor
    X_test: torch.Tensor
    Y_test: torch.Tensor
    W_star: torch.Tensor  # (G, d_in, d_out)
    seeds: list[int]
    n_clients: int
    true_ranks: list[int] = field(default_factory=list)


def _make_data(cfg: RankRecoveryConfig) -> _Stacked:
    feds = [make_clients(cfg.ground_truth, cfg.seed_offset + s, ranks=tuple(cfg.true_ranks),
                         shared_rank=cfg.shared_rank, d_in=cfg.dim, d_out=cfg.dim, n_samples=cfg.n_samples,
                         n_train=cfg.n_train, noise_std=tuple(cfg.noise_std)) for s in range(cfg.seeds)]
    flat = [c for fed in feds for c in fed]

    def st(attr):
        return torch.stack([getattr(c, attr) for c in flat])

    return _Stacked(st("X_train"), st("Y_train"), st("X_test"), st("Y_test"), st("W_star"),
                    [cfg.seed_offset + s for s in range(cfg.seeds)], len(cfg.true_ranks), list(cfg.true_ranks))


def _group_generators(cfg: "RankRecoveryConfig", seeds: list[int], method: str) -> list[torch.Generator]:
    """One generator per (seed, method): a seed's numbers never depend on how many seeds run."""
    return [torch.Generator().manual_seed(seed_of(s, RANK_RECOVERY, METHODS.index(method))) for s in seeds]


def _init_pf2lora(layer: LoRALinear, fed: Federation, gens: list[torch.Generator]) -> None:
    """App. C: A, C, D ~ N(0, 1), B = 0, and the row space of C_k orthogonal to that of A."""
    with torch.no_grad():
        _, r, d_in = layer.lora_A.shape
        for grp, g in enumerate(gens):
            A = torch.randn(r, d_in, generator=g, dtype=layer.lora_A.dtype)
            Q, _ = torch.linalg.qr(A.T)  # (d_in, r) basis of A's row space
            for i in fed.replicas_of(grp):  # the common adapter starts equal within a federation
                C = torch.randn(layer.client_rank, d_in, generator=g, dtype=A.dtype)
                C_perp = C - (C @ Q) @ Q.T
                C_perp *= C.norm(dim=-1, keepdim=True) / C_perp.norm(dim=-1, keepdim=True)
                layer.lora_A[i] = A
                layer.lora_C[i] = C_perp
                layer.lora_D[i] = torch.randn(layer.lora_D.shape[1:], generator=g, dtype=A.dtype)
        layer.lora_B.zero_()


def _init_hetlora(layer: LoRALinear, fed: Federation, gens: list[torch.Generator]) -> None:
    """App. C: the server's rank-r_max A ~ N(0, 1), B = 0; clients receive it truncated."""
    with torch.no_grad():
        _, r, d_in = layer.lora_A.shape
        for grp, g in enumerate(gens):
            A = torch.randn(r, d_in, generator=g, dtype=layer.lora_A.dtype)
            for i in fed.replicas_of(grp):
                layer.lora_A[i] = A
        layer.lora_B.zero_()


def _run_method(name: str, cfg: RankRecoveryConfig, data: _Stacked) -> tuple[list[dict], dict[str, Any]]:
    fed = Federation(n_groups=len(data.seeds), n_clients=data.n_clients)
    G, d = fed.n_replicas, cfg.dim
    gens = _group_generators(cfg, data.seeds, name)
    if name == "pf2lora":
        layer = LoRALinear(d, d, cfg.rank, client_rank=cfg.client_rank, stack=G, dtype=torch.float64)
        _init_pf2lora(layer, fed, gens)
        # Alg. 1 line 8 averages with 1/M: uniform weights (the federation's default).
        method = build("pf2lora", dict(rank=cfg.rank, client_rank=cfg.client_rank, upper_lr=cfg.upper_lr,
                                       lower_lr=cfg.lower_lr, upper_optimizer=cfg.upper_optimizer,
                                       hypergradient=cfg.hypergradient, upper_schedule=cfg.upper_schedule,
                                       total_steps=cfg.steps))
    else:
        layer = LoRALinear(d, d, cfg.het_r_max, stack=G, dtype=torch.float64)
        _init_hetlora(layer, fed, gens)
        method = build("hetlora", dict(lr=cfg.het_lr, r_min=cfg.het_r_min, r_max=cfg.het_r_max, gamma=cfg.het_gamma,
                                       penalty=cfg.het_penalty, initial_ranks=cfg.het_initial_ranks))
    method.setup(layer, fed.replica_clients)

    def objective(params, batch):
        X, Y, const, denom = batch
        sq = ((layer.forward_with(params, X) - Y) ** 2).sum(dim=(-2, -1))
        return (sq + const) / denom

    n = cfg.n_train
    if cfg.batch_size:
        zero = torch.zeros(G, dtype=torch.float64)
        denom = float(cfg.batch_size * d)

        g = gens[0]  # minibatch draws: one stream for the whole stack (seeded by the first seed)

        def sample():
            idx = torch.randint(0, n, (G, cfg.batch_size), generator=g)
            take = idx[..., None].expand(-1, -1, d)
            return data.X_train.gather(1, take), data.Y_train.gather(1, take), zero, denom
    else:
        # Full batch: an exact sufficient-statistics reduction. With X = QR (thin QR, R d×d),
        # ‖XW − Y‖² = ‖RW − QᵀY‖² + (‖Y‖² − ‖QᵀY‖²), so the same adapter layer runs on d rows
        # instead of n — identical loss and gradients (to rounding), ~n/d times less work.
        Q, R = torch.linalg.qr(data.X_train)
        QtY = Q.transpose(-1, -2) @ data.Y_train
        const = (data.Y_train ** 2).sum(dim=(-2, -1)) - (QtY ** 2).sum(dim=(-2, -1))
        full = (R, QtY, const, float(n * d))

        def sample():
            return full

    def evaluate(rnd: int) -> dict[str, Any]:
        with torch.no_grad():
            W = layer.delta_weight().transpose(-1, -2)  # paper orientation (G, d_in, d_out)
            out = {
                "train_mse": mse(data.X_train, data.Y_train, W).tolist(),
                "test_mse": mse(data.X_test, data.Y_test, W).tolist(),
                "distance": torch.linalg.matrix_norm(W - data.W_star).tolist(),
                "rank90": rank90(W).tolist(),
                "numerical_rank": numerical_rank(W, cfg.rank_tol).tolist(),
            }
            if name == "hetlora":
                out["client_rank"] = method.ranks.tolist()
            return out

    t0 = time.perf_counter()
    history = run_rounds(method, fed, objective, sample, cfg.steps // cfg.interval, cfg.interval, evaluate)
    with torch.no_grad():
        final_W = layer.delta_weight().transpose(-1, -2)
    extra = {"wall_s": time.perf_counter() - t0, "final_W": final_W,
             "final_client_rank": method.ranks.tolist() if name == "hetlora" else None}
    return history, extra


def _data_for(cfg: RankRecoveryConfig) -> _Stacked:
    torch.manual_seed(cfg.seed_offset)
    return _make_data(cfg)


class _Worker:
    """One method running in a child interpreter (``fedlora.synthetic._worker``); ``result()`` waits for it.
    The child is one ``_worker.prestart`` started if there is one (it has imported torch meanwhile), else a new one."""

    def __init__(self, name: str, cfg: RankRecoveryConfig) -> None:
        self.name = name
        self.proc = _worker.take() or _worker.spawn()
        # Send the job now (a few hundred bytes: never blocks on the pipe) so the child starts at once.
        self.proc.stdin.write(pickle.dumps((name, cfg, torch.get_num_threads())))
        self.proc.stdin.close()
        self.proc.stdin = None  # so communicate() only reads

    def result(self) -> tuple[list[dict], dict[str, Any]]:
        out, err = self.proc.communicate()
        if self.proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no message)"]
            raise RuntimeError(f"rank-recovery worker for {self.name} failed: {tail[0]}")
        return pickle.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _start_workers(cfg: RankRecoveryConfig, names: list[str]) -> dict[str, _Worker]:
    """Start the first of ``names`` in child processes, at most ``jobs − 1`` of them (this process is one job)."""
    if not sys.executable:  # an embedded interpreter cannot start a child: run everything here
        return {}
    return {n: _Worker(n, cfg) for n in names[:_worker.workers_needed(len(cfg.methods), cfg.jobs)]}


def run_rank_recovery(cfg: RankRecoveryConfig, *, log=print, while_waiting=None) -> dict[str, Any]:
    """Run the experiment and return the JSON-serialisable result (schema: docs/reference/metrics-json.md).

    With ``cfg.jobs`` ≠ 1 the first method (PF2LoRA by default, the longest) runs in a worker process
    started first, and the last (HetLoRA) in this process, which also computes the oracles meanwhile; the
    result is the same either way. ``while_waiting()``, if given, runs once this process has done its own
    part, before it waits for the workers (``fedlora synthetic rank-recovery`` imports matplotlib there);
    without workers it is not called.
    """
    cfg.validate()
    workers = _start_workers(cfg, list(cfg.methods[:-1]))
    try:
        return _run_rank_recovery(cfg, workers, log, while_waiting)
    finally:
        for w in workers.values():
            w.kill()


def _run_rank_recovery(cfg: RankRecoveryConfig, workers: dict, log, while_waiting=None) -> dict[str, Any]:
    data = _data_for(cfg)
    S, K = len(data.seeds), data.n_clients
    t0 = time.perf_counter()
    # Oracles: RRR at the true rank (Reinsel & Velu Thm 2.2) fitted on each client's train split.
    oracle_W = torch.stack([reduced_rank_regression(data.X_train[i], data.Y_train[i], data.true_ranks[i % K])
                            for i in range(S * K)])
    oracle = mse(data.X_test, data.Y_test, oracle_W)
    shape4 = lambda t: t.reshape(S, K, *t.shape[1:])  # noqa: E731
    best_pf2 = best_two_level_fit(shape4(data.X_train), shape4(data.Y_train), cfg.rank, cfg.client_rank)
    best_pf2_mse = mse(shape4(data.X_test), shape4(data.Y_test), best_pf2).reshape(-1)
    best_pf2_rank90 = rank90(best_pf2).reshape(-1)
    oracle_s = time.perf_counter() - t0

    results = {}
    for name in sorted(cfg.methods, key=lambda n: n in workers):  # in-process ones first, then collect
        log(f"[rank-recovery] {name}: {S} seed(s) × {K} clients, {cfg.steps} steps, I = {cfg.interval}"
            + (" (worker process)" if name in workers else ""))
        if name in workers and while_waiting is not None:
            while_waiting()
            while_waiting = None
        results[name] = workers[name].result() if name in workers else _run_method(name, cfg, data)
        log(f"[rank-recovery] {name}: {results[name][1]['wall_s']:.1f} s")

    runs = []
    for name in cfg.methods:
        history, extra = results[name]
        cols = {key: [h[key] for h in history] for key in history[0]}
        final = history[-1]
        for s in range(S):
            reps = range(s * K, (s + 1) * K)
            clients = []
            for k, i in enumerate(reps):
                c = {
                    "client": k + 1,
                    "true_rank": data.true_ranks[k],
                    "rank90_truth": int(rank90(data.W_star[i])),
                    "rank90": final["rank90"][i],
                    "numerical_rank": final["numerical_rank"][i],
                    "train_mse": final["train_mse"][i],
                    "test_mse": final["test_mse"][i],
                    "distance": final["distance"][i],
                    "oracle_mse": float(oracle[i]),
                    "noise_mse": cfg.noise_std[k] ** 2,
                }
                if name == "pf2lora":
                    c["best_attainable_mse"] = float(best_pf2_mse[i])
                    c["best_attainable_rank90"] = int(best_pf2_rank90[i])
                else:
                    r_fin = extra["final_client_rank"][i]
                    c["client_rank"] = r_fin
                    # HetLoRA's client model has rank ≤ r_k: the RRR at rank r_k fitted on this client
                    # alone is the best it can reach (a lower bound: sharing the global can only hurt).
                    W_r = reduced_rank_regression(data.X_train[i], data.Y_train[i], r_fin)
                    c["best_attainable_mse"] = float(mse(data.X_test[i], data.Y_test[i], W_r))
                clients.append(c)
            hist = {"round": cols["round"], "step": cols["step"]}
            for key in ("train_mse", "test_mse", "distance", "rank90", "numerical_rank", "client_rank",
                        "bytes_up", "bytes_down"):
                if key in cols:
                    hist[key] = [[row[i] for i in reps] for row in cols[key]]
            runs.append({"seed": data.seeds[s], "method": name, "clients": clients, "history": hist})
    cfg_dict = dataclasses.asdict(cfg)
    return {"experiment": "rank-recovery", "schema_version": 1, "config": cfg_dict, "runs": runs,
            "summary": summarise(runs), "timing": {"oracles_s": oracle_s}}


def summarise(runs: list[dict]) -> list[dict]:
    """Per method and client: mean/std over seeds and recovery rates."""
    out = []
    for method in sorted({r["method"] for r in runs}):
        rs = [r for r in runs if r["method"] == method]
        for k in range(len(rs[0]["clients"])):
            cs = [r["clients"][k] for r in rs]
            t = torch.tensor([c["test_mse"] for c in cs], dtype=torch.float64)
            o = torch.tensor([c["oracle_mse"] for c in cs], dtype=torch.float64)
            b = torch.tensor([c["best_attainable_mse"] for c in cs], dtype=torch.float64)
            ratio = t / o
            out.append({
                "method": method, "client": k + 1, "true_rank": cs[0]["true_rank"], "seeds": len(cs),
                "test_mse_mean": float(t.mean()), "test_mse_std": float(t.std()) if len(cs) > 1 else 0.0,
                "oracle_mse_mean": float(o.mean()),
                "best_attainable_mse_mean": float(b.mean()),
                "test_over_oracle_max": float(ratio.max()), "test_over_oracle_min": float(ratio.min()),
                "rank90": [c["rank90"] for c in cs],
                "numerical_rank": [c["numerical_rank"] for c in cs],
                "rank90_recovered": sum(c["rank90"] == c["true_rank"] for c in cs) / len(cs),
                "numerical_rank_recovered": sum(c["numerical_rank"] == c["true_rank"] for c in cs) / len(cs),
            })
    return out

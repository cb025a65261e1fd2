"""Run any registered Method on stacked synthetic federations (the engine of ``synthetic compare``).

Every group (federation) g of ``n_clients`` clients is a block of replicas of ONE stacked
``LoRALinear`` with W0 = 0 (replica g·K + k is client k of federation g, as in
``fedlora.server.Federation``). Groups may differ in seed and in data (e.g. one group per
seed × heterogeneity level): a method's local step is per replica and its aggregation is per
federation, so stacking them is the same as running them one after another, only faster.

Objectives are full batch (deterministic gradients): the mean squared error over a client's samples
and outputs (regression) or the mean cross-entropy (classification). Clients may hold different
numbers of samples: shorter clients are padded with zero rows that a mask (classification) or the
zero input and target (regression: a zero row contributes exactly 0) keeps out of the loss; the same
mask keeps them out of H²Tune's eq. 7 output KL (``output_fn`` returns it with the logits).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.methods import Method, RuntimeFacts, build, method_parameters
from fedlora.payload import Payload
from fedlora.seeds import TESTBED_INIT, TESTBED_METHOD, seed_of
from fedlora.simulator import Federation, run_rounds

from .data import ClientTask
from .privacy import recorded_forward
from .rank import numerical_rank, rank90

__all__ = ["StackedData", "stack_federations", "build_method", "build_run", "SyntheticRun", "run_method", "RunResult"]


@dataclass
class StackedData:
    """Replicas g·K + k (group-major). X: (G, n_max, d_in); regression Y: (G, n_max, d_out) float,
    classification Y: (G, n_max) int64; mask: (G, n_max) 1 for real rows; n: (G,) sample counts."""

    task: str
    X_train: torch.Tensor
    Y_train: torch.Tensor
    mask_train: torch.Tensor
    n_train: torch.Tensor
    X_test: torch.Tensor
    Y_test: torch.Tensor
    mask_test: torch.Tensor
    n_test: torch.Tensor
    W_star: torch.Tensor  # (G, d_in, d_out), paper orientation
    group_seeds: list[int]
    n_clients: int
    d_in: int
    d_out: int
    # optional validation split carved from each client's training data (for step-size selection)
    X_val: torch.Tensor | None = None
    Y_val: torch.Tensor | None = None
    mask_val: torch.Tensor | None = None
    n_val: torch.Tensor | None = None

    @property
    def n_groups(self) -> int:
        return len(self.group_seeds)

    @property
    def client_sizes(self) -> list[int]:
        """n_k of each client of the first federation (every federation has the same sizes)."""
        return [int(n) for n in self.n_train[: self.n_clients]]


def _pad(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n_max = max(t.shape[0] for t in ts)
    out = ts[0].new_zeros(len(ts), n_max, *ts[0].shape[1:])
    mask = torch.zeros(len(ts), n_max, dtype=torch.float64)
    for i, t in enumerate(ts):
        out[i, : t.shape[0]] = t
        mask[i, : t.shape[0]] = 1.0
    return out, mask


def stack_federations(task: str, feds: Sequence[Sequence[ClientTask]], group_seeds: Sequence[int],
                      d_out: int, val_fraction: float = 0.0) -> StackedData:
    """Stack federations (each a list of K clients; client k has the same sample count in every
    federation). ``val_fraction`` > 0 holds out the last ⌈fraction·n_k⌉ training samples of each
    client as a validation split (never trained on)."""
    if len(feds) != len(group_seeds):
        raise ConfigError(f"stack_federations: {len(feds)} federations but {len(group_seeds)} seeds")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    K = len(feds[0])
    sizes = [c.X_train.shape[0] for c in feds[0]]
    for f in feds:
        if len(f) != K or [c.X_train.shape[0] for c in f] != sizes:
            raise ConfigError("stack_federations: every federation needs the same clients' sample counts")
    flat = [c for f in feds for c in f]
    n_val = [math.ceil(val_fraction * c.X_train.shape[0]) if val_fraction else 0 for c in flat]
    if any(c.X_train.shape[0] - v < 1 for c, v in zip(flat, n_val)):
        raise ConfigError(f"--val-fraction {val_fraction} leaves a client without training samples")
    cut = [c.X_train.shape[0] - v for c, v in zip(flat, n_val)]
    X_tr, m_tr = _pad([c.X_train[:n] for c, n in zip(flat, cut)])
    Y_tr, _ = _pad([c.Y_train[:n] for c, n in zip(flat, cut)])
    X_te, m_te = _pad([c.X_test for c in flat])
    Y_te, _ = _pad([c.Y_test for c in flat])
    data = StackedData(task, X_tr, Y_tr, m_tr, m_tr.sum(1), X_te, Y_te, m_te, m_te.sum(1),
                       torch.stack([c.W_star for c in flat]), list(group_seeds), K, X_tr.shape[-1], d_out)
    if val_fraction:
        data.X_val, data.mask_val = _pad([c.X_train[n:] for c, n in zip(flat, cut)])
        data.Y_val, _ = _pad([c.Y_train[n:] for c, n in zip(flat, cut)])
        data.n_val = data.mask_val.sum(1)
    return data


def build_method(name: str, lr: float, options: Mapping[str, Any], lr_arg: str = "lr", *, seed: Any = None,
                 client_weights: Sequence[float] | None = None) -> Method:
    """``fedlora.methods.build`` with the step size ``lr`` as option ``lr_arg``; an unknown option
    becomes a one-line ``ConfigError``."""
    allowed = list(method_parameters(name))
    if lr_arg not in allowed:
        raise ConfigError(f"{name}: has no step-size option {lr_arg!r}; allowed: {', '.join(allowed)}")
    return build(name, {**options, lr_arg: lr}, seed=seed, client_weights=client_weights)


def _init_layer(layer: LoRALinear, fed: Federation, seeds: Sequence[int], name: str, adapter: Mapping[str, Any]) -> None:
    """PEFT init (A, C Kaiming-uniform, B = D = 0, TriLoRA R = 0, Φ = 1), one draw per (seed, method),
    broadcast to every client of that federation: all clients start from the server's adapter."""
    one = LoRALinear(layer.in_features, layer.out_features, dtype=layer.lora_A.dtype, **adapter)
    with torch.no_grad():
        for g, seed in enumerate(seeds):
            one.reset_parameters(generator=torch.Generator().manual_seed(seed_of(seed, TESTBED_INIT, name)))
            idx = list(fed.replicas_of(g))
            for n, p in one.named_parameters():
                getattr(layer, n)[idx] = p.expand(len(idx), *p.shape)


@dataclass
class RunResult:
    """Final per-replica metrics (lists of length G) and the per-round records of ``run_rounds``."""

    history: list[dict[str, Any]]
    final: dict[str, list]
    wall_s: float
    error: str | None = None
    #: every replica's final client state record (``Method.replica_state``), with ``keep_records``
    records: list[dict[str, torch.Tensor]] | None = None
    #: with ``record_payloads``: every upload ("up") and download ("down") as (replica, ``Payload``), in order
    payloads: dict[str, list[tuple[int, Payload]]] | None = None


def _objectives(layer: LoRALinear, data: StackedData):
    """(train objective, its full batch, a per-replica evaluation function of params, output_fn).

    ``output_fn(params, batch) -> (logits (G, n_max, C), mask (G, n_max))`` for classification (the
    mask keeps padded rows out of H²Tune's eq. 7 KL), ``None`` for regression (no logits)."""
    output_fn = None
    G, d_out = data.X_train.shape[0], data.d_out
    if data.task == "regression":
        # Exact sufficient-statistics reduction (as rank_recovery): with X = QR,
        # ‖XW − Y‖² = ‖RW − QᵀY‖² + (‖Y‖² − ‖QᵀY‖²); zero padding rows change neither side.
        Q, R = torch.linalg.qr(data.X_train)
        QtY = Q.transpose(-1, -2) @ data.Y_train
        const = (data.Y_train ** 2).sum(dim=(-2, -1)) - (QtY ** 2).sum(dim=(-2, -1))
        batch = (R, QtY, const, data.n_train * d_out)

        def objective(params, b):
            X, Y, c, denom = b
            return (((layer.forward_with(params, X) - Y) ** 2).sum(dim=(-2, -1)) + c) / denom

        def metrics(params, X, Y, mask, n):
            err = ((layer.forward_with(params, X) - Y) ** 2).sum(-1) * mask
            return {"loss": err.sum(-1) / (n * d_out)}
    else:
        batch = (data.X_train, data.Y_train, data.mask_train, data.n_train)

        def output_fn(params, b):  # recorded under sample-level DP: eq. 7's KL reaches the per-example gradients
            return recorded_forward(layer, params, b[0]), b[2]

        def objective(params, b):
            X, y, mask, n = b
            logits = layer.forward_with(params, X)
            ce = F.cross_entropy(logits.reshape(-1, d_out), y.reshape(-1), reduction="none").view(G, -1)
            return (ce * mask).sum(-1) / n

        def metrics(params, X, y, mask, n):
            logits = layer.forward_with(params, X)
            ce = F.cross_entropy(logits.reshape(-1, d_out), y.reshape(-1), reduction="none").view(G, -1)
            hit = (logits.argmax(-1) == y).to(torch.float64)
            return {"loss": (ce * mask).sum(-1) / n, "accuracy": (hit * mask).sum(-1) / n}
    return objective, batch, metrics, output_fn


@dataclass
class SyntheticRun:
    """One method set up on stacked federations (``build_run``): what ``run_method`` trains and the Flower
    runtime rebuilds on each node (``fedlora.synthetic.flower``). ``objective(params, batch)`` gives the
    per-replica training loss (G,); ``metrics`` and ``output_fn`` as ``_objectives``."""

    name: str
    method: Method
    federation: Federation
    layer: LoRALinear
    objective: Any
    batch: Any
    metrics: Any
    data: StackedData

    def sample(self):
        return self.batch

    def train_loss(self) -> list[float]:
        """Every replica's training loss with the parameters it holds now."""
        with torch.no_grad():
            return self.objective(dict(self.layer.named_parameters()), self.batch).tolist()


def build_run(name: str, data: StackedData, *, lr: float, options: Mapping[str, Any] | None = None,
              adapter: Mapping[str, Any] | None = None, lr_arg: str = "lr",
              client_weights: Sequence[float] | None = None, sample_fraction: float = 1.0,
              sample_seed: int = 0) -> SyntheticRun:
    """``name`` built and set up on every federation of ``data`` (arguments as ``run_method``)."""
    weights = [float(w) for w in client_weights] if client_weights is not None else data.client_sizes
    # Centralized pools with the federation's w_k; methods' own draws (H²Tune's R, FLoRA's fresh
    # adapters): one seed per federation
    method = build_method(name, lr, dict(options or {}), lr_arg, client_weights=weights,
                          seed=[seed_of(s, TESTBED_METHOD, name) for s in data.group_seeds])
    adapter = dict(adapter) if adapter is not None else dict(method.adapter_kwargs())
    fed = Federation(n_groups=data.n_groups, n_clients=data.n_clients, client_weights=weights,
                     sample_fraction=sample_fraction, sample_seed=sample_seed)
    G = fed.n_replicas
    layer = LoRALinear(data.d_in, data.d_out, stack=G, dtype=torch.float64, **adapter)
    objective, batch, metrics, output_fn = _objectives(layer, data)
    # every replica holds its own base; H²Tune's eq. 7 needs the logits of a batch as well as the loss (see
    # its docstring), and the padding mask so that its KL is a mean over each client's real rows
    method.use_runtime(RuntimeFacts(shared_base=False, output_fn=output_fn))
    _init_layer(layer, fed, data.group_seeds, name, adapter)
    # Methods that draw from the global RNG (e.g. random masks) get a stream fixed by the run.
    torch.manual_seed(seed_of(data.group_seeds[0], TESTBED_INIT, name))
    method.setup(layer, fed.replica_clients)
    return SyntheticRun(name, method, fed, layer, objective, batch, metrics, data)


def run_method(name: str, data: StackedData, *, lr: float, rounds: int, local_steps: int,
               options: Mapping[str, Any] | None = None, adapter: Mapping[str, Any] | None = None,
               lr_arg: str = "lr", client_weights: Sequence[float] | None = None,
               rank_tol: float = 0.02, record_payloads: bool = False, sample_fraction: float = 1.0,
               sample_seed: int = 0, keep_records: bool = False, privacy: Any = None) -> RunResult:
    """Train ``name`` on every federation of ``data`` at once; evaluate each client's final model.

    ``adapter``: ``LoRALinear`` keyword arguments; default ``method.adapter_kwargs()``.
    ``client_weights``: w_k (default n_k, docs/design.md §3). Each client is evaluated on the parameters it
    holds after the last download, or on ``method.personalised_params`` where the method defines it
    (Per-FedAvg's one local step). Numerical failures (NaN, a failed factorisation) do not raise:
    they come back as ``error`` and non-finite metrics, so a step-size grid can go on.
    ``record_payloads``: also keep every upload/download ``Payload`` (for byte accounting tests).
    ``sample_fraction``, ``sample_seed``: client sampling per round (``fedlora.server.Federation``).
    ``keep_records``: also keep every replica's final client state record (``RunResult.records``: adapter,
    optimizer moments, method state), e.g. to compare with the records a Flower run's nodes keep.
    ``privacy``: a ``synthetic.privacy.TestbedPrivacy`` — sample-level DP-SGD in every local step (Poisson batches,
    per-example clipping, noise per federation, client, round and step); each round record then has ``privacy``
    (ε per client from the rounds it took part in). Evaluation is unchanged (every replica's full splits).
    """
    run = build_run(name, data, lr=lr, options=options, adapter=adapter, lr_arg=lr_arg,
                    client_weights=client_weights, sample_fraction=sample_fraction, sample_seed=sample_seed)
    method, fed, layer, objective, batch, metrics = run.method, run.federation, run.layer, run.objective, run.batch, run.metrics
    G = fed.n_replicas
    sample = run.sample
    sample_dp = None
    train_objective, train_sample = objective, sample
    if privacy is not None:
        from .privacy import dp_objective, dp_sampler, make_sample_dp

        if method.sample_dp_refusal is not None:  # before σ's calibration (seconds)
            method.set_sample_dp(privacy)  # raises the method's one-line refusal
        if method.pooled_data:
            raise ConfigError(f"{name}: sample-level DP on the testbed: its pooled model is trained from each client's "
                              "replica, not from one pooled data set (fedlora run pools the rows: use it there)")
        sample_dp = make_sample_dp(privacy, data.client_sizes, data.group_seeds, rounds, local_steps,
                                   int(method.sample_dp_releases))
        method.set_sample_dp(sample_dp)
        train_objective, train_sample = dp_objective(layer, data.task, data.d_out), dp_sampler(data, sample_dp)

    payloads: dict[str, list[tuple[int, Payload]]] = {"up": [], "down": []}

    def keep(direction: str, replica: int, payload: Payload) -> None:  # keep, do not change, what is sent
        payloads[direction].append((replica, payload))

    def evaluate(rnd: int) -> dict[str, Any]:
        return {"train_loss": run.train_loss()}

    t0 = time.perf_counter()
    error = None
    try:
        with warnings.catch_warnings():
            if data.task == "regression":  # expected: H²Tune's output KL is for classifiers (docs/methods/h2tune.md)
                warnings.filterwarnings("ignore", message="h2tune: no output_fn")
            history = run_rounds(method, fed, train_objective, train_sample, rounds, local_steps, evaluate,
                                 on_payload=keep if record_payloads else None, sample_dp=sample_dp,
                                 dp_delta=None if privacy is None else privacy.delta)
    except (RuntimeError, ValueError, ArithmeticError) as e:
        diverged = not all(torch.isfinite(p).all() for p in layer.parameters())
        if isinstance(e, ConfigError) and not diverged:
            raise  # a real configuration problem, not a step size that blew up
        # Divergence (NaN weights make aggregation refuse, factorisations fail) or a method's own
        # failure: recorded, so a step-size grid over many methods can go on.
        msg = str(e).splitlines()[0] if str(e) else ""
        history, error = [], f"{'diverged: ' if diverged else ''}{type(e).__name__}: {msg}"[:300]
    wall = time.perf_counter() - t0
    final = _final_metrics(layer, method, objective, sample, metrics, data, rank_tol) if error is None else \
        _failed_metrics(G, data)
    return RunResult(history, final, wall, error,
                     [method.replica_state(i) for i in range(G)] if keep_records and error is None else None,
                     payloads if record_payloads else None)


def _final_metrics(layer, method, objective, sample, metrics, data: StackedData, rank_tol: float) -> dict[str, list]:
    params = dict(layer.named_parameters())
    personal = method.personalised_params(objective, sample)
    if personal is not None:
        params = {**params, **dict(personal)}
    with torch.no_grad():
        train = metrics(params, data.X_train, data.Y_train, data.mask_train, data.n_train)
        test = metrics(params, data.X_test, data.Y_test, data.mask_test, data.n_test)
        G = data.X_train.shape[0]
        eye = torch.eye(data.d_in, dtype=torch.float64).expand(G, -1, -1)
        # The client's learned map in the paper's orientation: x ↦ x·W (W0 = 0 at the start, so
        # this is ΔW — including whatever a method merged into W0, as FLoRA does every round).
        W = layer.forward_with(params, eye)
        ok = torch.isfinite(W).all(dim=(-2, -1))
        W_safe = torch.where(ok[:, None, None], W, torch.zeros_like(W))
        r90 = torch.where(ok, rank90(W_safe), torch.full_like(ok, -1, dtype=torch.int64))
        nr = torch.where(ok, numerical_rank(W_safe, rank_tol), torch.full_like(ok, -1, dtype=torch.int64))
        dist = torch.linalg.matrix_norm(W - data.W_star)
        val = (metrics(params, data.X_val, data.Y_val, data.mask_val, data.n_val)
               if data.X_val is not None else None)
    out = {"train_loss": train["loss"].tolist(), "test_loss": test["loss"].tolist(),
           "rank90": r90.tolist(), "numerical_rank": nr.tolist(), "distance": dist.tolist()}
    if val is not None:
        out["val_loss"] = val["loss"].tolist()
    if "accuracy" in test:
        out["train_accuracy"] = train["accuracy"].tolist()
        out["test_accuracy"] = test["accuracy"].tolist()
        if val is not None:
            out["val_accuracy"] = val["accuracy"].tolist()
    return out


def _failed_metrics(G: int, data: StackedData) -> dict[str, list]:
    nan = [float("nan")] * G
    out = {"train_loss": nan, "test_loss": nan, "rank90": [-1] * G, "numerical_rank": [-1] * G, "distance": nan}
    if data.X_val is not None:
        out["val_loss"] = nan
    if data.task == "classification":
        out["train_accuracy"] = out["test_accuracy"] = nan
        if data.X_val is not None:
            out["val_accuracy"] = nan
    return out

"""SecAgg+ on Flower 1.42 for fedlora uploads: the server learns only the weighted mean of a round's uploads.

Built on the API through which Flower 1.42's SecAgg+ works — the legacy one: a ServerApp whose main wraps
its context in ``LegacyContext`` and runs ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``, and a
``client_fn``/``NumPyClient`` ClientApp with ``secaggplus_mod``. (A Message-API ClientApp with the mod fails:
the server logs "Secure aggregation halted" and the run still exits 0 with no aggregate — so
``run_secagg_simulation`` raises when a round ends without one.)

One round: each client's ``Payload`` (from a *provider*, ``"module:function"`` called on the client as
``provider(partition, config) -> (Payload, weight)``) is flattened to float64 arrays in sorted name order
(``fedlora.secagg.flatten_payload``), checked against the clipping range (``SecAggQuantisation.check_values``:
an error, never Flower's silent clip) and handed to Flower with its weight as ``num_examples``; the mod
quantises and masks it; the server's workflow unmasks only the sum and hands the strategy (``_MeanOnly``)
the weighted mean Σ_k p̃_k x_k — every ``FitRes`` it receives carries that same aggregate, never one
client's arrays. Error bound and weights: ``fedlora.secagg``.

**In ``fedlora run``** (``privacy.secagg.enabled``, ``--runtime flower``): ``SecAggExecutor`` is the run's
``FlowerExecutor`` with two differences: no message ever asks a node for its client's record (``records``
refuses; each node keeps its client's checkpoints itself — ``save_records`` / ``load_records`` — and the run's
adapters/ holds the global adapter only), and its ``train``: each round is one SecAgg+ fit — Flower's
``SecAggPlusWorkflow`` called once per round by ``fedlora.server.Server.run_round`` (the one round protocol; no
``DefaultWorkflow`` loop), over a ``LegacyContext`` whose strategy hands each participant a ``FitIns`` carrying
exactly what its ``train`` message would (the run's config, its download) and its weight as num_examples. On the
node, ``fedlora.flower_client`` runs SecAgg+ train messages through ``secaggplus_mod``, whose fit stage
(``_node_fit``, registered as ``NODE_HANDLERS["secagg-fit"]``) turns the legacy fit into the node's ordinary
``train`` message, trains with the same handler (``fedlora.flower._client_train``: the
client's record saved in its node state as usual), and answers ``secaggplus_mod`` with the upload as a legacy
``FitRes`` (range-checked; loss, ranks and bytes in its metrics, in clear). ``train`` returns ONE pre-summed
``ClientUpdate`` under ``fedlora.server.SUMMED`` (``fedlora.secagg.summed_payload``) and, per participant, an
empty upload with its masked vector's bytes; the server calls ``method.aggregate([summed], [1.0])`` — equal to
``aggregate(uploads, weights)`` for every method of ``fedlora.secagg.SUM_METHODS`` (tested). A round that ends
without an aggregate (SecAgg+ halted: Flower exits 0) raises ``RoundFailed`` naming the round. Client-level DP
(``client_dp_clip``): each node clips its update against the reference the server sends
(``fedlora.server.Download.dp_reference``) and uploads it with weight 1; the server noises the sum
(``fedlora.privacy.client_dp.ClientDP.aggregate_presummed``).

Reproducible: Flower's stochastic rounding draws from NumPy's global generator right after the client's
``fit`` returns, so ``fit`` seeds it from the round's ``rounding_seed`` and the client's partition; the masks
(``os.urandom``) cancel exactly, so the same seeds give the same aggregate to the bit.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from . import flower_client
from .errors import ConfigError
from .payload import Payload
from .secagg import SecAggQuantisation, flatten_payload, share_settings

__all__ = ["SecAggRound", "SecAggRoundFailed", "run_secagg_simulation", "secagg_client_app", "SecAggClient", "testbed_upload",
           "testbed_uploads", "SecAggExecutor", "secagg_client_mod"]


class SecAggRoundFailed(ConfigError):
    """A round that ended without an aggregate (one line: which round, how many uploads, why). ``done``: the
    aggregates of the rounds before it; ``record``: what the server side saw."""

    def __init__(self, message: str, done: list, record: "SecAggRecord") -> None:
        super().__init__(message)
        self.done, self.record = done, record


@dataclass(frozen=True)
class SecAggRound:
    """One SecAgg+ round: ``provider`` ("module:function", importable on every client), ``config`` (its
    arguments, Flower config values: str/int/float/bool), ``spec`` (name → (shape, dtype) of the uploads: what
    the server knows of them), ``rounding_seed`` (the clients' stochastic rounding)."""

    provider: str
    config: Mapping[str, Any]
    spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    rounding_seed: int = 0


@dataclass
class SecAggRecord:
    """What the server side saw: per round the aggregate arrays (sorted name order) and the number of
    results, and every reply the server's grid received (``replies``: (stage, array-record arrays,
    masked vectors))."""

    aggregates: list[list[np.ndarray] | None] = field(default_factory=list)
    n_results: list[int] = field(default_factory=list)
    failures: list[list[str]] = field(default_factory=list)
    replies: list[tuple[str, list[np.ndarray], list[np.ndarray]]] = field(default_factory=list)
    strategy_saw: list[list[np.ndarray]] = field(default_factory=list)
    #: node id → the reason of its last error reply; node id → the bytes of its last masked vector
    errors: dict[int, str] = field(default_factory=dict)
    masked_nbytes: dict[int, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------------
# the client side
def _provider(spec: str) -> Callable[[int, Mapping[str, Any]], tuple[Payload, float]]:
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ConfigError(f"secagg: provider must be 'module:function', got {spec!r}")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"secagg: cannot import provider {spec!r} ({e})") from None


def _quantisation(config: Mapping[str, Any]) -> SecAggQuantisation:
    return SecAggQuantisation(max_weight=float(config["secagg.max_weight"]),
                              clipping_range=float(config["secagg.clipping_range"]),
                              quantization_range=int(config["secagg.quantization_range"]),
                              modulus_range=int(config["secagg.modulus_range"]))


def _numpy_client_base():
    from flwr.client import NumPyClient

    return NumPyClient


class SecAggClient:
    """The fit side of a SecAgg+ client (a ``NumPyClient`` once ``secagg_client_app`` wraps it): the
    provider's upload, range-checked, flattened (float64, sorted names), with its weight as num_examples."""

    def __init__(self, partition: int) -> None:
        self.partition = int(partition)

    def get_parameters(self, config):  # the strategy gives initial parameters: never asked
        raise ConfigError("secagg: a SecAgg+ client never hands out its parameters outside the protocol")

    def fit(self, parameters, config):
        payload, weight = _provider(str(config["provider"]))(self.partition, config)
        quant = _quantisation(config)
        names, arrays = flatten_payload(payload)
        quant.check_values(dict(zip(names, arrays)), weight, who=f"client {self.partition}'s upload")
        (n,) = quant.weight_quanta([weight])  # refuses a weight above max_weight, a fractional one
        # Flower's stochastic rounding (quantize) draws from NumPy's global generator next: seeded, so the
        # same round gives the same aggregate (fedlora.seeds would be overkill for one integer pair)
        np.random.seed([int(config["rounding_seed"]) & 0xFFFFFFFF, self.partition])
        return arrays, int(weight), {}


def _client_fn(context):
    cls = type("SecAggNumPyClient", (SecAggClient, _numpy_client_base()), {})
    return cls(int(context.node_config["partition-id"])).to_client()


def secagg_client_app():
    """The ClientApp: ``client_fn`` + ``secaggplus_mod`` (the legacy API; see the module docstring)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp

    return ClientApp(client_fn=_client_fn, mods=[secaggplus_mod])


# ------------------------------------------------------------------------------------------------------
# the server side
class _RecordingGrid:
    """The ServerApp's grid, recording every reply the server receives (array records and SecAgg+'s masked
    vectors) — what the test checks for individual uploads. Everything else is the grid's own."""

    def __init__(self, grid, record: SecAggRecord) -> None:
        self._grid, self._record = grid, record

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        from flwr.common import bytes_to_ndarray
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        for msg in replies:
            if msg.has_error():
                self._record.errors[msg.metadata.src_node_id] = str(getattr(msg.error, "reason", "") or "")
                continue
            arrays = [a.numpy() for rec in msg.content.array_records.values() for a in rec.values()]
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS, {})
            masked = [bytes_to_ndarray(b) for b in cfg.get(Key.MASKED_PARAMETERS, [])]
            if masked:
                self._record.masked_nbytes[msg.metadata.src_node_id] = sum(len(b) for b in cfg[Key.MASKED_PARAMETERS])
            stage = "masked" if masked else ("fit" if arrays else "other")
            self._record.replies.append((stage, arrays, masked))
        return replies


def _one_line(reason: str) -> str:
    """A client's error as Flower relays it — a deployment's ``<class '…ConfigError'>:<'message'>``, Ray's whole
    remote traceback with escaped quotes and newlines: fedlora's own one-line message where there is one,
    else the reason's last non-empty line."""
    import re

    m = re.search(r"ConfigError(?:'>:<'|: )(.+?)(?:\\n|\n|'>|$)", reason)
    if m:
        return re.sub(r"\\+'", "'", m.group(1)).strip()
    lines = [ln.strip() for ln in reason.replace("\\n", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else "no reason given"


def _strategy(rounds: Sequence[SecAggRound], n_clients: int, quant: SecAggQuantisation, record: SecAggRecord,
              timeout: float):
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.server.strategy import Strategy

    class _MeanOnly(Strategy):
        """Sends every client the round's provider; keeps the aggregate SecAgg+ hands it (the same in every
        FitRes) and refuses a round that lost a client (Flower would hand on the mean of the clients left, silently)."""

        def initialize_parameters(self, client_manager):
            return Parameters(tensors=[], tensor_type="numpy.ndarray")  # never ask a client for its arrays

        def configure_fit(self, server_round, parameters, client_manager):
            if not client_manager.wait_for(n_clients, timeout=int(timeout)):
                raise ConfigError(f"secagg: {n_clients} clients did not connect within {timeout:g} s")
            r = rounds[server_round - 1]
            cfg = {**dict(r.config), "provider": r.provider, "rounding_seed": int(r.rounding_seed),
                   "secagg.max_weight": float(quant.max_weight), "secagg.clipping_range": float(quant.clipping_range),
                   "secagg.quantization_range": int(quant.quantization_range),
                   "secagg.modulus_range": int(quant.modulus_range)}
            return [(c, FitIns(parameters, cfg)) for c in client_manager.sample(n_clients, n_clients)]

        def aggregate_fit(self, server_round, results, failures):
            seen = [parameters_to_ndarrays(res.parameters) for _, res in results]
            record.strategy_saw.extend(seen)
            record.n_results.append(len(results))
            reasons = [_one_line(str(f if isinstance(f, BaseException) else f[1].status.message)) for f in failures]
            record.failures.append(list(dict.fromkeys(reasons)))  # Flower lists a failed upload twice
            ok = len(results) == n_clients and not failures
            record.aggregates.append(seen[0] if ok and seen else None)
            return (None, {}) if not ok else (results[0][1].parameters, {})

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return _MeanOnly()


def run_secagg_simulation(rounds: Sequence[SecAggRound], n_clients: int, quant: SecAggQuantisation, *,
                          num_shares: int | None = None, reconstruction_threshold: int | None = None,
                          timeout: float = 120.0) -> tuple[list[dict[str, torch.Tensor]], SecAggRecord]:
    """Run ``rounds`` of SecAgg+ over Flower's simulation engine (Ray; ``n_clients`` SuperNodes running
    ``secagg_client_app``). Returns per round the aggregate Σ_k p̃_k x_k as name → float64 tensor (the
    round's ``spec`` names and shapes) and the server side's ``SecAggRecord``. Raises ``ConfigError`` when a
    round ends without an aggregate (SecAgg+ halted, a client failed: its reason) — Flower would exit 0.
    ``num_shares`` defaults to every client, ``reconstruction_threshold`` to a majority of them (≥ 2)."""
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    if not rounds:
        raise ConfigError("secagg: no rounds to run")
    quant.check_clients(n_clients)
    shares, threshold = share_settings("auto" if num_shares is None else num_shares,
                                       "auto" if reconstruction_threshold is None else reconstruction_threshold,
                                       n_clients)
    record = SecAggRecord()
    box: dict[str, BaseException] = {}
    app = ServerApp()

    @app.main()
    def _main(grid, context) -> None:
        try:
            ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=len(rounds)),
                                strategy=_strategy(rounds, n_clients, quant, record, timeout))
            workflow = SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold,
                                          max_weight=float(quant.max_weight), clipping_range=float(quant.clipping_range),
                                          quantization_range=int(quant.quantization_range),
                                          modulus_range=int(quant.modulus_range), timeout=timeout)
            DefaultWorkflow(fit_workflow=workflow)(_RecordingGrid(grid, record), ctx)
        except BaseException as e:  # the engine swallows the ServerApp's exceptions: re-raised below
            box["error"] = e

    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.WARNING)  # Flower's per-stage INFO lines: not fedlora's output
    try:
        run_simulation(server_app=app, client_app=secagg_client_app(), num_supernodes=n_clients, backend_name="ray",
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 1, "include_dashboard": False,
                                                     "logging_level": 40}})
    finally:
        flwr_log.setLevel(level)
    if "error" in box:
        raise box["error"]
    out = []
    for i, r in enumerate(rounds):
        agg = record.aggregates[i] if i < len(record.aggregates) else None
        if agg is None:
            why = "; ".join(record.failures[i]) if i < len(record.failures) and record.failures[i] else \
                "Secure aggregation halted (Flower logs it and exits 0)"
            got = record.n_results[i] if i < len(record.n_results) else 0
            raise SecAggRoundFailed(f"secagg: round {i + 1} produced no aggregate ({got} of {n_clients} uploads): "
                                    f"{why}", out, record)
        names = sorted(r.spec)
        if len(agg) != len(names):
            raise ConfigError(f"secagg: round {i + 1}'s aggregate has {len(agg)} arrays, the spec {len(names)}")
        out.append({n: torch.from_numpy(np.array(a, dtype=np.float64)) for n, a in zip(names, agg)})
    return out, record


# ------------------------------------------------------------------------------------------------------
# the self-check's uploads: real FedAvg-LoRA / FFA-LoRA uploads of the synthetic testbed after local steps
def testbed_uploads(method: str, n_clients: int, seed: int, d_in: int = 16, d_out: int = 12, rank: int = 4,
                    steps: int = 3) -> list[Payload]:
    """Every client's upload after ``steps`` local steps of ``method`` on one float32 LoRA layer (regression
    data drawn from ``seed``): deterministic on CPU, so each client computes its own and a test the same."""
    from .adapter import LoRALinear
    from .methods import get_method
    from .methods.base import broadcast_initial_factors

    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(d_in, d_out, rank, stack=n_clients, base_weight=0.3 * torch.randn(d_out, d_in, generator=g),
                       dtype=torch.float32)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g) / d_in ** 0.5)
        layer.lora_B.copy_(0.01 * torch.randn(layer.lora_B.shape, generator=g))
    broadcast_initial_factors(layer, [list(range(n_clients))])
    m = get_method(method)(rank=rank, lr=0.05, optimizer="sgd")
    m.setup(layer, list(range(n_clients)))
    X = torch.randn(n_clients, 24, d_in, generator=g)
    Y = torch.randn(n_clients, 24, d_out, generator=g)

    def objective(params, batch):
        from torch.func import functional_call

        x, y = batch
        return ((functional_call(layer, params, (x,)) - y) ** 2).mean(dim=(-2, -1))

    m.begin_round(0)
    for _ in range(steps):
        m.local_step(objective, lambda: (X, Y))
    m.end_round(0)
    return [m.upload(i) for i in range(n_clients)]


def testbed_upload(partition: int, config: Mapping[str, Any]) -> tuple[Payload, float]:
    """A provider: client ``partition``'s ``testbed_uploads`` upload and its weight (``config``: "method",
    "n_clients", "seed", "weights" — comma-separated data sizes)."""
    ups = testbed_uploads(str(config["method"]), int(config["n_clients"]), int(config["seed"]))
    weights = [float(w) for w in str(config["weights"]).split(",")]
    up = ups[partition]
    if int(config.get("inflate", -1)) == partition:  # a client whose update blew up (×1000): the range check's case
        up = Payload({n: 1000 * t for n, t in up.tensors.items()}, dict(up.meta))
    return up, weights[partition]


# ------------------------------------------------------------------------------------------------------
# fedlora run: the SecAgg+ executor (server) and the fit stage of a node (client)
_FAILURE = "fedlora-secagg-failure"  # how a node's refusal to join the sum names its kind: "<tag>[kind] why"


def _failure(kind: str, why: str) -> ConfigError:
    return ConfigError(f"{_FAILURE}[{kind}] {why}")


def _failure_of(reason: str) -> tuple[str, str]:
    """(kind, one line) of a node's error reply: a ``_failure`` the node raised, else ``error`` and its last line."""
    import re

    m = re.search(re.escape(_FAILURE) + r"\[(\w+)\] (.+?)(?:\\n|\n|'>|$)", reason)
    if m:
        return m.group(1), re.sub(r"\\+'", "'", m.group(2)).strip()
    return "error", _one_line(reason)


def _download_arrays(rec) -> tuple[list[list], list[bytes]]:
    """A download ``ArrayRecord`` as what a legacy ``FitIns`` carries: its arrays' bytes (``Parameters``) and,
    in its config, each array's name, dtype, shape and stype — so the node rebuilds it bit for bit."""
    layout, data = [], []
    for name, a in rec.items():
        layout.append([name, a.dtype, list(a.shape), a.stype])
        data.append(a.data)
    return layout, data


def _download_record(params, layout: Sequence[Sequence], start: int = 0):
    """``_download_arrays`` undone on the node: the ``FitIns``'s parameters (from index ``start``) back as the
    download record."""
    from flwr.app import Array, ArrayRecord

    rec = ArrayRecord()
    for i, (name, dtype, shape, stype) in enumerate(layout, start=start):
        rec[str(name)] = Array(dtype=str(dtype), shape=tuple(int(d) for d in shape), stype=str(stype),
                               data=params[str(i)].data)
    return rec


class _Proxy:
    """What Flower's SecAgg+ workflow needs of a client proxy: the node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = int(node_id)


class _OneFit:
    """The strategy of one SecAgg+ fit: each participant's ``FitIns`` as given; keeps what ``aggregate_fit``
    receives (the unmasked mean in every result's parameters, each client's metrics, the failures)."""

    def __init__(self, fitins: Sequence[tuple[_Proxy, Any]]) -> None:
        self.fitins, self.results, self.failures, self.done = list(fitins), [], [], False

    def configure_fit(self, server_round, parameters, client_manager):
        return self.fitins

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures, self.done = list(results), list(failures), True
        return None, {}  # the workflow keeps no model of its own: fedlora's server aggregates


def secagg_settings(cfg_secagg: Mapping[str, Any], weights: Sequence[float]) -> SecAggQuantisation:
    """The quantisation of a run's ``privacy.secagg`` section for clients of data sizes ``weights`` (max_weight
    ``auto``: ``fedlora.secagg.choose_max_weight``)."""
    from .secagg import choose_max_weight

    w = cfg_secagg["max_weight"]
    return SecAggQuantisation(max_weight=choose_max_weight(weights) if w == "auto" else float(w),
                              clipping_range=float(cfg_secagg["clipping_range"]),
                              quantization_range=int(cfg_secagg["quantization_range"]),
                              modulus_range=int(cfg_secagg["modulus_range"]))


def _flower_executor():
    from .flower import FlowerExecutor

    return FlowerExecutor


def deployment_checkpoints_refused(every: int) -> str:
    """Why a deployment's SecAgg+ run with ``train.checkpoint_every`` = ``every`` > 0 is refused (one line): its
    nodes keep no checkpoint there (``SecAggExecutor.keeps_checkpoints``)."""
    return (f"secagg: train.checkpoint_every {every}: on a deployment a SecAgg+ run keeps no checkpoint (its clients' "
            f"records never leave their nodes, which keep their checkpoints only on the simulation engine: fedlora run "
            f"--runtime flower) — set train.checkpoint_every=0")


class SecAggExecutor(_flower_executor()):
    """``fedlora.flower.FlowerExecutor`` whose rounds are SecAgg+ fits (module docstring): ``train`` returns the
    participants' uploads only as their weighted mean (``fedlora.server.SUMMED``). ``secagg``: the run's
    ``privacy.secagg`` section (a mapping); ``weights()``: every client's weight as the server weighs it (the
    run's data sizes, called at the first round, when the run is built); ``weighting``: ``"data"`` or
    ``"uniform"`` (``fedlora.secagg.secagg_weighting``: uniform methods send num_examples 1);
    ``rounding_seed``: the clients' stochastic rounding (the run's seed). ``client_dp_clip``: client-level DP's C —
    each client then uploads its update against the ``Download.dp_reference`` the server sends, clipped to C on
    the client (``fedlora.privacy.client_dp._clip_all``), with weight 1 (``clips_on_clients``); the server adds
    the noise to the sum (``ClientDP.aggregate_presummed``). Evaluation and the final broadcast are the
    FlowerExecutor's. ``secagg_record``: what the server side received in every SecAgg+ stage
    (``SecAggRecord.replies``).

    **The clients' records never leave their nodes** (``records_stay_on_clients``): a record holds the client's
    upload or more (its adapter, optimizer moments, a personalised method's private factors), so no message asks
    for one — ``records`` and ``restore`` raise (a future caller cannot leak silently), and no final evaluation or
    broadcast carries them back (``final_round`` is always None: no ``with-record``). The driver writes the
    global adapter only (``fedlora.llm.driver``), and its checkpoints hold the server's side: on the simulation
    engine each node writes its client's record as a checkpoint of its own (``save_records``: a ``save-record``
    query naming the round, answered "ok") and takes it back on resume (``load_records``), under
    ``node_checkpoints`` (``fedlora.llm.flower.run_simulation`` names ``<output_dir>/checkpoints/nodes``; every node
    runs on this machine). A deployment's nodes keep none (``keeps_checkpoints``): with ``train.checkpoint_every``
    > 0 ``connect`` refuses the run in one line."""

    #: the nodes keep their clients' records: the driver never asks for them (their checkpoints are the nodes' own,
    #: ``save_records``; the global adapter only)
    records_stay_on_clients = True

    def __init__(self, grid, config: Mapping[str, Any], n_clients: int, *, secagg: Mapping[str, Any],
                 weights: Callable[[], Sequence[float]], weighting: str, rounding_seed: int = 0,
                 client_dp_clip: float | None = None, node_checkpoints: str | os.PathLike | None = None,
                 **kwargs) -> None:
        # no final evaluation or broadcast brings a node's record back with its scores (FlowerExecutor's
        # ``with-record``): the records stay on the nodes
        kwargs["final_round"] = None
        #: where the nodes keep their clients' checkpoints (a simulation's folder), else None (a deployment's: none)
        self.node_checkpoints = None if node_checkpoints is None else str(node_checkpoints)
        self._checkpoint_every = int(dict(config).get("train", {}).get("checkpoint_every", 0) or 0)
        super().__init__(grid, config, n_clients, **kwargs)
        if weighting not in ("data", "uniform"):
            raise ConfigError(f"secagg: weighting must be data or uniform, got {weighting!r}")
        self.client_dp_clip = None if client_dp_clip is None else float(client_dp_clip)
        if self.client_dp_clip is not None:  # DP-FedAvg drops data-size weights: (Σ_k Δ_k + noise)/(qK)
            weighting = "uniform"
        self.secagg, self._weights, self.weighting = dict(secagg), weights, weighting
        self.rounding_seed = int(rounding_seed)
        self.secagg_record = SecAggRecord()
        self.wire_bytes["masked_up"] = 0

    def records(self):
        """Refused: a SecAgg+ run never asks a node for its client's state record (class docstring)."""
        raise ConfigError("secagg: a SecAgg+ run never collects its clients' state records (each holds the client's "
                          "own upload or more): its nodes checkpoint them (save_records), its adapters/ holds the "
                          "global adapter only")

    def restore(self, records) -> None:
        """Refused: no record crosses the network — the nodes restore their own (``load_records``)."""
        raise ConfigError("secagg: a SecAgg+ run's clients' state records never leave their nodes: each node "
                          "takes its client's back from its own checkpoint (load_records)")

    def connect(self) -> dict[int, int]:
        """``FlowerExecutor.connect``; before it, when the run checkpoints (``train.checkpoint_every`` > 0) and its
        nodes cannot keep their clients' checkpoints (``keeps_checkpoints``: a deployment), a one-line
        ``ConfigError`` — before any training."""
        if self._checkpoint_every and not self.keeps_checkpoints:
            raise ConfigError(deployment_checkpoints_refused(self._checkpoint_every))
        return super().connect()

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether the nodes keep their clients' checkpoints: on the simulation engine (``node_checkpoints``, a
        folder of the server's machine, where every node runs)."""
        return self.node_checkpoints is not None

    def _checkpoint_conf(self, rounds_done: int) -> dict[str, Any]:
        conf: dict[str, Any] = {"checkpoint-round": int(rounds_done)}
        if self.node_checkpoints is not None:
            conf["node-checkpoints"] = self.node_checkpoints
        return conf

    def save_records(self, rounds_done: int) -> None:
        """Every node writes its client's record as its own checkpoint after ``rounds_done`` rounds (a
        ``save-record`` query; the reply says only "ok"): the server's checkpoint of that round is written after
        every node has answered, so the server's newest checkpoint always has its nodes' (they keep
        ``fedlora.flower_client.NODE_KEEP``)."""
        self._ask_all("save-record", **self._checkpoint_conf(rounds_done))

    def load_records(self, rounds_done: int) -> None:
        """Every node takes its client's record back from its own checkpoint after ``rounds_done`` rounds (a
        resumed run); a node without it fails the resume with its own line."""
        self._kept = self._scores = None
        try:
            self._ask_all("load-record", **self._checkpoint_conf(rounds_done))
        except RuntimeError as e:
            raise ConfigError(f"--resume: {e}") from None

    @property
    def clips_on_clients(self) -> bool:
        """Client-level DP clipped on the clients (``fedlora.server.Server`` then sends ``Download.dp_reference``)."""
        return self.client_dp_clip is not None

    def client_weights(self) -> list[int]:
        """Each client's num_examples: its data size (``data``) or 1 (``uniform``)."""
        from .secagg import integer_weights

        return [1] * self.n_clients if self.weighting == "uniform" else integer_weights(list(self._weights()))

    def train(self, rnd: int, clients: Sequence[int], downloads):
        import json

        from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
        from flwr.common import FitIns, Parameters
        from flwr.server import LegacyContext, ServerConfig
        from flwr.server.workflow import SecAggPlusWorkflow

        from .errors import RoundFailed
        from .payload import Payload
        from .secagg import summed_payload
        from .server import SUMMED, ClientFailure, ClientUpdate, Download

        self._kept = self._scores = None  # the nodes' records change
        weights = self.client_weights()
        quant = secagg_settings(self.secagg, weights)
        quant.check_clients(len(clients))
        msgs = [self._message("train", k, rnd, None if self.live else downloads.get(k, Download())) for k in clients]
        self._count(msgs)
        fitins = []
        for k, msg in zip(clients, msgs):
            conf = dict(msg.content["config"])
            conf.update({"secagg-fit-module": __name__, "secagg-weight": int(weights[k]), "secagg-rounding-seed": self.rounding_seed,
                         "secagg-max-weight": float(quant.max_weight),
                         "secagg-clipping-range": float(quant.clipping_range),
                         "secagg-quantization-range": int(quant.quantization_range),
                         "secagg-modulus-range": int(quant.modulus_range)})
            data: list[bytes] = []
            if "download" in msg.content.array_records:
                layout, data = _download_arrays(msg.content["download"])
                conf["secagg-download"] = json.dumps(layout)
            if self.clips_on_clients:
                from .flower import tensors_to_record

                ref = downloads.get(k, Download()).dp_reference
                if ref is None:
                    raise ConfigError(f"secagg: client-level DP clipped on the clients, but client {k}'s download "
                                      "carries no dp_reference")
                layout, more = _download_arrays(tensors_to_record(ref))
                conf.update({"secagg-dp-reference": json.dumps(layout), "secagg-dp-start": len(data),
                             "secagg-dp-clip": float(self.client_dp_clip)})
                self.wire_bytes["arrays_down"] += sum(len(b) for b in more)
                data = data + more
            fitins.append((_Proxy(self.node_of[k]), FitIns(Parameters(tensors=data, tensor_type="fedlora.download"),
                                                            conf)))
        strategy = _OneFit(fitins)
        state = RecordDict({"config": ConfigRecord({"current_round": int(rnd) + 1}), "parameters": ArrayRecord()})
        ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
        shares, threshold = share_settings(self.secagg.get("num_shares", "auto"),
                                           self.secagg.get("reconstruction_threshold", "auto"), len(clients))
        n = len(clients)
        record = self.secagg_record
        record.errors.clear()
        record.masked_nbytes.clear()
        workflow = SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold,
                                      max_weight=float(quant.max_weight), clipping_range=float(quant.clipping_range),
                                      quantization_range=int(quant.quantization_range),
                                      modulus_range=int(quant.modulus_range), timeout=self.timeout)
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.WARNING)  # Flower's per-stage INFO lines: not fedlora's output
        try:
            workflow(_RecordingGrid(self.grid, record), ctx)
        finally:
            flwr_log.setLevel(level)
        client_of = {self.node_of[k]: k for k in clients}
        out: dict[int, Any] = {}
        for node, reason in record.errors.items():
            if node in client_of:
                kind, why = _failure_of(reason)
                out[client_of[node]] = ClientFailure(why, kind)
        if not strategy.done or not strategy.results:
            lost = "; ".join(f"client {k}: {f.why}" for k, f in sorted(out.items())) or \
                "Secure aggregation halted (Flower logs it and exits 0)"
            raise RoundFailed(f"round {rnd + 1}: secure aggregation (SecAgg+) produced no aggregate "
                              f"({len(strategy.results)} of {n} uploads): {lost}")
        from flwr.common import parameters_to_ndarrays

        agg = parameters_to_ndarrays(strategy.results[0][1].parameters)
        record.strategy_saw.extend(parameters_to_ndarrays(res.parameters) for _, res in strategy.results)
        specs, metas = set(), set()
        for proxy, res in strategy.results:
            k = client_of[proxy.node_id]
            m = res.metrics
            specs.add(str(m["spec"]))
            metas.add(str(m["meta"]))
            nbytes = int(record.masked_nbytes.get(proxy.node_id, 0))
            self.wire_bytes["masked_up"] += nbytes
            out[k] = ClientUpdate(Payload({}), float(m["train-loss"]) if "train-loss" in m else None,
                                  json.loads(str(m["ranks"])), int(m["bytes-down"]), nbytes_up=nbytes)
        if len(specs) != 1 or len(metas) != 1:  # a sum of different tensor sets (or metadata) means nothing
            raise RoundFailed(f"round {rnd + 1}: the clients of the secure sum uploaded different tensor sets or "
                              "metadata")
        spec = {name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in json.loads(specs.pop())}
        out[SUMMED] = ClientUpdate(Payload(summed_payload(spec, agg).tensors, json.loads(metas.pop())))
        return out


def secagg_client_mod(msg, ctxt, call_next):
    """Flower's ``secaggplus_mod`` over ``_node_fit``, which answers its fit stage with ``call_next`` — the node's
    ordinary ``train`` handler. (``fedlora.flower_client``'s ClientApp does the same through its registry,
    ``NODE_HANDLERS["secagg-fit"]``, which this module sets: it imports no module that imports it back.)"""
    from flwr.client.mod import secaggplus_mod

    return secaggplus_mod(msg, ctxt, lambda m, c: _node_fit(m, c, call_next))


def _node_fit(msg, ctxt, call_next):
    """The fit stage: the legacy ``FitIns`` as the node's ``train`` message (its config and download), trained by
    ``call_next`` (``fedlora.flower._client_train``: the record saved in the node's state as usual); the upload
    flattened (float64, sorted names), range-checked (``SecAggQuantisation.check_values``: never Flower's silent
    clip) and handed back as a legacy ``FitRes`` with the weight as num_examples. A client that failed, reports
    a non-finite loss or has a value out of range raises: it stays out of the sum (SecAgg+ drops it)."""
    import json
    import math

    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common import Code, FitRes, Parameters, Status, ndarray_to_bytes
    from flwr.compat.common import recorddict_compat as compat

    from .flower import record_to_tensors

    conf = msg.content.config_records["fitins.config"]
    k, rnd = int(conf["client"]), int(conf["round"])
    records = {"config": ConfigRecord({n: v for n, v in conf.items() if not n.startswith("secagg-")})}
    if "secagg-download" in conf:
        records["download"] = _download_record(msg.content.array_records["fitins.parameters"],
                                               json.loads(str(conf["secagg-download"])))
    fit_content = msg.content
    msg.content = RecordDict(records)
    try:
        reply = call_next(msg, ctxt)
    finally:
        msg.content = fit_content
    res = reply.content["result"]
    if "failure-kind" in res:
        raise _failure(str(res["failure-kind"]), str(res["failure-why"]))
    loss = float(res["train-loss"]) if "train-loss" in res else None
    if loss is not None and not math.isfinite(loss):
        raise _failure("nonfinite_loss", f"non-finite training loss {loss}")
    upload = Payload(record_to_tensors(reply.content["upload"]), {a: str(b) for a, b in reply.content["meta"].items()})
    if "secagg-dp-clip" in conf:  # client-level DP: this client's update, clipped here (the server sees only the sum)
        from .privacy.client_dp import _clip_all

        ref = record_to_tensors(_download_record(msg.content.array_records["fitins.parameters"],
                                                 json.loads(str(conf["secagg-dp-reference"])),
                                                 int(conf["secagg-dp-start"])))
        (delta,), _, _ = _clip_all([upload.tensors], ref, float(conf["secagg-dp-clip"]))
        upload = Payload(delta, dict(upload.meta))
    names, arrays = flatten_payload(upload)
    quant = SecAggQuantisation(max_weight=float(conf["secagg-max-weight"]),
                               clipping_range=float(conf["secagg-clipping-range"]),
                               quantization_range=int(conf["secagg-quantization-range"]),
                               modulus_range=int(conf["secagg-modulus-range"]))
    weight = int(conf["secagg-weight"])
    try:
        quant.check_values(dict(zip(names, arrays)), weight, who=f"client {k}'s upload")
    except ConfigError as e:
        raise _failure("rejected", str(e)) from None
    # Flower's stochastic rounding (quantize) draws from NumPy's global generator next: seeded by (seed, round,
    # client), so the same run gives the same aggregate to the bit (the masks cancel exactly)
    np.random.seed([int(conf["secagg-rounding-seed"]) & 0xFFFFFFFF, rnd, k])
    spec = [[n, list(upload.tensors[n].shape), str(upload.tensors[n].dtype).replace("torch.", "")] for n in names]
    metrics = {"bytes-down": int(res["bytes-down"]), "ranks": str(res["ranks"]), "spec": json.dumps(spec),
               "meta": json.dumps(dict(upload.meta), sort_keys=True),
               **({} if loss is None else {"train-loss": loss})}
    fitres = FitRes(Status(Code.OK, "ok"), Parameters([ndarray_to_bytes(a) for a in arrays], "numpy.ndarray"),
                    num_examples=weight, metrics=metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


#: the fit stage of ``fedlora.flower_client``'s SecAgg+ gate (a fresh process imports this module when a fit names it)
flower_client.NODE_HANDLERS["secagg-fit"] = _node_fit

"""The server: ONE round protocol for every runtime (docs/design.md §9).

A round — draw the participants (seeded), send each what it lacks of the server's state
(``DownloadLedger``), collect the uploads, validate them (``UploadSpec``: a federated server's bad
input is a client's upload), aggregate with the method's pure ``aggregate`` over the accepted
uploads, ``server_update``, count the bytes from the serialised payloads and write the round's
record — lives here and nowhere else. Runtimes differ only in how clients execute a round: a
``ClientExecutor`` takes (round, clients, downloads) and returns each client's ``ClientUpdate`` or
``ClientFailure``; it also applies deliveries, scores its clients on the downloads the server sends
for evaluation (``evaluation_downloads``) and hands over / takes back every client's state record:

- the stacked executor of the synthetic testbed (``fedlora.simulator``): every client of every
  federation is a live replica of one stacked layer (``live = True``: it receives the server's
  changes at the end of every round, so each client is always evaluated on the current state);
- the slot executor of real models (``fedlora.llm.slots``): participants in passes over one frozen
  base model, their state records in a store (``live = False``: a client receives what it lacks
  with its next round's instructions, as a real deployment sends it); heterogeneous client models
  compose one per model group (``fedlora.llm.hetero``);
- the Flower executor (``fedlora.flower.FlowerExecutor``): each client's round is one message to its node, which runs
  the executor its node kind registered (``fedlora.flower.register_node``: the slot executor, the testbed's node).

Bytes are counted when a client receives them: ``bytes_down`` of round r holds what each client took
in that round (its download for round r with the round's instructions; a live executor's clients at
the end of round r; everybody's final synchronisation in the last round).

The server's state is ``state_dict()``: per federation the method's server state, the ledger, the
increments merged into a shared base (FLoRA) and the round reached. Client sampling is a pure function
of (seed, round, federation), so it needs no saved generator.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch

from .aggregation import normalise_weights
from .errors import ConfigError, RoundFailed
from .methods.base import Method
from .payload import Payload
from .privacy.plan import PrivacyPlan
from .seeds import PARTICIPANTS, clients_drawn, seed_of

__all__ = ["Federation", "DownloadLedger", "Download", "ClientUpdate", "ClientFailure", "ClientExecutor",
           "UploadSpec", "Server", "RoundFailed", "SUMMED"]

#: the key under which a pre-summing executor (SecAgg+: ``fedlora.flower_secagg.SecAggExecutor``) returns the
#: round's ONE upload — Σ_k p_k T_k of the participants it names, the only thing its server receives — beside a
#: ``ClientUpdate`` per participant with an empty upload (its loss, ranks and bytes); the server then aggregates
#: ``method.aggregate([summed], [1])``, equal to ``aggregate(uploads, weights)`` for ``fedlora.secagg.SUM_METHODS``
SUMMED = -1


@dataclass(frozen=True)
class Federation:
    """``n_groups`` independent federations of ``n_clients`` clients each, with client weights.

    ``client_weights``: w_k ∝ n_k, the clients' data sizes (docs/design.md §3); default uniform.
    ``sample_fraction``: each round every federation draws ⌈fraction·K⌉ distinct clients (at least
    one) with a generator seeded by ``sample_seed``; the others neither train nor communicate that
    round and the participants' weights are renormalised (McMahan et al.'s FedAvg).
    """

    n_groups: int
    n_clients: int
    client_weights: Sequence[float] | None = None  # default: uniform
    sample_fraction: float = 1.0
    sample_seed: int = 0

    def __post_init__(self) -> None:
        if self.n_groups < 1 or self.n_clients < 1:
            raise ConfigError(f"federation needs ≥ 1 group and ≥ 1 client, got {self.n_groups}, {self.n_clients}")
        if not (isinstance(self.sample_fraction, (int, float)) and 0 < self.sample_fraction <= 1):
            raise ConfigError(f"sample_fraction must be in (0, 1], got {self.sample_fraction!r}")
        normalise_weights(self.weights, self.n_clients)

    def participants(self, round_idx: int, group: int) -> list[int]:
        """Clients (0..K-1) of federation ``group`` that take part in round ``round_idx``; deterministic."""
        m = self.drawn_per_round
        if m >= self.n_clients:
            return list(range(self.n_clients))
        g = torch.Generator().manual_seed(seed_of(self.sample_seed, PARTICIPANTS, round_idx, group))
        return sorted(torch.randperm(self.n_clients, generator=g)[:m].tolist())

    def round_weights(self, clients: Sequence[int]) -> torch.Tensor:
        """The weights of a round's accepted clients, renormalised: w_k / Σ_{j ∈ clients} w_j from the
        clients' own weights (one division, so the same numbers whichever runtime asks)."""
        w = self.client_weights if self.client_weights is not None else [1.0] * self.n_clients
        return normalise_weights([float(w[k]) for k in clients], len(clients))

    @property
    def drawn_per_round(self) -> int:
        """How many clients each federation draws per round: ⌈sample_fraction·K⌉, at least one
        (``fedlora.seeds.clients_drawn``)."""
        return clients_drawn(self.sample_fraction, self.n_clients)

    @property
    def weights(self) -> torch.Tensor:
        w = self.client_weights if self.client_weights is not None else [1.0] * self.n_clients
        return normalise_weights(w, self.n_clients)

    @property
    def n_replicas(self) -> int:
        return self.n_groups * self.n_clients

    @property
    def replica_clients(self) -> list[int]:
        return [k for _ in range(self.n_groups) for k in range(self.n_clients)]

    def replicas_of(self, group: int) -> range:
        return range(group * self.n_clients, (group + 1) * self.n_clients)


class DownloadLedger:
    """What each client lacks of the server's state.

    The server's state is a name → tensor dict (``Method.initial_server_state``, then
    ``Method.server_update`` after every round). Each entry carries the round that last changed it
    (−1: the initial state, which every client holds from the one-time broadcast); each client, the
    round up to which it is synchronised. A client about to train downloads the entries newer than
    its synchronisation — for FedAvg-style methods the whole adapter, for RoLoRA only the factors
    averaged since it last took part (one factor when it took part in the previous round).
    """

    def __init__(self, n_clients: int, state: Mapping[str, torch.Tensor]) -> None:
        self.version = {k: -1 for k in state}
        self.synced = [-1] * n_clients

    def update(self, round_idx: int, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> list[str]:
        """Record the server's step ``old`` → ``new`` at ``round_idx``; return the changed entries
        (new names, or a different tensor object — ``server_update`` replaces what it changes)."""
        for k in [k for k in self.version if k not in new]:
            del self.version[k]
        changed = [k for k, v in new.items() if k not in old or v is not old[k]]
        for k in changed:
            self.version[k] = round_idx
        return changed

    def stale(self, client: int) -> list[str]:
        """Entries ``client`` has not received yet."""
        return [k for k, v in self.version.items() if v > self.synced[client]]

    def sync(self, client: int, round_idx: int) -> None:
        self.synced[client] = round_idx

    def state_dict(self) -> dict[str, Any]:
        return {"version": dict(self.version), "synced": list(self.synced)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = {str(k): int(v) for k, v in state["version"].items()}
        self.synced = [int(v) for v in state["synced"]]


# ---------------------------------------------------------------------------------------------------
# what crosses between the server and a client executor
@dataclass
class Download:
    """What the server sends one client: ``state`` (server entries, written by ``Method.download``).
    ``counted``: part of the traffic (False: a live executor's evaluation copy, sent again when the
    client next synchronises). ``nbytes``: bytes the server counts itself — the merges of a shared
    base a client missed (FLoRA); ``None``: measured from ``Method.download``'s payload."""

    state: dict[str, torch.Tensor] = field(default_factory=dict)
    counted: bool = True
    nbytes: int | None = None
    #: client-level DP clipped on the client (an executor with ``clips_on_clients``: SecAgg+): what the client's
    #: update is taken from, for every tensor it may upload — public (the server's state, the broadcast adapter)
    dp_reference: dict[str, torch.Tensor] | None = None


@dataclass
class ClientUpdate:
    """One client's result of a round: its upload, mean training loss, ranks (``Method.describe_replica``)
    and the bytes of the download it applied this round. ``nbytes_up``: the bytes its upload took on the
    network when they are not the payload's (SecAgg+: its masked vector); ``None``: ``upload.nbytes``."""

    upload: Payload
    train_loss: float | None = None
    ranks: Any = None
    bytes_down: int = 0
    nbytes_up: int | None = None


@dataclass
class ClientFailure:
    """A client that did not deliver: it raised, timed out, disconnected, reported a non-finite
    training loss, or its upload was rejected. ``why`` is one line; ``kind`` one of
    ``error``, ``timeout``, ``disconnected``, ``nonfinite_loss``, ``rejected``."""

    why: str
    kind: str = "error"
    bytes_down: int = 0


class ClientExecutor(Protocol):
    """How clients execute a round (docs/design.md §9): everything every executor offers, nothing
    optional. ``live``: the executor holds every client's model and keeps it current (it receives the
    server's changes at the end of every round); ``shared_base``: it holds one base model for all
    clients, into which a method's increments are merged once per round (``merge_into_base``). The
    executor never reaches into the server: what a client receives always comes as a ``Download``."""

    live: bool
    shared_base: bool

    def train(self, round_idx: int, clients: Sequence[int],
              downloads: Mapping[int, Download]) -> Mapping[int, "ClientUpdate | ClientFailure"]:
        """Apply each client's download, run its local steps of round ``round_idx``, return its result."""

    def deliver(self, round_idx: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        """Apply downloads outside training (a live executor's end of round, everyone's final
        synchronisation); returns the bytes each client received (0 for uncounted ones)."""

    def merge_into_base(self, state: Mapping[str, torch.Tensor]) -> None:
        """Merge the server's increment into the shared base (``shared_base`` executors; the others refuse)."""

    def evaluate(self, round_idx: int, clients: Sequence[int],
                 downloads: Mapping[int, Download]) -> dict[int, dict[str, Any]]:
        """Score each of ``clients`` on its own rows after round ``round_idx`` (read-only: nothing is
        kept), its model with ``downloads`` applied (``Server.evaluation_downloads``: what it lacks,
        uncounted) — client → {"test": metrics, "val": metrics}."""

    def records(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every client's state record as the executor keeps it (what a checkpoint holds)."""

    def restore(self, records: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Put every client's state record back (a resumed run)."""


# ---------------------------------------------------------------------------------------------------
# uploads are untrusted input
_INDEX_SUFFIX, _VALUE_SUFFIX = ".indices", ".values"


@dataclass(frozen=True)
class UploadSpec:
    """What a client may upload: per trainable tensor name its full shape and dtype (no upload of a
    method is larger: truncated ranks and index sets are slices of it). ``check`` returns why an
    upload is refused, or ``None``: a name the model does not train, a different number of
    dimensions, a dimension beyond the full one (a rank beyond what the method allows), another
    dtype, a non-finite value, an index outside its factor, or more serialised bytes than the
    client declared or than the full tensors take (``max_nbytes``)."""

    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]

    @classmethod
    def of(cls, method: Method) -> "UploadSpec":
        """The spec of a bound method (``Method.upload_spec``)."""
        return cls(dict(method.upload_spec()))

    @property
    def max_nbytes(self) -> int:
        """Serialised bytes of an upload of every tensor at its full size, with index sets, plus 4 KiB
        of metadata: no honest upload is larger."""
        full = {n: torch.empty(s, dtype=d) for n, (s, d) in self.tensors.items()}
        idx = {n + _INDEX_SUFFIX: torch.empty(max(s) if s else 1, dtype=torch.int64) for n, (s, d) in self.tensors.items()}
        return Payload({**full, **idx}).nbytes + 4096

    def check(self, payload: Payload, declared_nbytes: int | None = None) -> str | None:
        for name, t in payload.tensors.items():
            base, kind = name, "dense"
            for suffix, k in ((_INDEX_SUFFIX, "index"), (_VALUE_SUFFIX, "values")):
                if name.endswith(suffix) and name[: -len(suffix)] in self.tensors:
                    base, kind = name[: -len(suffix)], k
            if base not in self.tensors:
                return f"unexpected tensor {name!r} (not a trainable tensor of this method)"
            if not isinstance(t, torch.Tensor):
                return f"{name!r} is not a tensor"
            shape, dtype = self.tensors[base]
            if kind == "index":
                if t.dtype != torch.int64 or t.dim() != 1:
                    return f"{name!r}: an index set must be 1-D int64, got {tuple(t.shape)} {t.dtype}"
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= max(shape)):
                    return f"{name!r}: indices outside 0..{max(shape) - 1}"
                continue
            if t.dtype != dtype:
                return f"{name!r}: dtype {str(t.dtype).replace('torch.', '')}, expected {str(dtype).replace('torch.', '')}"
            if t.dim() != len(shape):
                return f"{name!r}: {t.dim()} dimensions, expected {len(shape)} (shape {tuple(shape)})"
            if any(a > b for a, b in zip(t.shape, shape)):
                return f"{name!r}: shape {tuple(t.shape)} exceeds {tuple(shape)} (a rank beyond what the method allows)"
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{name!r}: non-finite values"
        n = payload.nbytes
        if declared_nbytes is not None and n > declared_nbytes:
            return f"upload of {n} bytes is larger than the {declared_nbytes} bytes declared"
        if n > self.max_nbytes:
            return f"upload of {n} bytes is larger than any this method sends ({self.max_nbytes})"
        return None


# ---------------------------------------------------------------------------------------------------
class Server:
    """The round protocol over ``federation.n_groups`` independent federations (one per seed in the
    testbed; one for real models). Client ids are replica ids ``g·K + k`` (client k of federation g).

    ``initial_states``: each federation's server state before round 0 (``Method.initial_server_state``
    of a replica holding the broadcast adapter). ``min_clients``: the accepted uploads a federation
    needs for its round to stand (else ``RoundFailed``). ``spec``: uploads are checked against it
    (``None``: not checked — the testbed's own replicas)."""

    def __init__(self, method: Method, federation: Federation, initial_states: Sequence[Mapping[str, torch.Tensor]],
                 rounds: int, *, min_clients: int = 1, spec: UploadSpec | None = None,
                 privacy: PrivacyPlan | None = None,
                 dp_references: Sequence[Mapping[str, torch.Tensor]] | None = None) -> None:
        if len(initial_states) != federation.n_groups:
            raise ConfigError(f"server: {len(initial_states)} initial states for {federation.n_groups} federations")
        if not isinstance(min_clients, int) or isinstance(min_clients, bool) or min_clients < 1:
            raise ConfigError(f"federation.min_clients: must be an integer ≥ 1, got {min_clients!r}")
        drawn = federation.drawn_per_round
        if min_clients > drawn:
            raise ConfigError(f"federation.min_clients: {min_clients} is more than the {drawn} clients drawn per round "
                              f"(sample_fraction {federation.sample_fraction} of {federation.n_clients}); "
                              f"use min_clients ≤ {drawn}")
        self.method, self.federation, self.rounds = method, federation, rounds
        self.min_clients, self.spec = min_clients, spec
        K = federation.n_clients
        self.states = [{k: v.detach().cpu() for k, v in s.items()} for s in initial_states]
        self.ledgers = [DownloadLedger(K, s) for s in self.states]
        self.increments: list[dict[int, int]] = [{} for _ in self.states]  # round → bytes every client must merge
        self.round = 0  # the next round to run
        self._init_privacy(privacy, dp_references)

    # -- who, what ------------------------------------------------------------------------------
    def participants(self, round_idx: int) -> list[int]:
        """Client ids of every federation that take part in round ``round_idx`` (federation-major)."""
        K = self.federation.n_clients
        return [g * K + k for g in range(self.federation.n_groups) for k in self._drawn(round_idx, g)]

    def _drawn(self, round_idx: int, group: int) -> list[int]:
        """Federation ``group``'s clients of round ``round_idx``: ⌈qK⌉ drawn (``Federation.participants``), or each
        with probability q under client-level DP (Poisson sampling, what its accountant assumes)."""
        dp = self.privacy.client if self.privacy is not None else None
        if dp is not None:
            return dp.participants(round_idx, group, self.federation.n_clients)
        return self.federation.participants(round_idx, group)

    def download_for(self, client: int, shared_base: bool = False) -> Download:
        """What ``client`` lacks of its federation's current state (a pure query; see ``DownloadLedger``).
        With a shared base holding every merge (FLoRA on one base model): if it missed a merge, the
        whole state (it restarts its adapters), counted as the increments it missed."""
        g, k = divmod(client, self.federation.n_clients)
        state, ledger = self.states[g], self.ledgers[g]
        if self.method.incremental_download and shared_base:
            missed = sum(v for r, v in self.increments[g].items() if r > ledger.synced[k])
            return Download(dict(state) if missed else {}, nbytes=missed)
        return Download({n: state[n] for n in ledger.stale(k)})

    def evaluation_downloads(self, clients: Sequence[int], executor: ClientExecutor) -> dict[int, Download]:
        """What each of ``clients`` lacks of the current state, to be evaluated on it: ``download_for``
        (a pure query: nothing is marked synchronised), uncounted — none for a live executor, whose clients
        hold the current state. The server sends evaluation downloads as it sends training ones."""
        if executor.live:
            return {}
        out = {}
        for i in clients:
            d = self.download_for(i, executor.shared_base)
            out[i] = Download(d.state, counted=False, nbytes=d.nbytes)
        return out

    def synced(self, client: int) -> int:
        g, k = divmod(client, self.federation.n_clients)
        return self.ledgers[g].synced[k]

    # -- the round ----------------------------------------------------------------------------------
    def run_round(self, executor: ClientExecutor, round_idx: int | None = None) -> dict[str, Any]:
        """Run round ``round_idx`` (default: the next) with ``executor``; return its record:
        ``round`` (1-based), ``participants``, per client id ``train_loss``, ``bytes_up``,
        ``bytes_down``, ``ranks``, ``failures`` (client → ``{"kind", "why"}``, when any) and ``wall_s``."""
        rnd = self.round if round_idx is None else round_idx
        t0 = time.perf_counter()
        K, m = self.federation.n_clients, self.method
        participants = self.participants(rnd)
        if self.privacy is not None:  # before any work: a round that would exceed the budget is not started
            self.privacy.check_budget(self.accountant, participants, K, rnd)
        downloads = {} if executor.live else {i: self.download_for(i, executor.shared_base) for i in participants}
        if self._clips_on_clients(executor):  # client-level DP under SecAgg+: each client clips its own update
            ref = self._dp_reference(0)
            downloads = {i: dataclasses.replace(downloads.get(i, Download()), dp_reference=ref) for i in participants}
        results = executor.train(rnd, participants, downloads)
        summed = results.get(SUMMED)  # SecAgg+: the participants' uploads reach the server only as their sum
        accepted: dict[int, ClientUpdate] = {}
        failures: dict[int, ClientFailure] = {}
        for i in participants:
            res = results.get(i)
            if res is None:
                res = ClientFailure("no result", "disconnected")
            if isinstance(res, ClientUpdate):
                why = None
                if res.train_loss is not None and not math.isfinite(res.train_loss):
                    why = ClientFailure(f"non-finite training loss {res.train_loss}", "nonfinite_loss", res.bytes_down)
                elif self.spec is not None and summed is None:
                    bad = self.spec.check(res.upload)
                    if bad is not None:
                        why = ClientFailure(f"upload rejected: {bad}", "rejected", res.bytes_down)
                if why is None:
                    accepted[i] = res
                else:
                    failures[i] = why
            else:
                failures[i] = res
        changed_by_group: list[list[str]] = []
        dp_log: dict[str, Any] = {}
        for g in range(self.federation.n_groups):
            ok = [i for i in participants if i // K == g and i in accepted]
            drawn_here = any(i // K == g for i in participants)  # client DP's Poisson draw may be empty: noise only
            if len(ok) < self.min_clients and (drawn_here or self.privacy is None or self.privacy.client is None):
                lost = ", ".join(f"client {i % K}: {failures[i].why}" for i in participants if i in failures)
                raise RoundFailed(f"round {rnd + 1}: {len(ok)} accepted upload(s), federation.min_clients is "
                                  f"{self.min_clients} ({lost})")
            if summed is not None:
                aggregated = self._presummed(results, failures, summed, rnd, executor, len(ok), dp_log)
            elif self.privacy is not None and self.privacy.client is not None:
                aggregated = self._private_aggregate(g, ok, accepted, rnd, dp_log)
            else:
                ok, aggregated = self._aggregate(g, ok, accepted, failures, rnd)
            old = self.states[g]
            new = m.server_update(old, aggregated)
            changed_by_group.append(self.ledgers[g].update(rnd, old, new))
            self.states[g] = {k: v.detach().cpu() for k, v in new.items()}
            if m.incremental_download and executor.shared_base:  # FLoRA: merged once into the one base
                executor.merge_into_base(self.states[g])
                self.increments[g][rnd] = Payload(dict(self.states[g])).nbytes
        for i in accepted:  # it applied its download: synchronised up to the last round
            if i in downloads:
                self.ledgers[i // K].sync(i % K, rnd - 1)
        bytes_down = {i: (accepted[i].bytes_down if i in accepted else failures[i].bytes_down) for i in participants}
        last = rnd == self.rounds - 1
        if executor.live or last:
            received = executor.deliver(rnd, self._deliveries(rnd, changed_by_group, executor, last))
            for i, n in received.items():
                bytes_down[i] = bytes_down.get(i, 0) + n
        record: dict[str, Any] = {
            "round": rnd + 1, "participants": participants,
            "train_loss": {str(i): accepted[i].train_loss for i in participants if i in accepted},
            "bytes_up": {str(i): accepted[i].upload.nbytes if accepted[i].nbytes_up is None else accepted[i].nbytes_up
                         for i in participants if i in accepted},
            "bytes_down": {str(i): n for i, n in bytes_down.items()},
            "ranks": {str(i): accepted[i].ranks for i in participants if i in accepted}}
        if failures:
            record["failures"] = {str(i): {"kind": f.kind, "why": f.why} for i, f in failures.items()}
        if self.privacy is not None:
            self.accountant.record_round(self.privacy.participation(participants, K))
            record["privacy"] = {**self.privacy.record(self.accountant), **dp_log}
        record["wall_s"] = time.perf_counter() - t0
        self.round = rnd + 1
        return record

    def _aggregate(self, g: int, ok: list[int], accepted: dict[int, ClientUpdate], failures: dict[int, ClientFailure],
                   rnd: int) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Aggregate federation ``g``'s accepted uploads. An upload that leaves out a tensor the round's other
        uploads carry passes ``UploadSpec`` (which tensors a round needs is the method's business: RoLoRA and
        FFA send different sets) but makes the aggregation refuse the round: then those uploads are rejected
        as what they are — incomplete — and the others aggregated, under the same ``min_clients`` rule."""
        K, m = self.federation.n_clients, self.method
        try:
            return ok, m.aggregate([accepted[i].upload for i in ok], self.federation.round_weights([i % K for i in ok]))
        except (ConfigError, ValueError, RuntimeError):
            union = set().union(*(accepted[i].upload.tensors for i in ok))
            short = {i: sorted(union - set(accepted[i].upload.tensors)) for i in ok}
            short = {i: names for i, names in short.items() if names}
            if not short:
                raise
        for i, names in short.items():
            failures[i] = ClientFailure(f"upload rejected: it lacks {', '.join(names[:4])}"
                                        f"{' …' if len(names) > 4 else ''} (the round's other uploads carry it)",
                                        "rejected", accepted.pop(i).bytes_down)
        ok = [i for i in ok if i not in short]
        if len(ok) < self.min_clients:
            lost = ", ".join(f"client {i % K}: {failures[i].why}" for i in sorted(failures) if i // K == g)
            raise RoundFailed(f"round {rnd + 1}: {len(ok)} accepted upload(s), federation.min_clients is "
                              f"{self.min_clients} ({lost})")
        return ok, m.aggregate([accepted[i].upload for i in ok], self.federation.round_weights([i % K for i in ok]))

    def _clips_on_clients(self, executor: ClientExecutor) -> bool:
        """Client-level DP whose clipping the executor's clients make (SecAgg+: the server sees only the sum)."""
        return self.privacy is not None and self.privacy.client is not None and \
            bool(getattr(executor, "clips_on_clients", False))

    def _dp_reference(self, g: int) -> dict[str, torch.Tensor]:
        """What federation ``g``'s clients start a round from, for every tensor (``Method.client_dp_reference``)."""
        return self.method.client_dp_reference(self.states[g], self._dp_refs[g], {})

    def _presummed(self, results: Mapping[int, Any], failures: Mapping[int, ClientFailure], summed: "ClientUpdate",
                   rnd: int, executor: ClientExecutor, n_summed: int, log: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The aggregate of a pre-summed round (``SUMMED``): the method's ``aggregate`` of the one upload with
        weight 1 — under client-level DP clipped on the clients, the private release of the clipped updates' sum
        (``ClientDP.aggregate_presummed``). An upload in the sum cannot be taken out of it, so a client of the sum
        the server would have refused (a non-finite loss) fails the round, as does a sum ``UploadSpec`` rejects."""
        dp = self.privacy.client if self.privacy is not None else None
        if self.federation.n_groups != 1 or (dp is not None and not self._clips_on_clients(executor)):
            raise ConfigError("a pre-summed (SecAgg+) round needs one federation, and client-level DP clipped on the "
                              "clients")
        inside = [i for i in failures if isinstance(results.get(i), ClientUpdate)]  # in the sum, refused here
        if inside:
            raise RoundFailed(f"round {rnd + 1}: client {inside[0]}'s upload is in the secure sum but "
                              f"{failures[inside[0]].why}")
        bad = self.spec.check(summed.upload) if self.spec is not None else None
        if bad is not None:
            raise RoundFailed(f"round {rnd + 1}: the securely summed upload was rejected: {bad}")
        if dp is None:
            return self.method.aggregate([summed.upload], torch.ones(1, dtype=torch.float64))
        aggregated, info = dp.aggregate_presummed(self.method, summed.upload, n_summed, self._dp_reference(0),
                                                  self.federation.n_clients, rnd, 0, clip=self._dp_clip[0])
        self._dp_names[0] = sorted(summed.upload.tensors)
        log.setdefault("clip_norm", []).append(info["clip"])  # the clients clipped at it; their norms stay with them
        return aggregated

    # -- client-level DP ---------------------------------------------------------------------------
    def _init_privacy(self, privacy: PrivacyPlan | None, references) -> None:
        """The run's privacy plan, its accountant and, under client-level DP, what each upload's update is taken
        from: the server's state, else (a tensor no round has aggregated yet) ``dp_references`` — per federation
        the broadcast initial adapter every client starts from."""
        self.privacy = privacy
        self.accountant = None
        self._dp_refs: list[dict[str, torch.Tensor]] = [{} for _ in self.states]
        self._dp_names: list[list[str]] = [[] for _ in self.states]  # the tensors of a federation's last release
        self._dp_clip: list[float] = []  # each federation's current C (adaptive clipping moves it every round)
        if privacy is None:
            return
        from .privacy.accounting import PrivacyAccountant

        self.accountant = PrivacyAccountant()
        if privacy.client is not None:
            if references is None or len(references) != len(self.states):
                raise ConfigError("client-level DP: the server needs each federation's initial adapter "
                                  "(dp_references) to take the first round's updates from")
            self._dp_refs = [{k: v.detach().cpu() for k, v in r.items()} for r in references]
            self._dp_clip = [privacy.client.clip_norm for _ in self.states]

    def _private_aggregate(self, g: int, ok: list[int], accepted: Mapping[int, "ClientUpdate"], rnd: int,
                           log: dict[str, Any]) -> dict[str, torch.Tensor]:
        """DP-FedAvg over federation ``g``'s accepted uploads (``fedlora.privacy.client_dp.ClientDP.aggregate``):
        clipped updates against what each client started from, the noised fixed-denominator mean, the method's
        ``aggregate`` of it as one upload. ``log`` gets each client's update norm before clipping."""
        some = accepted[ok[0]].upload.tensors if ok else {}
        reference = self.method.client_dp_reference(self.states[g], self._dp_refs[g], some)  # what clients started from
        aggregated, info = self.privacy.client.aggregate(
            self.method, [accepted[i].upload for i in ok], reference, self.federation.n_clients, rnd, g,
            noise_names=self._dp_names[g], clip=self._dp_clip[g])
        if ok:
            self._dp_names[g] = sorted(accepted[ok[0]].upload.tensors)
        log.setdefault("update_norm", {}).update({str(i): n for i, n in zip(ok, info["update_norms"])})
        log["clipped"] = log.get("clipped", 0) + info["clipped"]
        log.setdefault("clip_norm", []).append(info["clip"])  # per federation, the C this round clipped at
        if "next_clip" in info:  # adaptive clipping (Andrew et al.): the released b̃ and the next round's C
            log.setdefault("unclipped_fraction", []).append(info["unclipped_fraction"])
            self._dp_clip[g] = info["next_clip"]
        if info["noise_only"]:
            log.setdefault("noise_only", []).append(g)
        return aggregated

    def _deliveries(self, rnd: int, changed: Sequence[Sequence[str]], executor: ClientExecutor,
                    last: bool) -> dict[int, Download]:
        """The downloads sent outside training at the end of round ``rnd``: after the last round,
        every client synchronises (the final broadcast); a live executor's clients drawn for the next
        round synchronise now (counted) and the others take this round's changes uncounted (kept
        current for evaluation); an increment every client must merge (FLoRA without a shared base)
        goes to everyone, counted. Synchronised clients are marked in the ledger."""
        K = self.federation.n_clients
        out: dict[int, Download] = {}
        incremental = self.method.incremental_download and not executor.shared_base
        for g in range(self.federation.n_groups):
            state = self.states[g]
            receivers = (range(K) if (incremental or last)
                         else self._drawn(rnd + 1, g))
            for k in range(K):
                i = g * K + k
                if k in receivers:
                    out[i] = (Download({n: state[n] for n in changed[g]}) if incremental
                              else self.download_for(i, executor.shared_base))
                    self.ledgers[g].sync(k, rnd)
                elif executor.live:
                    out[i] = Download({n: state[n] for n in changed[g]}, counted=False)
        return out

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the server holds: ``tensors`` (name → tensor, ``g<g>/<entry>``) and ``meta``
        (JSON: the round reached, each federation's ledger and increments)."""
        tensors = {f"g{g}/{n}": v for g, s in enumerate(self.states) for n, v in s.items()}
        meta = {"round": self.round, "n_groups": len(self.states),
                "entries": [list(s) for s in self.states],
                "ledgers": [lg.state_dict() for lg in self.ledgers],
                "increments": [{str(r): n for r, n in inc.items()} for inc in self.increments]}
        if self.privacy is not None:
            meta["privacy"] = {"accountant": self.accountant.state_dict(), "dp_names": self._dp_names,
                               "clip": self._dp_clip}
        return {"tensors": tensors, "meta": meta}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        meta, tensors = state["meta"], state["tensors"]
        if meta["n_groups"] != len(self.states):
            raise ConfigError(f"server checkpoint: {meta['n_groups']} federations, this run has {len(self.states)}")
        self.states = [{n: tensors[f"g{g}/{n}"] for n in names} for g, names in enumerate(meta["entries"])]
        for lg, s in zip(self.ledgers, meta["ledgers"]):
            lg.load_state_dict(s)
        self.increments = [{int(r): int(n) for r, n in inc.items()} for inc in meta["increments"]]
        self.round = int(meta["round"])
        if self.privacy is not None:
            if "privacy" not in meta:
                raise ConfigError("server checkpoint: it was written without differential privacy; this run has "
                                  "privacy on (resume it with the config it was started with)")
            self.accountant.load_state_dict(meta["privacy"]["accountant"])
            self._dp_names = [list(n) for n in meta["privacy"]["dp_names"]]
            self._dp_clip = [float(c) for c in meta["privacy"]["clip"]]
        elif "privacy" in meta:
            raise ConfigError("server checkpoint: it was written with differential privacy on; this run has it off "
                              "(resume it with the config it was started with)")

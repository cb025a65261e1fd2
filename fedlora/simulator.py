"""The embedded simulator: clients in one process, rounds of I local steps, aggregation (docs/design.md §9).

Replicas (see ``fedlora.methods.base``) are laid out group-major: replica ``g * K + k`` is client
``k`` of federation ``g`` (e.g. one federation per seed). Each federation aggregates on its own,
through the method's pure ``aggregate`` applied to that federation's payloads, and every payload
is serialised to count the bytes that would cross the network.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .aggregation import normalise_weights
from .errors import ConfigError
from .methods.base import Method, Objective, Sampler

__all__ = ["Federation", "DownloadLedger", "run_rounds"]


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
        m = max(1, math.ceil(self.sample_fraction * self.n_clients - 1e-9))
        if m >= self.n_clients:
            return list(range(self.n_clients))
        g = torch.Generator().manual_seed((self.sample_seed * 1_000_003 + round_idx) * 7_919 + group)
        return sorted(torch.randperm(self.n_clients, generator=g)[:m].tolist())

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
    """What each client lacks of the server's state (shared by both runtimes).

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


def run_rounds(
    method: Method,
    federation: Federation,
    objective: Objective,
    sample: Sampler,
    rounds: int,
    local_steps: int,
    evaluate: Callable[[int], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run ``rounds`` rounds; return one record per round.

    Each record holds ``round``, ``step`` (local steps done so far), ``bytes_up`` / ``bytes_down``
    (lists over replicas, measured from the serialised payloads), ``participants`` (per replica,
    bool), ``wall_s`` and whatever ``evaluate(round)`` returns, called after the download — i.e. on
    the model each client holds. Each federation's server keeps its state (``initial_server_state``,
    ``server_update`` after each round's ``aggregate``) and every client of a federation is given
    the entries that changed (so all are evaluated on the current global state). Upload bytes count
    for the round's participants only. Download bytes count when a client synchronises: the clients
    drawn for the next round (after the last round, everyone) receive every entry that changed since
    they last synchronised (``DownloadLedger``), measured from ``download``'s payload; when the
    download is an increment (``method.incremental_download``: FLoRA's stack to merge), every client,
    every round, as each must apply every increment to stay current.
    """
    if rounds < 1 or local_steps < 1:
        raise ConfigError(f"rounds and local_steps must be ≥ 1, got {rounds}, {local_steps}")
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    weights = federation.weights
    K = federation.n_clients
    servers = [method.initial_server_state(federation.replicas_of(g)[0]) for g in range(federation.n_groups)]
    ledgers = [DownloadLedger(K, s) for s in servers]
    for rnd in range(rounds):
        active = [federation.participants(rnd, g) for g in range(federation.n_groups)]
        idle = [g * K + k for g in range(federation.n_groups) for k in range(K) if k not in active[g]]
        snap = method.snapshot() if idle else None
        method.begin_round(rnd)
        for _ in range(local_steps):
            method.local_step(objective, sample)
        method.end_round(rnd)
        if idle:  # sampled-out clients did not train: the stacked step is undone for them
            method.restore(snap, idle)
        bytes_up = [0] * federation.n_replicas
        bytes_down = [0] * federation.n_replicas
        for g in range(federation.n_groups):
            reps = [g * K + k for k in active[g]]
            payloads = [method.upload(i) for i in reps]
            for i, p in zip(reps, payloads):
                bytes_up[i] = p.nbytes
            aggregated = method.aggregate(payloads, normalise_weights(weights[active[g]], len(reps)))
            new = method.server_update(servers[g], aggregated)
            changed = ledgers[g].update(rnd, servers[g], new)
            servers[g] = new
            receivers = (range(K) if method.incremental_download or rnd == rounds - 1
                         else federation.participants(rnd + 1, g))
            for i in federation.replicas_of(g):
                k = i % K
                if k in receivers:  # synchronises: everything it lacks, counted
                    keys = changed if method.incremental_download else ledgers[g].stale(k)
                    bytes_down[i] = method.download(i, {n: new[n] for n in keys}).nbytes
                    ledgers[g].sync(k, rnd)
                else:  # kept current for evaluation; counted when it next synchronises
                    method.download(i, {n: new[n] for n in changed})
        record = {"round": rnd + 1, "step": (rnd + 1) * local_steps,
                  "bytes_up": bytes_up, "bytes_down": bytes_down,
                  "participants": [(i % K) in active[i // K] for i in range(federation.n_replicas)],
                  "wall_s": time.perf_counter() - t0}
        if evaluate is not None:
            record.update(evaluate(rnd))
        history.append(record)
    return history

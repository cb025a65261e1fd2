"""The embedded simulator of the synthetic testbed: the stacked client executor (docs/design.md §9).

Replicas (see ``fedlora.methods.base``) are laid out group-major: replica ``g * K + k`` is client
``k`` of federation ``g`` (e.g. one federation per seed). Every replica is live: all train in one
stacked step (the ones sampled out are put back afterwards), and the server's changes reach every
replica at the end of each round. The round protocol itself — sampling, downloads, aggregation per
federation, byte counting — is the server's (``fedlora.server``); ``run_rounds`` drives it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

from .errors import ConfigError
from .methods.base import Method, Objective, Sampler
from .payload import Payload
from .server import ClientUpdate, Download, DownloadLedger, Federation, Server

__all__ = ["Federation", "DownloadLedger", "StackedExecutor", "run_rounds", "round_record"]


class StackedExecutor:
    """Every client of every federation as one replica of a stacked model, trained together: the
    round's ``local_steps`` steps run on all replicas at once, then the replicas that sat the round
    out are restored (``Method.snapshot``/``restore``), so they neither train nor change.

    ``on_payload(direction, replica, payload)``: called with every upload (``"up"``) and download
    (``"down"``) the executor makes, in order — to keep them (byte accounting tests), never to change them."""

    live = True
    shared_base = False

    def __init__(self, method: Method, federation: Federation, objective: Objective, sample: Sampler,
                 local_steps: int, on_payload: Callable[[str, int, Payload], None] | None = None,
                 sample_dp: Any = None) -> None:
        self.method, self.federation = method, federation
        self.objective, self.sample, self.local_steps = objective, sample, local_steps
        self.on_payload = on_payload
        #: sample-level DP-SGD (``fedlora.privacy.dpsgd.SampleDP``, also given to the method): positioned at
        #: (round, step) before every local step, so each step's Poisson batch and noise have their own streams
        self.sample_dp = sample_dp

    def _seen(self, direction: str, replica: int, payload: Payload) -> Payload:
        if self.on_payload is not None:
            self.on_payload(direction, replica, payload)
        return payload

    def train(self, round_idx: int, clients: Sequence[int], downloads: Mapping[int, Download]) -> dict[int, ClientUpdate]:
        m = self.method
        active = set(clients)
        idle = [i for i in range(self.federation.n_replicas) if i not in active]
        for i, d in downloads.items():  # a live executor's clients are current already: normally none
            self._seen("down", i, m.download(i, d.state))
        snap = m.snapshot() if idle else None
        m.begin_round(round_idx)
        for step in range(self.local_steps):
            if self.sample_dp is not None:
                self.sample_dp.at(round_idx, step)
            m.local_step(self.objective, self.sample)
        m.end_round(round_idx)
        if idle:  # sampled-out clients did not train: the stacked step is undone for them
            m.restore(snap, idle)
        return {i: ClientUpdate(self._seen("up", i, m.upload(i))) for i in clients}

    def deliver(self, round_idx: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        out = {}
        for i, d in downloads.items():
            sent = self._seen("down", i, self.method.download(i, d.state))
            out[i] = sent.nbytes if d.counted else 0
        return out

    def merge_into_base(self, state) -> None:  # every replica holds its own base
        raise NotImplementedError


def round_record(rec: Mapping[str, Any], rnd: int, local_steps: int, n: int, t0: float) -> dict[str, Any]:
    """The testbed's record of round ``rnd`` from the server's (``Server.run_round``): per-replica lists
    over the ``n`` replicas, ``participants`` the ids of the replicas drawn (as ``fedlora run``'s rounds.jsonl lists
    its clients), ``step`` = local steps done so far, ``wall_s`` since ``t0``."""
    return {"round": rnd + 1, "step": (rnd + 1) * local_steps,
            "bytes_up": [rec["bytes_up"].get(str(i), 0) for i in range(n)],
            "bytes_down": [rec["bytes_down"].get(str(i), 0) for i in range(n)],
            "participants": list(rec["participants"]),
            "wall_s": time.perf_counter() - t0}


def run_rounds(
    method: Method,
    federation: Federation,
    objective: Objective,
    sample: Sampler,
    rounds: int,
    local_steps: int,
    evaluate: Callable[[int], dict[str, Any]] | None = None,
    on_payload: Callable[[str, int, Payload], None] | None = None,
    sample_dp: Any = None,
    dp_delta: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``rounds`` rounds of the server's protocol with the stacked executor; one record per round.

    Each record holds ``round``, ``step`` (local steps done so far), ``bytes_up`` / ``bytes_down``
    (lists over replicas, measured from the serialised payloads), ``participants`` (the ids of the
    replicas drawn, as in ``fedlora run``'s rounds.jsonl), ``wall_s`` (since the start) and whatever ``evaluate(round)`` returns, called after the
    round's downloads — i.e. on the model each client holds. Upload bytes count for the round's
    participants only. Download bytes count when a client synchronises: the clients drawn for the
    next round (after the last round, everyone) receive every entry that changed since they last
    synchronised (``DownloadLedger``); the others take the round's changes uncounted (so every client
    is evaluated on the current global state) and are counted when they next synchronise; an
    increment (``method.incremental_download``: FLoRA's stack to merge) goes to every client, every
    round, counted, as each must apply every increment to stay current. ``on_payload``: see
    ``StackedExecutor``.

    ``sample_dp`` (a ``fedlora.privacy.dpsgd.SampleDP`` already given to the method with ``set_sample_dp``, with
    ``objective``/``sample`` giving per-replica SUMS over Poisson batches: ``synthetic.privacy``): every local
    step is DP-SGD's, and the server's accountant (a sample-level ``PrivacyPlan``) composes, per round,
    (q_k, σ, local_steps) for each replica that took part (its unit: its id g·K + k, client k of federation g);
    the record then has the server's ``privacy: {level, epsilon, epsilon_by_client, delta}`` at ``dp_delta``.
    """
    if rounds < 1 or local_steps < 1:
        raise ConfigError(f"rounds and local_steps must be ≥ 1, got {rounds}, {local_steps}")
    # the testbed's weights are the normalised w_k (docs/design.md §3), renormalised over each round's clients
    weighted = dataclasses.replace(federation, client_weights=federation.weights.tolist())
    K = federation.n_clients
    plan = None
    if sample_dp is not None:
        from .privacy.accounting import check_delta
        from .privacy.plan import PrivacyPlan

        if method.sample_dp is not sample_dp:
            raise ConfigError("run_rounds: sample_dp must be the one the method trains with (method.set_sample_dp)")
        plan = PrivacyPlan(level="sample", delta=check_delta(dp_delta), noise_multiplier=sample_dp.noise_multiplier,
                           sample_rates=[sample_dp.rate(k) for k in range(K)], sample_steps=[local_steps] * K,
                           clip_norm=sample_dp.clip_norm, releases_per_step=int(method.sample_dp_releases))
    server = Server(method, weighted, [method.initial_server_state(federation.replicas_of(g)[0])
                                       for g in range(federation.n_groups)], rounds, privacy=plan)
    executor = StackedExecutor(method, federation, objective, sample, local_steps, on_payload, sample_dp)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    n = federation.n_replicas
    for rnd in range(rounds):
        rec = server.run_round(executor, rnd)
        record = round_record(rec, rnd, local_steps, n, t0)
        if "privacy" in rec:  # realised participation: a replica sampled out composed nothing
            record["privacy"] = rec["privacy"]
        if evaluate is not None:
            record.update(evaluate(rnd))
        history.append(record)
    return history

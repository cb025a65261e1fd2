"""A run's privacy plan: which DP level, its parameters, the budget — and what each round spends.

The server (``fedlora.server.Server``) holds one ``PrivacyPlan`` and one ``PrivacyAccountant``; before a round
it asks ``epsilon_after`` of the round's REALISED participation and stops cleanly (``BudgetExhausted``) when
the round would exceed ``max_epsilon``; after it, it records the round. The accountant's state is part of the
server's checkpoint, so a resumed run continues the same ε.

- client level (``ClientDP``): the clients are the protected records, one unit for all (``CLIENT_UNIT``); every
  round composes one Poisson-subsampled Gaussian mechanism (q = the client sampling rate, σ) — every client is
  subject to the draw, drawn or not, which is what the amplification by sampling accounts for.
- sample level (DP-SGD on each client, ``fedlora.privacy.dpsgd``): each client's examples are the protected
  records, a unit per client; a round composes, for each client that trained, its local steps with its own
  Poisson batch rate q_k = b / n_k. A client that sat the round out composes nothing (its participation is
  drawn independently of the data).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from fedlora.errors import ConfigError

from .accounting import PrivacyAccountant, check_delta, check_epsilon, check_noise_multiplier
from .client_dp import CLIENT_UNIT, ClientDP

__all__ = ["PrivacyPlan", "BudgetExhausted", "LEVELS"]

LEVELS = ("none", "client", "sample")


class BudgetExhausted(RuntimeError):
    """The next round would spend more than the run's ``max_epsilon``: the run stops before it, its last
    checkpoint and every record so far kept (the command prints it as one line)."""


@dataclass(frozen=True)
class PrivacyPlan:
    """``level``: client or sample. ``delta``: the δ every ε is reported at. ``max_epsilon``: the budget (None:
    none — ε is reported, no round is refused). ``client``: the client-level mechanism. ``sample_rates`` /
    ``sample_steps``: per client (its index in the federation) the Poisson batch rate q_k and the local steps of
    a round, with ``noise_multiplier`` σ (sample level); ``releases_per_step``: the DP-SGD releases each local step
    makes (``Method.sample_dp_releases``: 2 for private Per-FedAvg, else 1), all counted."""

    level: str
    delta: float
    max_epsilon: float | None = None
    noise_multiplier: float = 0.0
    client: ClientDP | None = None
    sample_rates: Sequence[float] = field(default_factory=tuple)
    sample_steps: Sequence[int] = field(default_factory=tuple)
    clip_norm: float | None = None  # C (sample level; client level: ``client.clip_norm``)
    releases_per_step: int = 1

    def __post_init__(self) -> None:
        if self.level not in LEVELS[1:]:
            raise ConfigError(f"privacy.level: must be one of {', '.join(LEVELS)}, got {self.level!r}")
        object.__setattr__(self, "delta", check_delta(self.delta, "privacy.delta"))
        if self.max_epsilon is not None:
            object.__setattr__(self, "max_epsilon", check_epsilon(self.max_epsilon, "privacy.max_epsilon"))
        check_noise_multiplier(self.noise_multiplier, "privacy.noise_multiplier")
        if self.level == "client" and self.client is None:
            raise ConfigError("privacy: client-level DP needs its mechanism (ClientDP)")
        if self.level == "sample" and len(self.sample_rates) != len(self.sample_steps):
            raise ConfigError("privacy: sample-level DP needs a batch rate and a step count per client")
        r = self.releases_per_step
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"privacy: releases per local step must be an integer ≥ 1, got {r!r}")

    def participation(self, participants: Sequence[int], n_clients: int) -> dict[str, tuple[float, float, int]]:
        """What one round spends: {unit: (q, σ, steps)}. ``participants``: the client ids g·K + k (client k of
        federation g) that train this round; at sample level each is its own unit (its data set: in a run of one
        federation, the client's index), at client level every client is one unit that spends one step."""
        if self.level == "client":
            return {CLIENT_UNIT: (self.client.sampling_rate, self.client.noise_multiplier, 1)}
        out = {}
        for i in participants:
            k = i % n_clients
            if self.sample_steps[k] > 0:
                out[str(i)] = (float(self.sample_rates[k]), float(self.noise_multiplier),
                               int(self.sample_steps[k]) * self.releases_per_step)
        return out

    def record(self, accountant: PrivacyAccountant, eps: float | None = None) -> dict[str, Any]:
        """What a round record says of privacy after the round: the level, ε so far (the largest over units) at δ,
        and at sample level each client's ε (clients never drawn have none)."""
        e = accountant.epsilon(self.delta) if eps is None else eps
        out: dict[str, Any] = {"level": self.level, "epsilon": e, "delta": self.delta}
        if self.level == "sample":  # each client's own ε (its examples are the records); "epsilon" is the largest
            out["epsilon_by_client"] = accountant.epsilons(self.delta)
        if self.max_epsilon is not None:
            out["max_epsilon"] = self.max_epsilon
        return out

    def check_budget(self, accountant: PrivacyAccountant, participants: Sequence[int], n_clients: int,
                     round_idx: int) -> None:
        """``BudgetExhausted`` when round ``round_idx`` (0-based) with ``participants`` would take ε above the budget."""
        if self.max_epsilon is None:
            return
        after = accountant.epsilon_after(self.participation(participants, n_clients), self.delta)
        if after > self.max_epsilon * (1 + 1e-9):
            spent = accountant.epsilon(self.delta)
            raise BudgetExhausted(f"privacy budget: round {round_idx + 1} would take ε from {spent:.4g} to "
                                  f"{after:.4g}, above privacy.max_epsilon {self.max_epsilon:g} (δ = {self.delta:g}); "
                                  f"the run stops after round {round_idx}")


"""A run's privacy plan from its ``privacy`` section (``fedlora.privacy.plan.PrivacyPlan``): δ, σ, the budget,
the client-level mechanism and what each client starts from — resolved once the data sizes are known, checked
before any training (a budget the first round already exceeds is refused in one line)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from fedlora.errors import ConfigError
from fedlora.privacy.accounting import PrivacyAccountant, delta_from_data_size, noise_multiplier_for
from fedlora.privacy.client_dp import ClientDP
from fedlora.privacy.plan import PrivacyPlan

from .config import RunConfig

__all__ = ["privacy_plan", "client_references", "describe_plan"]


def privacy_plan(cfg: RunConfig, n_clients: int) -> PrivacyPlan | None:
    """The plan of a run of ``n_clients`` federated clients (None: privacy off). Client level: q =
    ``federation.sample_fraction``, one Poisson-subsampled Gaussian step per round; σ given or derived from
    ``target_epsilon`` over ``train.rounds`` rounds (``noise_multiplier_for``); δ = 1/(2K) when auto."""
    p = cfg.privacy
    if p.level == "none":
        return None
    if p.level != "client":
        raise ConfigError(f"privacy.level: {p.level} is not wired into fedlora run yet")
    q = float(cfg.federation.sample_fraction)
    delta = delta_from_data_size(n_clients) if p.delta == "auto" else float(p.delta)
    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
    else:
        sigma = noise_multiplier_for(float(p.target_epsilon), delta, q, int(cfg.train.rounds))
    budget = p.max_epsilon if p.max_epsilon is not None else p.target_epsilon
    plan = PrivacyPlan(level="client", delta=delta, max_epsilon=None if budget is None else float(budget),
                       noise_multiplier=sigma,
                       client=ClientDP(float(p.clip_norm), sigma, q, seed=int(cfg.seed)))
    if plan.max_epsilon is not None:
        first = PrivacyAccountant().epsilon_after(plan.participation([], n_clients), delta)
        if first > plan.max_epsilon * (1 + 1e-9):
            raise ConfigError(f"privacy.max_epsilon: the first round alone spends ε = {first:.4g} at δ = {delta:g} "
                              f"(σ = {sigma:g}, q = {q:g}), above the budget {plan.max_epsilon:g}; raise the budget "
                              f"or privacy.noise_multiplier")
    return plan


def client_references(record: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """What every client starts round 0 from, for the uploaded tensors ``names``: the broadcast initial adapter
    in a fresh client's state record (``param:<name>`` entries)."""
    return {n: record[f"param:{n}"] for n in names if f"param:{n}" in record}


def describe_plan(plan: PrivacyPlan | None) -> dict[str, Any] | None:
    """The resolved plan for config.json and summary.json (σ as derived, δ as resolved)."""
    if plan is None:
        return None
    out: dict[str, Any] = {"level": plan.level, "delta": plan.delta, "noise_multiplier": plan.noise_multiplier,
                           "max_epsilon": plan.max_epsilon}
    if plan.client is not None:
        out.update(clip_norm=plan.client.clip_norm, client_sampling_rate=plan.client.sampling_rate,
                   client_sampling="poisson", weights="equal (data-size weights dropped)",
                   denominator="expected participants q·K")
    return out

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

__all__ = ["privacy_plan", "sample_dp_of", "client_references", "describe_plan", "dry_run_plan", "privacy_summary"]


def privacy_plan(cfg: RunConfig, n_clients: int, sizes: Sequence[int] | None = None,
                 steps: Sequence[int] | None = None) -> PrivacyPlan | None:
    """The plan of a run of ``n_clients`` federated clients (None: privacy off).

    Client level: q = ``federation.sample_fraction``, one Poisson-subsampled Gaussian step per round; σ given or
    derived from ``target_epsilon`` over ``train.rounds`` rounds (``noise_multiplier_for``); δ = 1/(2K) when auto.

    Sample level (``sizes``: each client's training rows n_k, ``steps``: its local steps per round): client k's
    batches are Poisson samples at q_k = min(1, b/n_k) (b = ``train.batch_size``, the expected batch size), each
    round composing its steps (× the method's ``sample_dp_releases`` per step); δ = 1/(2·min n_k) when auto; σ given, or the smallest σ with which EVERY client
    ends the planned rounds within ``target_epsilon`` were it drawn in every round (the worst client's σ)."""
    p = cfg.privacy
    if p.level == "none":
        return None
    if p.level == "sample":
        return _sample_plan(cfg, sizes, steps)
    q = float(cfg.federation.sample_fraction)
    delta = delta_from_data_size(n_clients) if p.delta == "auto" else float(p.delta)
    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
    else:
        sigma = noise_multiplier_for(float(p.target_epsilon), delta, q, int(cfg.train.rounds))
    budget = p.max_epsilon if p.max_epsilon is not None else p.target_epsilon
    plan = PrivacyPlan(level="client", delta=delta, max_epsilon=None if budget is None else float(budget),
                       noise_multiplier=sigma,
                       client=ClientDP(float(p.clip_norm), sigma, q, seed=int(cfg.seed),
                                       target_quantile=None if p.clip_quantile is None else float(p.clip_quantile),
                                       clip_lr=float(p.clip_lr),
                                       count_stddev=None if p.clip_quantile is None else
                                       float(p.clip_count_stddev) if p.clip_count_stddev is not None
                                       else max(q * n_clients / 20, sigma)))
    _check_first_round(plan, [], n_clients)
    return plan


def _sample_plan(cfg: RunConfig, sizes, steps) -> PrivacyPlan:
    p = cfg.privacy
    if sizes is None or steps is None:
        raise ConfigError("privacy.level: sample-level DP's plan needs each client's data size and local steps")
    b = int(cfg.train.batch_size)
    rates = [min(1.0, b / int(n)) for n in sizes]
    delta = delta_from_data_size(min(int(n) for n in sizes)) if p.delta == "auto" else float(p.delta)
    rounds = int(cfg.train.rounds)
    from fedlora.methods import get_method

    releases = get_method(cfg.method.name).sample_dp_releases_for(dict(cfg.method.options or {}))  # per local step
    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
    else:  # each distinct (q_k, steps_k) once: the library's calibration takes ~0.1 s per try
        sigma = max(noise_multiplier_for(float(p.target_epsilon), delta, q, int(t) * rounds * releases)
                    for q, t in sorted(set(zip(rates, steps))) if int(t) > 0)
    budget = p.max_epsilon if p.max_epsilon is not None else p.target_epsilon
    plan = PrivacyPlan(level="sample", delta=delta, max_epsilon=None if budget is None else float(budget),
                       noise_multiplier=sigma, sample_rates=tuple(rates), sample_steps=tuple(int(t) for t in steps),
                       clip_norm=float(p.clip_norm), releases_per_step=releases)
    _check_first_round(plan, list(range(len(sizes))), len(sizes))
    return plan


def _check_first_round(plan: PrivacyPlan, participants: Sequence[int], n_clients: int) -> None:
    """A budget the first round alone exceeds (every client drawn): one line, before training."""
    if plan.max_epsilon is None:
        return
    first = PrivacyAccountant().epsilon_after(plan.participation(participants, n_clients), plan.delta)
    if first > plan.max_epsilon * (1 + 1e-9):
        raise ConfigError(f"privacy.max_epsilon: the first round alone spends ε = {first:.4g} at δ = {plan.delta:g} "
                          f"(σ = {plan.noise_multiplier:g}), above the budget {plan.max_epsilon:g}; raise the budget "
                          f"or privacy.noise_multiplier")


def sample_dp_of(cfg: RunConfig, plan: PrivacyPlan | None, clients: Sequence[int] | None = None):
    """The slot executor's DP-SGD settings (``fedlora.privacy.dpsgd.SampleDP``) of a sample-level plan, else None.
    ``clients``: the run-wide ids of an executor's own clients 0..K_g−1 (a group of heterogeneous client models):
    each gets its id's rate, and its streams are keyed by that id (no two clients of the run share one)."""
    if plan is None or plan.level != "sample":
        return None
    from fedlora.privacy.dpsgd import SampleDP

    clip, sigma, seed = float(cfg.privacy.clip_norm), plan.noise_multiplier, int(cfg.seed)
    if clients is None:
        return SampleDP(clip, sigma, list(plan.sample_rates), seed=seed)
    sdp = SampleDP(clip, sigma, {i: plan.sample_rates[k] for i, k in enumerate(clients)}, seed=seed)
    sdp.set_stream_ids(dict(enumerate(clients)))
    return sdp


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
        if plan.client.adaptive:
            out.update(clipping="adaptive", clip_quantile=plan.client.target_quantile, clip_lr=plan.client.clip_lr,
                       clip_count_stddev=plan.client.count_stddev,
                       update_noise_multiplier=plan.client.update_noise_multiplier)
    else:
        out.update(clip_norm=plan.clip_norm, batch_sampling="poisson", batch_rates=list(plan.sample_rates),
                   local_steps=list(plan.sample_steps), denominator="expected batch size q_k·n_k")
        if plan.releases_per_step != 1:
            out["releases_per_step"] = plan.releases_per_step
    return out


def dry_run_plan(cfg: RunConfig) -> dict[str, Any] | None:
    """A dry run's client-level privacy plan (``fedlora run --dry-run``): σ derived, δ resolved, the first round's
    budget checked — before the data are read (a sample-level plan needs each client's data size: the dry run
    derives it after its data check, ``fedlora.llm.runtime``)."""
    if cfg.privacy.level != "client":
        return None
    return describe_plan(privacy_plan(cfg, cfg.federation.clients))


def privacy_summary(plan: PrivacyPlan | None, history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """summary.json's ``privacy``: the resolved plan and the ε spent by the rounds run (a run stopped by its budget:
    fewer than planned); None with privacy off."""
    if plan is None:
        return None
    return {**describe_plan(plan), "rounds_run": len(history),
            "epsilon": history[-1]["privacy"]["epsilon"] if history else 0.0}

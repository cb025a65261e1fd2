"""Sample-level DP-SGD on the synthetic testbed (issue 29 item 5; its privacy–utility sweep: ``privacy_sweep``).

DP-SGD is Abadi et al., "Deep Learning with Differential Privacy" (CCS 2016), Algorithm 1, run by the library's
mechanism (``fedlora.privacy.dpsgd``): each local step of client k of federation g draws a Poisson batch (each of
its n_k training rows with probability q_k = min(1, b/n_k)), takes per-example gradients of the factors the method
trains, clips each example jointly to C, sums, adds N(0, σ²C² I) and divides by q_k·n_k. The testbed's ordinary
objective is full-batch (and, for regression, reduced to sufficient statistics), so under DP both the sampler and
the objective are replaced here: ``dp_objective`` gives each replica the SUM of its batch's per-example losses (a
regression row's ℓᵢ = ‖ŷᵢ − yᵢ‖²/d_out, a classification row's cross-entropy; padded rows exactly 0), and its
forward records the layer's input, output and the factors used (a ``Capture``, layout "stack": (G, N, d)).

Streams: replica g·K + k draws its batch and noise from ``seed_of(s_g, DP_SAMPLE, kind, k, round, step)``, s_g the
seed of federation g (``SampleDP.set_slot_seeds``): the replicas of client k in two stacked federations (two seeds)
draw independently, and one federation's numbers do not depend on what else is stacked with it.

"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from fedlora.errors import ConfigError
from fedlora.privacy.accounting import check_delta, noise_multiplier_for
from fedlora.privacy.dpsgd import Capture, SampleDP

__all__ = ["TestbedPrivacy", "dp_objective", "dp_sampler", "make_sample_dp", "recorded_forward"]


@dataclass(frozen=True)
class TestbedPrivacy:
    """Sample-level DP on the testbed: target ``epsilon`` (``math.inf``: σ = 0 — the same Poisson batches and
    clipping, no noise), ``delta``, clipping norm ``clip_norm`` C, expected batch size ``batch_size`` b (q_k =
    min(1, b/n_k)). σ is the smallest with which every client, drawn in every round, ends at most at ε."""

    __test__ = False  # not a pytest class, despite its name

    epsilon: float
    delta: float = 1e-5
    clip_norm: float = 1.0
    batch_size: int = 16

    def validate(self) -> "TestbedPrivacy":
        e = self.epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or math.isnan(e) or e <= 0:
            raise ConfigError(f"privacy epsilon must be a number > 0 (or inf: no noise), got {e!r}")
        check_delta(self.delta)
        c = self.clip_norm
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ConfigError(f"privacy clip_norm must be a finite number > 0, got {c!r}")
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(f"privacy batch_size must be an integer ≥ 1, got {b!r}")
        return self

    def rates(self, client_sizes: Sequence[int]) -> list[float]:
        return [min(1.0, self.batch_size / n) for n in client_sizes]

    def noise_multiplier(self, client_sizes: Sequence[int], steps: int) -> float:
        """σ for ``steps`` local steps in all (rounds × local steps): the largest any client needs (0 at ε = ∞)."""
        if math.isinf(self.epsilon):
            return 0.0
        return max(_sigma_for(float(self.epsilon), float(self.delta), q, int(steps))
                   for q in set(self.rates(client_sizes)))


@functools.lru_cache(maxsize=256)
def _sigma_for(epsilon: float, delta: float, q: float, steps: int) -> float:
    # calibration takes seconds (a bisection over RDP curves); a sweep asks the same (ε, δ, q, steps) per step size
    return noise_multiplier_for(epsilon, delta, q, steps)


def make_sample_dp(privacy: TestbedPrivacy, client_sizes: Sequence[int], group_seeds: Sequence[int], rounds: int,
                   local_steps: int, releases: int = 1) -> SampleDP:
    """The ``SampleDP`` of a testbed run: rates by client, sizes n_k, σ for rounds × local_steps × ``releases`` (the
    method's DP-SGD releases per step, ``Method.sample_dp_releases``), one stream key (the federation's seed) per
    replica, group-major."""
    privacy.validate()
    sdp = SampleDP(privacy.clip_norm, privacy.noise_multiplier(client_sizes, rounds * local_steps * releases),
                   privacy.rates(client_sizes), seed=0)
    sdp.set_client_sizes(list(client_sizes))
    sdp.set_slot_seeds([int(s) for s in group_seeds for _ in client_sizes])
    return sdp


def recorded_forward(layer, params: Mapping[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
    """``layer.forward_with``, recorded for per-example gradients inside ``fedlora.privacy.dpsgd.capture`` with the
    factors actually used (Fed-SB substitutes its folded B·R); outside it, ``forward_with`` alone."""
    y = layer.forward_with(params, X)
    if layer.dp_capture is not None:
        layer.dp_capture.append(Capture(layer, X, y, "stack", *(params.get(n, getattr(layer, n)) for n in
                                                                 ("lora_A", "lora_B", "lora_C", "lora_D", "lora_R",
                                                                  "lora_Phi"))))
    return y


def dp_objective(layer, task: str, d_out: int) -> Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]:
    """objective(params, (X (G, m, d_in), Y, mask (G, m))) → (G,): per replica the SUM over its real rows of
    ℓᵢ (regression ‖ŷᵢ − yᵢ‖²/d_out, so that Σᵢ ℓᵢ / n is the testbed's MSE; classification CE); a padded row's
    ℓ is exactly 0 (``torch.where``), so its per-example gradient is 0."""
    def objective(params, batch):
        X, Y, mask = batch
        out = recorded_forward(layer, params, X)
        if task == "regression":
            per = ((out - Y) ** 2).mean(-1)
        else:
            per = F.cross_entropy(out.reshape(-1, d_out), Y.reshape(-1), reduction="none").view(Y.shape)
        return torch.where(mask > 0, per, torch.zeros_like(per)).sum(-1)
    return objective


def dp_sampler(data, sdp: SampleDP) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """sample() → (X, Y, mask): replica i = g·K + k's Poisson batch at the current (round, step) from its
    federation's stream (``SampleDP.poisson_rows``), padded to the largest draw (at least one row) with copies of
    row 0, marked 0 in ``mask``."""
    K = data.n_clients
    sizes = [int(n) for n in data.n_train]

    def sample():
        rows = [sdp.poisson_rows(i % K, sizes[i], seed=sdp.slot_seed(i)) for i in range(len(sizes))]
        m = max(1, max(len(r) for r in rows))
        idx = torch.zeros(len(rows), m, dtype=torch.int64)
        mask = torch.zeros(len(rows), m, dtype=torch.float64)
        for i, r in enumerate(rows):
            idx[i, : len(r)] = r
            mask[i, : len(r)] = 1.0
        X = torch.gather(data.X_train, 1, idx[..., None].expand(-1, -1, data.X_train.shape[-1]))
        if data.Y_train.dim() == 3:
            Y = torch.gather(data.Y_train, 1, idx[..., None].expand(-1, -1, data.Y_train.shape[-1]))
        else:
            Y = torch.gather(data.Y_train, 1, idx)
        return X, Y, mask
    return sample


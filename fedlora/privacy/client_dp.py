"""Client-level differential privacy in the one server protocol: DP-FedAvg (pure functions and a small plan).

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models" (ICLR 2018),
Algorithm 1, for the methods whose server aggregate is the weighted mean of the uploads, Σ_k p_k U_k
(``Method.client_dp_refusal`` is None): the server

1. draws each client independently with probability q (Poisson sampling — the sampling the accountant assumes;
   ``poisson_participants``), instead of the ⌈qK⌉ clients of a run without DP;
2. takes each accepted upload's update Δ_k = U_k − R (R: what the client started the round from, the server's
   state for that tensor) and clips it to L2 norm C over the WHOLE payload (``clipping.clip_update``);
3. releases R + (Σ_k Δ_k + N(0, σ²C² I)) / (qK) (``clipping.private_mean``: the fixed-denominator estimator,
   data-size weights dropped, so one client moves the release by at most C/(qK)), and hands it to the method's
   own ``aggregate`` as ONE upload of weight 1 — for a weighted-mean method that is the identity, so every
   method-specific step after it (FedSVD's re-factorisation, ``server_update``) is the method's as without DP.

The noise of round r in federation g comes from a generator seeded by (seed, r, g) (``seed_of(DP_CLIENT_NOISE)``),
so a resumed run draws the same noise with nothing saved, and the embedded and Flower runtimes, which share
``fedlora.server.Server``, release the same numbers.

A method whose upload is not the tensor the server updates declares the space of the update itself
(``DenseUpdates``): LoRA-A²'s uploads are its clients' masked deltas with their index sets, so its update Δ_k is
the dense delta (zero off the client's selected ranks), clipped over the whole payload, the noise covers EVERY
coordinate of the round's trained factor at full rank r_G in every module (a release noised only where clients
selected would reveal the selection), and the release, divided by the same qK (not by per-coordinate counts of
selecting clients, which depend on the clients' data), goes to the method's ``aggregate`` as one full-rank upload.

A round in which Poisson sampling draws nobody still releases noise (a release that skipped such rounds would
tell an observer that the draw was empty, which the accounting does not cover): the noise alone, divided by qK,
is added to the tensors the previous round's uploads carried. Before any round has been aggregated there are
none; such a first round changes nothing (the one case the release does not cover, stated in
docs/concepts/privacy.md). A ``DenseUpdates`` method names its round's space itself, so its noise-only release
covers that space, the first round included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

import torch

from fedlora.errors import ConfigError
from fedlora.payload import Payload
from fedlora.seeds import DP_CLIENT_NOISE, DP_PARTICIPANTS, seed_of

from .accounting import check_noise_multiplier, check_sampling_rate
from .clipping import CLIP_EPS, check_clip_norm, clip_update, gaussian_noise_like, private_mean

__all__ = ["ClientDP", "DenseUpdates", "poisson_participants", "CLIENT_UNIT"]

#: the accountant's unit under client-level DP: every client is protected alike (one record for all)
CLIENT_UNIT = "client"


def poisson_participants(seed: int, round_idx: int, group: int, n_clients: int, q: float) -> list[int]:
    """Clients 0..K−1 drawn in round ``round_idx`` of federation ``group``, each independently with probability
    ``q`` (Poisson sampling), from a generator seeded by (seed, round, group): ascending, possibly empty."""
    if q >= 1.0:
        return list(range(n_clients))
    g = torch.Generator().manual_seed(seed_of(seed, DP_PARTICIPANTS, round_idx, group))
    u = torch.rand(n_clients, generator=g, dtype=torch.float64)
    return [k for k in range(n_clients) if float(u[k]) < q]


def _clip_all(updates: Sequence[Mapping[str, torch.Tensor]], reference: Mapping[str, torch.Tensor], c: float
              ) -> tuple[list[dict[str, torch.Tensor]], list[float], int]:
    """Each of ``updates`` (name → tensor the client holds) minus ``reference``, clipped to ``c`` over the whole
    payload (``clip_update``): (the clipped Δ_k, ‖Δ_k‖ before clipping, how many were clipped — those
    ``clip_update`` did not return unchanged)."""
    clipped = [clip_update(u, reference, c) for u in updates]
    norms = [norm for _, norm in clipped]
    return [d for d, _ in clipped], norms, sum(1 for v in norms if v + CLIP_EPS > c)


@runtime_checkable
class DenseUpdates(Protocol):
    """A method whose upload is not the tensor the server updates (LoRA-A²'s masked deltas with index sets):
    it names the coordinates of the round's update, turns an upload into its dense update, and the private mean
    back into one upload its ``aggregate`` takes. Pure functions of their arguments."""

    def client_dp_space(self, reference: Mapping[str, torch.Tensor], round_idx: int) -> dict[str, torch.Tensor]:
        """name → zeros shaped like every coordinate round ``round_idx``'s release covers (``reference``: the
        server's state, what clients started from)."""

    def client_dp_update(self, upload: Payload, space: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The upload's update Δ_k: for every name of ``space``, a tensor of its shape and dtype."""

    def client_dp_release(self, mean: Mapping[str, torch.Tensor], round_idx: int) -> Payload:
        """The private mean update (over ``space``) as one upload of the round, for ``aggregate([it], [1])``."""


@dataclass(frozen=True)
class ClientDP:
    """DP-FedAvg's server-side mechanism: clip norm C (the initial one with adaptive clipping), noise multiplier σ
    (z), client sampling rate q, noise seed; with ``target_quantile`` γ, adaptive clipping.

    Adaptive clipping — Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
    Clipping" (NeurIPS 2021), Algorithm 1 with the geometric update: each round also releases the noised fraction
    of updates that were NOT clipped, b̃ = (Σ_k 1[‖Δ_k‖ ≤ C] + N(0, σ_b²)) / (qK), and the next round clips at
    C · exp(−η_C (b̃ − γ)), so C tracks the γ-quantile of the update norms. Releasing both is one Gaussian
    mechanism of noise multiplier z when the update's noise is z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (their Theorem 1):
    the accountant composes z, the update gets z_Δ·C. σ_b defaults to qK/20, η_C to 0.2 (the paper's).

    ``aggregate`` is pure given its arguments (the round and federation select the noise stream)."""

    clip_norm: float
    noise_multiplier: float
    sampling_rate: float
    seed: int = 0
    target_quantile: float | None = None
    clip_lr: float = 0.2
    count_stddev: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", check_clip_norm(self.clip_norm, "privacy.clip_norm"))
        object.__setattr__(self, "noise_multiplier",
                           check_noise_multiplier(self.noise_multiplier, "privacy.noise_multiplier"))
        object.__setattr__(self, "sampling_rate", check_sampling_rate(self.sampling_rate, "privacy sampling rate"))
        if self.target_quantile is None:
            return
        g = self.target_quantile
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < 1:
            raise ConfigError(f"privacy.clip_quantile: must be in (0, 1), got {g!r}")
        lr = self.clip_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ConfigError(f"privacy.clip_lr: must be a finite number > 0, got {lr!r}")
        sb = self.count_stddev
        if isinstance(sb, bool) or not isinstance(sb, (int, float)) or not math.isfinite(sb) or sb <= 0:
            raise ConfigError(f"privacy.clip_count_stddev: must be a finite number > 0, got {sb!r}")
        z = self.noise_multiplier
        if z > 0 and not 2 * sb > z:
            raise ConfigError(f"privacy.clip_count_stddev: adaptive clipping needs 2·σ_b > σ (σ_b = {sb:g}, σ = {z:g}): "
                              f"the update's noise z_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) is otherwise undefined; raise it")

    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None

    @property
    def update_noise_multiplier(self) -> float:
        """The noise multiplier of the update's sum: z, or z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) with adaptive clipping."""
        z = self.noise_multiplier
        if not self.adaptive or z == 0:
            return z
        return (z ** -2 - (2 * self.count_stddev) ** -2) ** -0.5

    def next_clip(self, clip: float, norms: Sequence[float], n_clients: int, generator: torch.Generator
                  ) -> tuple[float, float]:
        """(C of the next round, b̃): Andrew et al.'s geometric step from this round's norms before clipping, with
        the count's noise drawn from ``generator`` (after the update's noise)."""
        unclipped = sum(1 for v in norms if v + CLIP_EPS <= clip)  # as clip_update: these came back unchanged
        noise = float(torch.randn((), generator=generator, dtype=torch.float64)) * self.count_stddev
        b = (unclipped + noise) / self.expected_participants(n_clients)
        return clip * math.exp(-self.clip_lr * (b - self.target_quantile)), b

    def participants(self, round_idx: int, group: int, n_clients: int) -> list[int]:
        return poisson_participants(self.seed, round_idx, group, n_clients, self.sampling_rate)

    def expected_participants(self, n_clients: int) -> float:
        """qK, the fixed denominator."""
        return self.sampling_rate * n_clients

    def generator(self, round_idx: int, group: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed_of(self.seed, DP_CLIENT_NOISE, round_idx, group))

    def aggregate(self, method, uploads: Sequence[Payload], reference: Mapping[str, torch.Tensor], n_clients: int,
                  round_idx: int, group: int, noise_names: Sequence[str] = (), clip: float | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict]:
        """The private aggregate of one federation's round and what the server may log about it.

        Args:
            method: the bound ``Method`` (its ``aggregate`` takes the private mean as one upload of weight 1).
            uploads: the accepted uploads (any number, 0 included), each with the same tensor names.
            reference: name → what a client started the round from (the server's state, else the broadcast
                initial adapter), for every uploaded name.
            n_clients: K of the federation; the denominator is qK.
            noise_names: with no upload, the names the noise-only release covers (the previous round's).
            clip: this round's C (adaptive clipping: the server's current one); default ``clip_norm``.
        Returns:
            (the method's aggregate, {"update_norms": [‖Δ_k‖ before clipping, in upload order], "clipped": how
            many were clipped, "noise_only": no upload this round, "clip": the C used, and with adaptive clipping
            "next_clip": the next round's C and "unclipped_fraction": the released b̃}).
        """
        qk = self.expected_participants(n_clients)
        gen = self.generator(round_idx, group)
        c = self.clip_norm if clip is None else check_clip_norm(clip, "the round's clip norm")
        z = self.update_noise_multiplier
        if isinstance(method, DenseUpdates):
            return self._aggregate_dense(method, uploads, reference, n_clients, round_idx, qk, gen, c, z)
        if not uploads:
            names = [n for n in noise_names if n in reference]
            if not names:
                return {}, self._info([], 0, True, c, n_clients, gen)
            noise = gaussian_noise_like({n: reference[n] for n in names}, z * c, gen)
            private = {n: reference[n] + noise[n] / qk for n in names}
            info = self._info([], 0, True, c, n_clients, gen)  # the count's noise after the update's
            return method.aggregate([Payload(private)], torch.ones(1, dtype=torch.float64)), info
        for u in uploads:
            missing = [n for n in u.tensors if n not in reference]
            if missing:
                raise ConfigError(f"client-level DP: the uploaded {missing[0]!r} has no value on the server to take "
                                  f"the update from")
        deltas, norms, clipped = _clip_all([u.tensors for u in uploads], reference, c)
        mean = private_mean(deltas, z, c, qk, gen)
        private = {n: (reference[n].to(mean[n].dtype) + mean[n]) for n in mean}
        metas = [dict(u.meta) for u in uploads]  # public settings a method's server reads (Fed-SB's rank and η)
        if any(m != metas[0] for m in metas):
            raise ConfigError(f"client-level DP: the round's uploads carry different metadata ({metas[0]} and "
                              f"{next(m for m in metas if m != metas[0])}); one release carries one")
        return method.aggregate([Payload(private, metas[0])], torch.ones(1, dtype=torch.float64)), \
            self._info(norms, clipped, False, c, n_clients, gen)

    def aggregate_presummed(self, method, mean_update: Payload, n_summed: int, reference: Mapping[str, torch.Tensor],
                            n_clients: int, round_idx: int, group: int, clip: float | None = None
                            ) -> tuple[dict[str, torch.Tensor], dict]:
        """``aggregate`` when each client clipped its own update and the server received only their uniform mean
        (SecAgg+, ``fedlora.flower_secagg``): ``mean_update`` = (1/n) Σ_k Δ_k over the ``n_summed`` clients of the
        sum, each Δ_k = ``clip_update(U_k, reference, C)`` on its client (``_clip_all``, the same C). The release is
        ``aggregate``'s — R + (Σ_k Δ_k + N(0, σ²C² I))/(qK), the same noise stream — with Σ_k Δ_k = n·mean in the
        uploads' dtype. Fixed clipping only (adaptive clipping needs each client's clipped-or-not bit)."""
        if self.adaptive:
            raise ConfigError("client-level DP clipped on the clients (SecAgg+): adaptive clipping is not supported")
        if isinstance(method, DenseUpdates):
            raise ConfigError(f"client-level DP clipped on the clients (SecAgg+): {method.name}'s dense updates are "
                              "not supported")
        c = self.clip_norm if clip is None else check_clip_norm(clip, "the round's clip norm")
        total = {n: (t.to(torch.float64) * n_summed).to(t.dtype) for n, t in mean_update.tensors.items()}
        mean = private_mean([total], self.update_noise_multiplier, c, self.expected_participants(n_clients),
                            self.generator(round_idx, group))
        missing = [n for n in mean if n not in reference]
        if missing:
            raise ConfigError(f"client-level DP: the uploaded {missing[0]!r} has no value on the server to take the "
                              f"update from")
        private = {n: (reference[n].to(mean[n].dtype) + mean[n]) for n in mean}
        return method.aggregate([Payload(private, dict(mean_update.meta))], torch.ones(1, dtype=torch.float64)), \
            {"update_norms": [], "clipped": None, "noise_only": False, "clip": c}

    def _aggregate_dense(self, method: DenseUpdates, uploads: Sequence[Payload], reference, n_clients: int,
                         round_idx: int, qk: float, gen: torch.Generator, c: float, z: float
                         ) -> tuple[dict[str, torch.Tensor], dict]:
        """``aggregate`` for a ``DenseUpdates`` method: Δ_k = ``client_dp_update`` (the reference is the space's
        zeros: the upload is an update already), clipped to C over the whole payload; (Σ_k Δ_k + N(0, σ²C² I))/(qK)
        over EVERY coordinate of ``client_dp_space`` (noise alone when nobody was drawn, the first round included),
        handed to the method's ``aggregate`` as ``client_dp_release``."""
        space = method.client_dp_space(reference, round_idx)
        if not uploads:
            noise = gaussian_noise_like(space, z * c, gen)
            mean = {n: noise[n] / qk for n in space}
            info = self._info([], 0, True, c, n_clients, gen)  # the count's noise after the update's
        else:
            deltas, norms, clipped = _clip_all([method.client_dp_update(u, space) for u in uploads], space, c)
            mean = private_mean(deltas, z, c, qk, gen)
            info = self._info(norms, clipped, False, c, n_clients, gen)
        return method.aggregate([method.client_dp_release(mean, round_idx)], torch.ones(1, dtype=torch.float64)), info

    def _info(self, norms, clipped, noise_only, clip, n_clients, gen) -> dict:
        info = {"update_norms": norms, "clipped": clipped, "noise_only": noise_only, "clip": clip}
        if self.adaptive:
            info["next_clip"], info["unclipped_fraction"] = self.next_clip(clip, norms, n_clients, gen)
        return info


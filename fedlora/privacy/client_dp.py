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

A round in which Poisson sampling draws nobody still releases noise (a release that skipped such rounds would
tell an observer that the draw was empty, which the accounting does not cover): the noise alone, divided by qK,
is added to the tensors the previous round's uploads carried. Before any round has been aggregated there are
none; such a first round changes nothing (the one case the release does not cover, stated in
docs/concepts/privacy.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from fedlora.errors import ConfigError
from fedlora.payload import Payload
from fedlora.seeds import DP_CLIENT_NOISE, DP_PARTICIPANTS, seed_of

from .accounting import check_noise_multiplier, check_sampling_rate
from .clipping import check_clip_norm, clip_update, gaussian_noise_like, private_mean

__all__ = ["ClientDP", "poisson_participants", "CLIENT_UNIT"]

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


@dataclass(frozen=True)
class ClientDP:
    """DP-FedAvg's server-side mechanism: clip norm C, noise multiplier σ, client sampling rate q, noise seed.

    ``aggregate`` is pure given its arguments (the round and federation select the noise stream)."""

    clip_norm: float
    noise_multiplier: float
    sampling_rate: float
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", check_clip_norm(self.clip_norm, "privacy.clip_norm"))
        object.__setattr__(self, "noise_multiplier",
                           check_noise_multiplier(self.noise_multiplier, "privacy.noise_multiplier"))
        object.__setattr__(self, "sampling_rate", check_sampling_rate(self.sampling_rate, "privacy sampling rate"))

    def participants(self, round_idx: int, group: int, n_clients: int) -> list[int]:
        return poisson_participants(self.seed, round_idx, group, n_clients, self.sampling_rate)

    def expected_participants(self, n_clients: int) -> float:
        """qK, the fixed denominator."""
        return self.sampling_rate * n_clients

    def generator(self, round_idx: int, group: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed_of(self.seed, DP_CLIENT_NOISE, round_idx, group))

    def aggregate(self, method, uploads: Sequence[Payload], reference: Mapping[str, torch.Tensor], n_clients: int,
                  round_idx: int, group: int, noise_names: Sequence[str] = ()) -> tuple[dict[str, torch.Tensor], dict]:
        """The private aggregate of one federation's round and what the server may log about it.

        Args:
            method: the bound ``Method`` (its ``aggregate`` takes the private mean as one upload of weight 1).
            uploads: the accepted uploads (any number, 0 included), each with the same tensor names.
            reference: name → what a client started the round from (the server's state, else the broadcast
                initial adapter), for every uploaded name.
            n_clients: K of the federation; the denominator is qK.
            noise_names: with no upload, the names the noise-only release covers (the previous round's).
        Returns:
            (the method's aggregate, {"update_norms": [‖Δ_k‖ before clipping, in upload order], "clipped": how
            many were clipped, "noise_only": no upload this round}).
        """
        qk = self.expected_participants(n_clients)
        gen = self.generator(round_idx, group)
        if not uploads:
            names = [n for n in noise_names if n in reference]
            if not names:
                return {}, {"update_norms": [], "clipped": 0, "noise_only": True}
            noise = gaussian_noise_like({n: reference[n] for n in names}, self.noise_multiplier * self.clip_norm, gen)
            private = {n: reference[n] + noise[n] / qk for n in names}
            return method.aggregate([Payload(private)], torch.ones(1, dtype=torch.float64)), \
                {"update_norms": [], "clipped": 0, "noise_only": True}
        deltas, norms = [], []
        for u in uploads:
            missing = [n for n in u.tensors if n not in reference]
            if missing:
                raise ConfigError(f"client-level DP: the uploaded {missing[0]!r} has no value on the server to take "
                                  f"the update from")
            d, norm = clip_update(u.tensors, reference, self.clip_norm)
            deltas.append(d)
            norms.append(norm)
        mean = private_mean(deltas, self.noise_multiplier, self.clip_norm, qk, gen)
        private = {n: (reference[n].to(mean[n].dtype) + mean[n]) for n in mean}
        clipped = sum(1 for v in norms if v + 1e-6 > self.clip_norm)
        return method.aggregate([Payload(private)], torch.ones(1, dtype=torch.float64)), \
            {"update_norms": norms, "clipped": clipped, "noise_only": False}


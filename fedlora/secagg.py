"""Secure aggregation (SecAgg+) for fedlora: which methods it applies to, and what its quantisation costs.

Pure (NumPy and torch only, no Flower): the transport is ``fedlora.flower_secagg``.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", ACM CCS 2020) lets a server learn Σ_k v_k of integer vectors v_k ∈ Z_M and nothing else: each
client adds pairwise masks that cancel in the sum (with Shamir shares of the mask seeds, so the masks of a
client that drops can be removed). Flower 1.42 implements it for float model parameters by quantising them;
what follows is derived from its code (``flwr/client/mod/secure_aggregation/secaggplus_mod.py``,
``_collect_masked_vectors``; ``flwr/common/secure_aggregation/quantization.py``;
``flwr/server/workflow/secure_aggregation/secaggplus_workflow.py``, ``unmask_stage``).

Flower's arithmetic, with c = ``clipping_range``, Q = ``quantization_range``, M = ``modulus_range``,
W = ``max_weight``, n_k client k's ``num_examples`` and x_k its (float) parameters:

1. the client's weight is quantised: q_k = round(n_k / W · Q) (Python's ``round``); its parameters are
   scaled by q_k / Q: y_k = (q_k / Q) · x_k;
2. y_k is clipped to [−c, c] and stochastically rounded on a grid of step Δ = 2c / Q:
   z_k = ⌈(y_k + c) / Δ⌉ or that minus 1, integers in [0, Q], E[z_k] = (y_k + c) / Δ, |z_k Δ − c − y_k| < Δ;
3. the server learns Σ_k z_k and Σ_k q_k modulo M (exact as long as N·Q < M: no wrap-around) and returns
   out = (Δ · Σ_k z_k − N c) · Q / Σ_k q_k = Σ_k p̃_k x_k + (Σ_k e_k) · Q / Σ_k q_k, with p̃_k = q_k / Σ_j q_j
   and |e_k| < Δ.

**The bound** (``SecAggQuantisation.error_bound``). Against the exact weighted mean Σ_k p_k x_k with
p_k = n_k / Σ_j n_j, per coordinate where every |x_k| ≤ X:

    |out − Σ_k p_k x_k| ≤ N · (2c + X) / Σ_k q_k        (× (1 + 2⁻²⁰) for float64 arithmetic)

— the rounding term N·Δ·Q/Σq = 2cN/Σq, plus the weights' own quantisation: with q_k = n_k Q/W + δ_k,
|δ_k| ≤ ½, Σ_k |p̃_k − p_k| ≤ (Σ|δ_k| + |Σδ_k|)/Σq ≤ N/Σq. The (1 + 2⁻²⁰) covers float64 rounding in
steps 1–3 (relative errors of a few ε₆₄·Q ≤ 2⁻²¹ of the bound, since Q < M ≤ 2³²): fedlora hands
Flower float64 arrays — in float32, (y + c)/Δ at Q = 2²² would lose half a grid step.

**Choosing max_weight.** Σ_k q_k ≈ Q · Σ_k n_k / W, so the bound grows linearly in W: the smallest
W that keeps every ratio n_k/W ≤ 1 (Flower warns of overflow above 1) is W = max_k n_k
(``choose_max_weight``); with equal data sizes the bound is then (2c + X)/Q ≈ 3.8·10⁻⁶ at Flower's
defaults c = 8, Q = 2²² — a relative error of ~4·10⁻⁴ on a LoRA factor of size 10⁻². Flower's default W = 1000
with 3 clients of 20 examples each makes Σq 50× smaller and the bound 50× larger. A smaller c tightens the
rounding term 2cN/Σq, but every weighted value must fit it.

**No silent clip.** Flower clips y_k to [−c, c] without a word; fedlora checks first
(``SecAggQuantisation.check_values``) and refuses an upload with a value outside in one line.

**Which methods.** SecAgg+ reveals only Σ_k n_k x_k (and Σ_k n_k): it serves a method whose server
aggregate is a weighted sum of the uploads, applied to that sum (``SUM_METHODS``). A method whose server
needs each client's own product, norm or factors is refused with its reason (``REFUSED``,
``secagg_refusal``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from .errors import ConfigError
from .methods.base import Method
from .payload import Payload

__all__ = ["SUM_METHODS", "REFUSED", "secagg_refusal", "secagg_weighting", "SecAggQuantisation",
           "choose_max_weight", "flatten_payload", "summed_payload", "integer_weights", "share_settings"]

#: methods whose server aggregate is Σ_k p_k T_k of every uploaded tensor T, applied to that sum: name →
#: (weighting, what is summed). "data": p_k ∝ the client's data size (Flower's num_examples); "uniform":
#: p_k = 1/M over the round's M uploads (num_examples = 1 for everyone). For each, the method's own
#: ``aggregate([Σ_k p_k T_k], [1])`` equals ``aggregate(uploads, weights)`` (tests/test_secagg.py).
SUM_METHODS: dict[str, tuple[str, str]] = {
    "fedavg": ("data", "A and B, each its weighted mean"),
    "ffa": ("data", "B (A is frozen and shared)"),
    "rolora": ("data", "the round's trained factor"),
    "fedsa": ("data", "A (B stays on the client)"),
    "feddpa": ("data", "the global adapter's A and B (the local adapter is never uploaded)"),
    "fedsvd": ("data", "B; the server re-factorises B̄A itself"),
    "fedsb": ("data", "R (and the initialisation round's gradients; their rank/lr metadata travels in clear)"),
    "frlora": ("data", "A and B; the server merges their product into its base"),
    "perfedavg": ("data", "A and B"),
    "pf2lora": ("uniform", "the shared adapter, an unweighted mean"),
    "h2tune": ("uniform", "the shared R of every module type, an unweighted mean"),
}

#: methods SecAgg+ cannot serve, with the one-line reason
REFUSED: dict[str, str] = {
    "flexlora": "its server takes the SVD of Σ_k p_k s_k B_k A_k, a sum of each client's own product, "
                "not of its uploaded factors",
    "flora": "its server stacks every client's own factors side by side (a concatenation, not a sum)",
    "hetlora": "its server weights each client by the norm of its own product ‖B_k A_k‖_F",
    "fedex": "its server's residual Σ_k p_k B_k A_k − B̄Ā needs each client's own product",
    "lora-fair": "its server's correction of B̄ is solved from every client's own B_k and A_k",
    "lora-a2": "its uploads are sparse (index, value) pairs whose index sets differ by client and would be "
               "revealed; a sum needs them densified first (not built)",
    "centralized": "a reference that uploads nothing (there is no aggregate to protect)",
    "local": "a reference that uploads nothing (there is no aggregate to protect)",
}


def _name(method) -> str:
    name = method if isinstance(method, str) else method.name if isinstance(method, type) and \
        issubclass(method, Method) else None
    if not isinstance(name, str):
        raise ConfigError(f"secagg: expected a method name or Method class, got {method!r}")
    return name


def secagg_refusal(method) -> str | None:
    """``None`` if SecAgg+ can serve ``method`` (a name or Method class), else one line saying why not."""
    name = _name(method)
    if name in SUM_METHODS:
        return None
    if name in REFUSED:
        return f"secure aggregation (SecAgg+) cannot serve method {name!r}: {REFUSED[name]}"
    return (f"secure aggregation (SecAgg+) cannot serve method {name!r}: it is not in fedlora.secagg's table of "
            f"methods whose aggregate is a weighted sum of the uploads ({', '.join(sorted(SUM_METHODS))})")


def secagg_weighting(method) -> str:
    """"data" or "uniform" (``SUM_METHODS``); ``ConfigError`` with the refusal for any other method."""
    why = secagg_refusal(method)
    if why is not None:
        raise ConfigError(why)
    return SUM_METHODS[_name(method)][0]


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def share_settings(num_shares, reconstruction_threshold, n_clients: int) -> tuple[int, int]:
    """SecAgg+'s (k, t) for a round of ``n_clients`` participants (Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure
    Single-Server Aggregation with (Poly)Logarithmic Overhead", ACM CCS 2020, §3–4: each client's mask seeds are
    secret-shared over its neighbourhood of k clients, itself included, and rebuilt from any t of the shares).

    ``num_shares``: ``"auto"`` = every participant (k = N: the complete graph, SecAgg's), or an integer
    3 ≤ k ≤ N — below N, odd (Flower's graph is a ring: each client and (k−1)/2 neighbours on each side; an even k
    Flower raises by one with a warning, so it is refused here instead). ``reconstruction_threshold``: ``"auto"``
    = a majority of the neighbourhood, max(2, ⌊k/2⌋ + 1), or an integer 2 ≤ t < k (Flower's bounds). A higher t
    needs more colluding clients to unmask one upload, and lets fewer of a neighbourhood drop out. Returns (k, t);
    one line naming the field otherwise — and for fewer than 3 participants, which SecAgg+ cannot serve (Flower's
    num_shares > 2; with 2, each would learn the other's upload from the sum)."""
    n = n_clients
    if not _count(n) or n < 3:
        raise ConfigError(f"secure aggregation (SecAgg+) needs at least 3 clients per round (with 2, each would learn "
                          f"the other's upload from the sum), got {n!r}")
    if num_shares == "auto":
        k = n
    elif not _count(num_shares) or not 3 <= num_shares <= n:
        raise ConfigError(f"secagg.num_shares: 'auto' (every participant, {n}) or an integer from 3 to the "
                          f"{n} clients of a round, got {num_shares!r}")
    elif num_shares < n and num_shares % 2 == 0:
        raise ConfigError(f"secagg.num_shares: below the round's {n} clients it must be odd (each client and "
                          f"(k−1)/2 neighbours on each side; Flower would raise {num_shares} to {num_shares + 1}), "
                          f"got {num_shares}")
    else:
        k = num_shares
    if reconstruction_threshold == "auto":
        return k, max(2, k // 2 + 1)
    if not _count(reconstruction_threshold) or not 2 <= reconstruction_threshold < k:
        raise ConfigError(f"secagg.reconstruction_threshold: 'auto' (a majority, {max(2, k // 2 + 1)}) or an integer "
                          f"from 2 to num_shares − 1 ({k - 1}), got {reconstruction_threshold!r}")
    return k, reconstruction_threshold


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The clients' weights as Flower's ``num_examples`` (integers ≥ 1): data sizes must be whole numbers."""
    out = []
    for k, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 1 or w != int(w):
            raise ConfigError(f"secagg: client {k}'s weight must be a whole number ≥ 1 (its data size; Flower's "
                              f"num_examples), got {w!r}")
        out.append(int(w))
    return out


def choose_max_weight(weights: Sequence[float]) -> float:
    """W = max_k n_k: the smallest max_weight with every n_k/W ≤ 1, hence the tightest bound (module doc)."""
    return float(max(integer_weights(weights)))


@dataclass(frozen=True)
class SecAggQuantisation:
    """Flower's SecAgg+ quantisation settings (``SecAggPlusWorkflow``'s keyword arguments, same defaults
    except ``max_weight``, which has none: pick it with ``choose_max_weight``)."""

    max_weight: float
    clipping_range: float = 8.0
    quantization_range: int = 2 ** 22
    modulus_range: int = 2 ** 32

    def __post_init__(self) -> None:
        for field_, v in (("max_weight", self.max_weight), ("clipping_range", self.clipping_range)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"secagg.{field_}: must be a finite number > 0, got {v!r}")
        q, m = self.quantization_range, self.modulus_range
        if isinstance(q, bool) or not isinstance(q, int) or q < 2:
            raise ConfigError(f"secagg.quantization_range: must be an integer ≥ 2, got {q!r}")
        if isinstance(m, bool) or not isinstance(m, int) or m <= q or m & (m - 1) or m > 2 ** 32:
            raise ConfigError(f"secagg.modulus_range: must be a power of 2 above quantization_range ({q}) and at "
                              f"most 2**32 (Flower's limit), got {m!r}")

    @property
    def step(self) -> float:
        """Δ = 2c / Q: the grid step of one client's weighted value."""
        return 2.0 * self.clipping_range / self.quantization_range

    def check_clients(self, n_clients: int) -> None:
        """Refuse a number of clients whose sum of quantised values could wrap around modulo M (N·Q ≥ M)."""
        if not isinstance(n_clients, int) or n_clients < 1:
            raise ConfigError(f"secagg: the number of clients must be an integer ≥ 1, got {n_clients!r}")
        if n_clients * self.quantization_range >= self.modulus_range:
            raise ConfigError(f"secagg: {n_clients} clients × quantization_range {self.quantization_range} reach "
                              f"modulus_range {self.modulus_range} (the masked sum would wrap around); use at most "
                              f"{(self.modulus_range - 1) // self.quantization_range} clients or a smaller "
                              "quantization_range")

    def weight_quanta(self, weights: Sequence[float]) -> list[int]:
        """q_k = round(n_k / W · Q), as Flower's client computes it; refuses n_k > W (Flower only warns)."""
        ns = integer_weights(weights)
        big = [n for n in ns if n > self.max_weight]
        if big:
            raise ConfigError(f"secagg.max_weight: {self.max_weight:g} is below a client's weight {max(big)}; "
                              f"use max_weight ≥ {max(ns)} (fedlora.secagg.choose_max_weight)")
        return [round(n / self.max_weight * self.quantization_range) for n in ns]

    def error_bound(self, weights: Sequence[float], max_abs: float) -> float:
        """The bound on |SecAgg+ result − Σ_k p_k x_k| per coordinate (p_k = n_k / Σ n), for values
        |x_k| ≤ ``max_abs``: N · (2c + X) / Σ_k q_k · (1 + 2⁻²⁰) (module docstring)."""
        qs = self.weight_quanta(weights)
        self.check_clients(len(qs))
        if not (math.isfinite(max_abs) and max_abs >= 0):
            raise ConfigError(f"secagg.error_bound: max_abs must be a finite number ≥ 0, got {max_abs!r}")
        return len(qs) * (2.0 * self.clipping_range + float(max_abs)) / sum(qs) * (1.0 + 2.0 ** -20)

    def upload_bound(self, weights: Sequence[float], max_abs: float, dtype: torch.dtype = torch.float32) -> float:
        """The bound of ``error_bound`` once the aggregate is cast back to the uploads' ``dtype``
        (``summed_payload``): + (X + bound)·u, u = 2⁻ᵖ the unit roundoff of ``dtype`` (2⁻²⁴ for float32) — what
        a run's server state may differ from the exact weighted mean of its uploads, per coordinate."""
        b = self.error_bound(weights, max_abs)
        return b + (float(max_abs) + b) * torch.finfo(dtype).eps / 2

    def check_values(self, arrays: Mapping[str, np.ndarray], weight: float, who: str = "upload") -> None:
        """Refuse, in one line, an upload whose weighted value (q_k/Q)·x falls outside [−c, c] — the values
        Flower would clip silently. ``arrays``: name → float array (``flatten_payload``)."""
        (q,) = self.weight_quanta([weight])
        ratio = q / self.quantization_range
        for name, a in arrays.items():
            if not np.all(np.isfinite(a)):
                raise ConfigError(f"secagg: {who} {name!r} has non-finite values")
            peak = float(np.max(np.abs(a))) * ratio if a.size else 0.0
            if peak > self.clipping_range:
                raise ConfigError(f"secagg: {who} {name!r} has a weighted value of magnitude {peak:.6g} (weight "
                                  f"{weight}/{self.max_weight:g}), outside the clipping range ±{self.clipping_range:g}; "
                                  "raise secagg.clipping_range (SecAgg+ would clip it silently)")


def flatten_payload(payload: Payload) -> tuple[list[str], list[np.ndarray]]:
    """The payload's tensors as float64 NumPy arrays in sorted name order (the order every client and the
    server agree on without being told). Refuses non-float tensors (index sets: not summable)."""
    names = sorted(payload.tensors)
    out = []
    for n in names:
        t = payload.tensors[n]
        if not t.is_floating_point():
            raise ConfigError(f"secagg: {n!r} is {str(t.dtype).replace('torch.', '')}, not a float tensor; only "
                              "float uploads can be summed")
        out.append(t.detach().cpu().to(torch.float64).numpy().copy())
    return names, out


def summed_payload(spec: Mapping[str, tuple[Sequence[int], torch.dtype]], arrays: Sequence[np.ndarray]) -> Payload:
    """The one pre-summed upload: ``arrays`` (SecAgg+'s result, sorted name order) back as tensors of
    ``spec``'s names, shapes and dtypes (name → (shape, dtype), e.g. from the uploads' template)."""
    names = sorted(spec)
    if len(arrays) != len(names):
        raise ConfigError(f"secagg: the aggregate has {len(arrays)} arrays, the uploads {len(names)} tensors")
    out = {}
    for n, a in zip(names, arrays):
        shape, dtype = spec[n]
        if tuple(a.shape) != tuple(shape):
            raise ConfigError(f"secagg: the aggregate of {n!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        out[n] = torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype)
    return Payload(out)

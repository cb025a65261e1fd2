"""Privacy accounting over Google's ``dp-accounting`` (the library ``flwr[dp]`` uses): no accountant of our own.

What is ours is only the record: per protected unit (a client's data set under sample-level DP, the
federation of clients under client-level DP) the list of compositions it REALLY took part in, each
``(q, σ, steps)`` = ``steps`` Poisson-subsampled Gaussian mechanisms with sampling rate q and noise
multiplier σ (the noise std over the L2 sensitivity). The record is plain JSON, so a checkpoint holds it and
a resumed run continues the same ε to the last bit. A client that sat a round out composes nothing for it
(participation chosen independently of the data is public): this is the realised participation the issue asks
for, not the expected one that some tools charge.

The mathematics is the library's:
- RDP of the Poisson-subsampled Gaussian mechanism: Mironov, Talwar, Zhang, "Rényi Differential Privacy of
  the Sampled Gaussian Mechanism" (arXiv:1908.10530, 2019), §3 (integer and fractional orders), as implemented
  by ``dp_accounting.rdp.RdpAccountant`` on its default orders (1.1 … 10.9, 11 … 63, 128 … 1024); composition
  adds RDP curves (Mironov, "Rényi Differential Privacy", CSF 2017, Prop. 1).
- RDP → (ε, δ): ``dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon``, the improved conversion
  ε = min_α [ RDP(α) + log(1 − 1/α) − (log δ + log α)/(α − 1) ] (Canonne, Kamath, Steinke, "The Discrete
  Gaussian for Differential Privacy", NeurIPS 2020, Prop. 12; Asoodeh et al., "Three Variants of Differential
  Privacy: Lossless Conversion and Applications", 2020/2021, eq. 20) — NOT the classic
  ε = min_α [ RDP(α) − log δ/(α − 1) ] (Mironov 2017, Prop. 3) of TensorFlow Privacy's older tutorials, which
  is larger. Opacus's RDP accountant uses the same improved conversion.
- σ for a target ε: ``dp_accounting.calibrate_dp_mechanism`` (Brent's method; the σ it returns is within 1e-6
  of the smallest σ meeting the target, on the safe side).

Speed: each distinct (q, σ)'s RDP curve costs the library ~0.1 s (fractional orders), so the per-step curve is
cached; a unit's curve is then Σ steps·curve in record order, the same arithmetic the library's
``SelfComposedDpEvent``/``ComposedDpEvent`` composition performs (tested to be bit-identical).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Iterator, Mapping

import numpy as np

from fedlora.errors import ConfigError

__all__ = ["PrivacyAccountant", "delta_from_data_size", "noise_multiplier_for", "check_epsilon", "check_delta",
           "check_noise_multiplier", "check_sampling_rate", "check_steps"]

#: the state record's layout version (``PrivacyAccountant.state_dict``)
STATE_VERSION = 1


def _real(value) -> float | None:
    """``value`` as a float when it is a real number (not a bool, not a string), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    return float(value)


def check_epsilon(epsilon, name: str = "epsilon") -> float:
    """ε as a float: a finite number > 0, else one-line ConfigError."""
    v = _real(epsilon)
    if v is None or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {epsilon!r}")
    return v


def check_delta(delta, name: str = "delta") -> float:
    """δ as a float: 0 < δ < 1, else one-line ConfigError."""
    v = _real(delta)
    if v is None or not 0.0 < v < 1.0:
        raise ConfigError(f"{name} must be a number with 0 < {name} < 1, got {delta!r}")
    return v


def check_noise_multiplier(sigma, name: str = "noise_multiplier") -> float:
    """σ as a float: a finite number ≥ 0 (0 = no noise, ε = ∞), else one-line ConfigError."""
    v = _real(sigma)
    if v is None or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{name} must be a finite number ≥ 0 (0 = no noise), got {sigma!r}")
    return v


def check_sampling_rate(q, name: str = "sampling_rate") -> float:
    """q as a float: 0 < q ≤ 1, else one-line ConfigError."""
    v = _real(q)
    if v is None or not 0.0 < v <= 1.0:
        raise ConfigError(f"{name} must be a number with 0 < {name} ≤ 1, got {q!r}")
    return v


def check_steps(steps, name: str = "steps") -> int:
    """A count of mechanism applications: an integer ≥ 1, else one-line ConfigError."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ConfigError(f"{name} must be an integer ≥ 1, got {steps!r}")
    return int(steps)


def delta_from_data_size(n: int) -> float:
    """δ = 1 / (2n) for a protected data set of n records.

    The rule of Li, Tramèr, Liang, Hashimoto, "Large Language Models Can Be Strong Differentially Private
    Learners" (ICLR 2022; their ``private-transformers`` engine's default ``target_delta = 1 / (2 *
    sample_size)``): below 1/n, as Dwork and Roth require ("The Algorithmic Foundations of Differential
    Privacy", FnT TCS 2014, §2.3: δ ≥ 1/n permits publishing a few records in the clear). n is the number of
    RECORDS protected — a client's examples under sample-level DP, the number of clients under client-level
    DP — never a number of batches or steps.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"the data size for delta must be an integer ≥ 1 (records), got {n!r}")
    return 1.0 / (2.0 * int(n))


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Silence the library's per-order warnings while it computes.

    ``_compute_log_a_frac`` logs (through absl, once per order) that an order close to 1 did not converge and
    is left out of the minimum over orders; leaving an order out can only raise ε (conservative), and at a
    few hundred lines per curve the message would bury a run's log."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _event(q: float, sigma: float, steps: int):
    """``steps`` compositions of the Poisson-subsampled Gaussian mechanism, as a ``dp_accounting`` event."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _accountant():
    from dp_accounting.rdp import RdpAccountant

    return RdpAccountant()  # default orders, add-or-remove-one neighbouring (what Poisson sampling needs)


@functools.lru_cache(maxsize=256)
def _rdp_per_step(q: float, sigma: float) -> np.ndarray:
    """The library's RDP curve (one value per order) of ONE Poisson-subsampled Gaussian step (read-only)."""
    with _quiet_absl():
        curve = _accountant().compose(_event(q, sigma, 1)).rdp
    curve.setflags(write=False)
    return curve


@functools.lru_cache(maxsize=1)
def _orders() -> np.ndarray:
    return _accountant().orders


def _epsilon_of(entries, delta: float) -> float:
    """ε at δ of the composition of ``entries`` ([q, σ, steps] each); 0 for none."""
    from dp_accounting.rdp import rdp_privacy_accountant

    if not entries:
        return 0.0
    rdp = np.zeros_like(_orders(), dtype=np.float64)
    for q, sigma, steps in entries:  # the library's own composition: _rdp += count * curve, in order
        rdp += steps * _rdp_per_step(q, sigma)
    with _quiet_absl():
        return float(rdp_privacy_accountant.compute_epsilon(_orders(), rdp, delta)[0])


class PrivacyAccountant:
    """The (q, σ, steps) compositions each protected unit has taken part in, and their (ε, δ).

    A unit is a key (str; ints are turned into their str): a client id under sample-level DP (each client's
    examples are the protected records, each client has its own ε), or one key for the whole federation under
    client-level DP (the clients are the records; q = expected participants / clients). Compositions with the
    same (q, σ) are merged into one entry (RDP composition adds, so the order does not change ε).

    ``state_dict()`` is plain JSON (``{"version": 1, "units": {unit: [[q, σ, steps], …]}}``);
    ``PrivacyAccountant.from_state_dict(s)`` gives back an accountant with the same ε to the last bit.
    """

    def __init__(self) -> None:
        self._units: dict[str, list[list]] = {}

    # ---- recording ------------------------------------------------------------------------------------
    def record(self, unit, sampling_rate, noise_multiplier, steps) -> None:
        """Compose ``steps`` Poisson-subsampled Gaussian steps (rate q, multiplier σ) into ``unit``'s record."""
        q = check_sampling_rate(sampling_rate)
        sigma = check_noise_multiplier(noise_multiplier)
        n = check_steps(steps)
        entries = self._units.setdefault(str(unit), [])
        for entry in entries:
            if entry[0] == q and entry[1] == sigma:
                entry[2] += n
                return
        entries.append([q, sigma, n])

    def record_round(self, participation: Mapping) -> None:
        """One round's REALISED participation: ``{unit: (q, σ, steps)}`` for the units that took part (a unit
        absent from the mapping composes nothing this round). All entries are checked before any is recorded,
        so a bad one leaves the record as it was."""
        if not isinstance(participation, Mapping):
            raise ConfigError(f"a round's participation must be a mapping unit → (q, σ, steps), "
                              f"got {type(participation).__name__}")
        checked = []
        for unit, spec in participation.items():
            if not isinstance(spec, (tuple, list)) or len(spec) != 3:
                raise ConfigError(f"participation of {unit!r} must be (sampling_rate, noise_multiplier, steps), "
                                  f"got {spec!r}")
            q, sigma, steps = spec
            checked.append((unit, check_sampling_rate(q, f"sampling_rate of {unit!r}"),
                            check_noise_multiplier(sigma, f"noise_multiplier of {unit!r}"),
                            check_steps(steps, f"steps of {unit!r}")))
        for unit, q, sigma, steps in checked:
            self.record(unit, q, sigma, steps)

    # ---- reading -----------------------------------------------------------------------------------------
    @property
    def units(self) -> list[str]:
        return list(self._units)

    def compositions(self, unit) -> list[tuple[float, float, int]]:
        """``unit``'s record: [(q, σ, steps), …] in first-seen order ([] for a unit never recorded)."""
        return [tuple(e) for e in self._units.get(str(unit), [])]

    def epsilon(self, delta, unit=None) -> float:
        """ε at ``delta`` of ``unit`` (0 when it never took part); with ``unit=None`` the largest over all units
        (the run's guarantee: every unit's is at most this), 0 for an empty record."""
        d = check_delta(delta)
        if unit is not None:
            return _epsilon_of(self._units.get(str(unit), []), d)
        return max((_epsilon_of(e, d) for e in self._units.values()), default=0.0)

    def epsilons(self, delta) -> dict[str, float]:
        """ε at ``delta`` of every unit recorded so far."""
        d = check_delta(delta)
        return {u: _epsilon_of(e, d) for u, e in self._units.items()}

    def epsilon_after(self, participation: Mapping, delta) -> float:
        """The largest ε at ``delta`` over units if ``participation`` (as ``record_round``) were recorded next,
        the record left unchanged: what a run asks before a round, to stop cleanly within its budget."""
        trial = PrivacyAccountant.from_state_dict(self.state_dict())
        trial.record_round(participation)
        return trial.epsilon(delta)

    # ---- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION,
                "units": {u: [[float(q), float(s), int(n)] for q, s, n in e] for u, e in self._units.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION \
                or not isinstance(state.get("units"), Mapping):
            raise ConfigError(f"privacy accountant state must be {{'version': {STATE_VERSION}, 'units': {{...}}}}, "
                              f"got {state!r:.200}")
        units: dict[str, list[list]] = {}
        for unit, entries in state["units"].items():
            rows = []
            for entry in entries:
                if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                    raise ConfigError(f"privacy accountant state of {unit!r}: each composition must be "
                                      f"[q, sigma, steps], got {entry!r}")
                rows.append([check_sampling_rate(entry[0], f"sampling_rate of {unit!r}"),
                             check_noise_multiplier(entry[1], f"noise_multiplier of {unit!r}"),
                             check_steps(entry[2], f"steps of {unit!r}")])
            units[str(unit)] = rows
        self._units = units

    @classmethod
    def from_state_dict(cls, state: Mapping) -> "PrivacyAccountant":
        acc = cls()
        acc.load_state_dict(state)
        return acc


def noise_multiplier_for(target_epsilon, delta, sampling_rate, steps) -> float:
    """The smallest σ (within the library's tolerance, 1e-6) whose ``steps`` Poisson-subsampled Gaussian steps
    at rate q spend at most ``target_epsilon`` at ``delta``: ``dp_accounting.calibrate_dp_mechanism`` over a
    fresh ``RdpAccountant`` — the target mode that derives σ from (ε, δ, sampling rate, steps)."""
    return _calibrated(check_epsilon(target_epsilon, "target_epsilon"), check_delta(delta),
                       check_sampling_rate(sampling_rate), check_steps(steps))


@functools.lru_cache(maxsize=256)
def _calibrated(eps: float, d: float, q: float, n: int) -> float:
    """``noise_multiplier_for`` on checked values, remembered: the calibration takes ~0.1 s per try and tens of
    tries, and a grid (``fedlora compare --grid privacy.clip_norm=…``) asks it the same (ε, δ, q, steps) for
    every run of a seed — the library's answer is a pure function of them."""
    import dp_accounting

    with _quiet_absl():
        return float(dp_accounting.calibrate_dp_mechanism(_accountant, lambda s: _event(q, s, n), eps, d))

"""Every seed a run derives, from one helper: ``seed_of(run_seed, purpose, *ids)``.

A run has one seed; each random stream in it (who is drawn in a round, a method's own draws, a
testbed's initialisation, an LLM client's minibatch order, a data split …) gets its own integer from
``seed_of`` under a named purpose. The formulas differ between purposes because each stream was
fixed by the numbers it produced (the goldens), and changing one would change a run: so each
purpose keeps its own formula, written here and nowhere else.

================================  ==========  ==========================================================
purpose                           ids         value (``s`` = the seed given)
================================  ==========  ==========================================================
``PARTICIPANTS``                  round, g    ``(s·1 000 003 + round)·7 919 + g``: the clients federation g
                                              draws in a round (``fedlora.server.Federation``)
``FEDERATION``                    g           ``s + g``: a method's own draws in federation g when the
                                              method was given one integer seed
``H2TUNE_OMEGA``                  k           ``s·1 000 003 + 7 919·(k + 1)``: H²Tune's random Ω_k of
                                              client k (``s``: the federation's seed)
``FLORA_FRESH``                   round, l    ``((s·1 000 003 + round + 1)·104 729 + l) mod 2⁶³``: FLoRA's
                                              fresh adapters of layer l after a round's merge
``TESTBED_INIT``                  method      ``(1 000 003·s + crc32(method) mod 999 983 + 1) mod (2⁶³−1)``:
                                              the synthetic testbed's PEFT init and global RNG per
                                              (seed, method)
``TESTBED_METHOD``                method      ``TESTBED_INIT mod 2³¹``: the seed option the testbed
                                              gives a method (one per federation)
``RANK_RECOVERY``                 index       ``1 000 003·s + 17·index + 1``: rank recovery's
                                              initialisation and minibatches (index of the method in
                                              its method list)
``SAMPLER`` ``DROPOUT``           any         ``crc32(repr((s, purpose, *ids)))·2 654 435 761 mod (2⁶³−1)``:
``ADAPTER``                                   an LLM run's client minibatch order, dropout stream and
                                              adapter init (stable across processes: crc32, not hash)
``MODEL``                         —           the same hash ``mod 2³¹``: a model's fresh weights (a
                                              classifier or QA head, a randomly initialised model)
``DATA_SUBSAMPLE`` ``DATA_VAL``   (stream)    the integer that seeds NumPy exactly as
``DATA_TEST`` ``DATA_SPLIT``                  ``np.random.default_rng([s, stream])`` does (streams 7, 8,
                                              10; a subsample names its stream): the words of ``s``
                                              then the stream's, as NumPy's ``SeedSequence`` reads them
``DP_PARTICIPANTS``               round, g    the crc32 hash: the clients a round draws by Poisson
``DP_CLIENT_NOISE``                           sampling under client-level DP and the server's noise of
                                              round and federation g (``fedlora.privacy.client_dp``)
``DP_SAMPLE``                     kind,       the crc32 hash: sample-level DP-SGD's Poisson batch
                                  client,     (kind "batch") and noise (kind "noise") of a client at
                                  round, step a local step (``fedlora.privacy.dpsgd``); a step's further
                                              releases p ≥ 1 (private Per-FedAvg) "batch.p", "noise.p"
================================  ==========  ==========================================================

``clients_drawn(fraction, n)`` is the one formula of how many clients a round draws
(``fedlora.server.Federation.drawn_per_round``); it lives here, without torch, so a configuration
is checked against it before anything heavy is imported.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

from .errors import ConfigError

__all__ = ["seed_of", "clients_drawn", "PURPOSES", "PARTICIPANTS", "FEDERATION", "H2TUNE_OMEGA", "FLORA_FRESH",
           "TESTBED_INIT", "TESTBED_METHOD", "RANK_RECOVERY", "SAMPLER", "DROPOUT", "ADAPTER", "MODEL",
           "DATA_SUBSAMPLE", "DATA_VAL", "DATA_TEST", "DATA_SPLIT", "DP_PARTICIPANTS",
           "DP_CLIENT_NOISE", "DP_SAMPLE"]

PARTICIPANTS = "participants"
FEDERATION = "federation"
H2TUNE_OMEGA = "h2tune-omega"
FLORA_FRESH = "flora-fresh"
TESTBED_INIT = "testbed-init"
TESTBED_METHOD = "testbed-method"
RANK_RECOVERY = "rank-recovery"
SAMPLER = "sampler"
DROPOUT = "dropout"
ADAPTER = "adapter"
MODEL = "model"
DATA_SUBSAMPLE = "data-subsample"
DATA_VAL = "data-val"
DATA_TEST = "data-test"
DATA_SPLIT = "data-split"
DP_PARTICIPANTS = "dp-participants"
DP_CLIENT_NOISE = "dp-client-noise"
DP_SAMPLE = "dp-sample"

_M63 = 2**63 - 1


def _hashed(s: Any, purpose: str, *ids: Any) -> int:
    # the tuple's repr is hashed as given (its ids keep their types): ("sampler", 3) ≠ ("sampler", 3.0)
    return zlib.crc32(repr((s, purpose, *ids)).encode()) * 2_654_435_761 % _M63


def _numpy_words(s: int, stream: int) -> int:
    """The integer whose 32-bit words (least significant first) are those of ``s`` then ``stream``:
    NumPy's ``SeedSequence`` reads ``[s, stream]`` as exactly these words, so ``default_rng`` of
    the integer is ``default_rng([s, stream])``, draw for draw."""
    s, stream = int(s), int(stream)
    if s < 0 or not 0 <= stream < 2**32:
        raise ConfigError(f"a data seed must be ≥ 0 and its stream in [0, 2³²), got {s}, {stream}")
    words = max(1, -(-s.bit_length() // 32))
    return s | (stream << (32 * words))


#: purpose → (number of ids, or None for any; formula of (s, *ids))
_FORMULAS: dict[str, tuple[int | None, Callable[..., int]]] = {
    PARTICIPANTS: (2, lambda s, rnd, g: (s * 1_000_003 + rnd) * 7_919 + g),
    FEDERATION: (1, lambda s, g: s + g),
    H2TUNE_OMEGA: (1, lambda s, k: s * 1_000_003 + 7_919 * (k + 1)),
    FLORA_FRESH: (2, lambda s, rnd, layer: ((s * 1_000_003 + rnd + 1) * 104_729 + layer) % (2**63)),
    TESTBED_INIT: (1, lambda s, method: (1_000_003 * s + zlib.crc32(method.encode()) % 999_983 + 1) % _M63),
    TESTBED_METHOD: (1, lambda s, method: _FORMULAS[TESTBED_INIT][1](s, method) % 2**31),
    RANK_RECOVERY: (1, lambda s, index: 1_000_003 * s + 17 * index + 1),
    SAMPLER: (None, lambda s, *ids: _hashed(s, SAMPLER, *ids)),
    DROPOUT: (None, lambda s, *ids: _hashed(s, DROPOUT, *ids)),
    ADAPTER: (None, lambda s, *ids: _hashed(s, ADAPTER, *ids)),
    MODEL: (0, lambda s: _hashed(s, MODEL) % 2**31),
    DATA_SUBSAMPLE: (1, _numpy_words),
    DATA_VAL: (0, lambda s: _numpy_words(s, 7)),
    DATA_TEST: (0, lambda s: _numpy_words(s, 8)),
    DATA_SPLIT: (0, lambda s: _numpy_words(s, 10)),
    DP_PARTICIPANTS: (2, lambda s, rnd, g: _hashed(s, DP_PARTICIPANTS, rnd, g)),
    DP_CLIENT_NOISE: (2, lambda s, rnd, g: _hashed(s, DP_CLIENT_NOISE, rnd, g)),
    DP_SAMPLE: (4, lambda s, kind, k, rnd, step: _hashed(s, DP_SAMPLE, kind, k, rnd, step)),
}

#: every purpose ``seed_of`` knows
PURPOSES = tuple(_FORMULAS)


def seed_of(run_seed: int, purpose: str, *ids: Any) -> int:
    """The seed of one random stream: ``run_seed`` (the run's, or the stream's parent seed such as
    a federation's) for ``purpose`` (one of ``PURPOSES``) and the ``ids`` that purpose names (see
    the module's table). An unknown purpose or a wrong number of ids is a one-line ``ConfigError``."""
    try:
        n_ids, formula = _FORMULAS[purpose]
    except (KeyError, TypeError):
        raise ConfigError(f"seed_of: unknown purpose {purpose!r}; known: {', '.join(PURPOSES)}") from None
    if n_ids is not None and len(ids) != n_ids:
        raise ConfigError(f"seed_of: purpose {purpose!r} takes {n_ids} id(s), got {len(ids)}: {ids!r}")
    return formula(run_seed, *ids)


def clients_drawn(sample_fraction: float, n_clients: int) -> int:
    """How many of ``n_clients`` a round draws at ``sample_fraction``: ⌈fraction·K⌉, at least one
    (the 1e-9 keeps a fraction such as 0.3 of 10 clients at 3, not 4, despite rounding)."""
    return max(1, math.ceil(sample_fraction * n_clients - 1e-9))

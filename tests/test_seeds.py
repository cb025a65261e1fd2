"""One owner of every seed (``fedlora.seeds.seed_of``) and of the clients-drawn-per-round formula.

Each purpose must give the very number the scheme it replaced gave (the goldens depend on it): the old
formulas are written out here, independently of the module, and a few values are pinned as literals."""
import math
import pathlib
import re
import zlib

import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.seeds import PURPOSES, clients_drawn, seed_of
from fedlora.server import Federation

ROOT = pathlib.Path(__file__).resolve().parents[1]
IDS = [0, 1, 2, 7, 123, 2**31 + 5]


@pytest.mark.parametrize("s", IDS)
def test_each_purpose_is_the_formula_it_replaced(s):
    for rnd in (0, 1, 9):
        for g in (0, 3):
            assert seed_of(s, "participants", rnd, g) == (s * 1_000_003 + rnd) * 7_919 + g  # Federation sampling
            assert seed_of(s, "flora-fresh", rnd, g) == ((s * 1_000_003 + rnd + 1) * 104_729 + g) % (2**63)
    for k in (0, 4):
        assert seed_of(s, "federation", k) == s + k  # a method's seed + federation
        assert seed_of(s, "h2tune-omega", k) == s * 1_000_003 + 7_919 * (k + 1)
        assert seed_of(s, "rank-recovery", k) == 1_000_003 * s + 17 * k + 1
        assert seed_of(s, "sampler", k) == zlib.crc32(repr((s, "sampler", k)).encode()) * 2_654_435_761 % (2**63 - 1)
        assert seed_of(s, "dropout", k) == zlib.crc32(repr((s, "dropout", k)).encode()) * 2_654_435_761 % (2**63 - 1)
    assert seed_of(s, "adapter", "q", 2, True) == \
        zlib.crc32(repr((s, "adapter", "q", 2, True)).encode()) * 2_654_435_761 % (2**63 - 1)
    assert seed_of(s, "model") == zlib.crc32(repr((s, "model")).encode()) * 2_654_435_761 % (2**63 - 1) % 2**31
    for name in ("fedavg", "h2tune", "pf2lora"):
        full = (1_000_003 * s + zlib.crc32(name.encode()) % 999_983 + 1) % (2**63 - 1)
        assert seed_of(s, "testbed-init", name) == full
        assert seed_of(s, "testbed-method", name) == full % 2**31


def test_pinned_values():
    """Literals computed with the schemes before they moved here (llm runtime's tuple hash, the testbed's)."""
    assert seed_of(3, "sampler", 2) == 1037434861818181933
    assert seed_of(0, "dropout", 1) == 4354498979990403640
    assert seed_of(5, "adapter", "l0", 1, True) == 7523579204340598326
    assert seed_of(7, "model") == 1303170416
    assert seed_of(4, "testbed-init", "h2tune") == 4042707


@pytest.mark.parametrize("s", [0, 1, 42, 2**32 - 1, 2**32, 2**40 + 3])
def test_data_purposes_seed_numpy_as_the_seed_list_did(s):
    """``default_rng([seed, stream])`` (the data splits' old seeds) draws exactly what the integer does."""
    def draws(seed):
        return np.random.default_rng(seed).integers(0, 2**62, 8)

    for purpose, stream in (("data-val", 7), ("data-test", 8), ("data-split", 10)):
        assert (draws(seed_of(s, purpose)) == draws([s, stream])).all()
    for stream in (0, 1, 3):
        assert (draws(seed_of(s, "data-subsample", stream)) == draws([s, stream])).all()


def test_bad_purpose_or_ids_is_one_line():
    with pytest.raises(ConfigError, match=r"unknown purpose 'sampling'; known: participants, federation") as e:
        seed_of(0, "sampling", 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"'participants' takes 2 id\(s\), got 1"):
        seed_of(0, "participants", 1)
    assert len(set(PURPOSES)) == len(PURPOSES) == 18


@pytest.mark.parametrize("fraction,K,drawn", [(1.0, 5, 5), (0.5, 3, 2), (0.3, 10, 3), (0.7, 10, 7), (0.01, 10, 1),
                                              (0.25, 4, 1), (1 / 3, 3, 1), (0.6, 5, 3),
                                              (0.28, 25, 7)])  # 0.28·25 = 7.000000000000001 in floats
def test_clients_drawn(fraction, K, drawn):
    assert clients_drawn(fraction, K) == drawn
    fed = Federation(2, K, sample_fraction=fraction, sample_seed=1)
    assert fed.drawn_per_round == drawn
    assert all(len(fed.participants(r, g)) == drawn for r in range(3) for g in range(2))


def test_participants_use_the_participants_seed():
    fed = Federation(2, 10, sample_fraction=0.3, sample_seed=4)
    for rnd, g in ((0, 0), (2, 1)):
        gen = torch.Generator().manual_seed((4 * 1_000_003 + rnd) * 7_919 + g)
        assert fed.participants(rnd, g) == sorted(torch.randperm(10, generator=gen)[:3].tolist())


def _sources(*folders):
    for folder in folders:
        for p in sorted((ROOT / folder).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), p.read_text()


#: files of the LLM runtime and data that still hold their own seed scheme / drawn formula until they are
#: converted to the helpers (their call sites are listed in the note of this change); shrink, never grow
_NOT_YET = {"llm/runtime.py"}


def test_seed_formulas_and_the_drawn_formula_live_in_one_place():
    """No other module multiplies seeds by the schemes' constants, hashes a seed tuple, seeds NumPy with a
    [seed, stream] list, or writes the ⌈fraction·K⌉ formula."""
    patterns = [r"1_000_003", r"7_919", r"104_729", r"2_654_435_761", r"crc32\(", r"default_rng\(\[",
                r"ceil\([^)]*sample_fraction"]
    found = [f"{path}: {pat}" for path, text in _sources("fedlora", "synthetic", "llm")
             for pat in patterns if re.search(pat, text)
             and path not in {"fedlora/seeds.py", *_NOT_YET}]
    assert not found, found

"""Tests for fedlora.partition (docs/design.md §5): exact coverage, determinism, heterogeneity limits, errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlora.errors import ConfigError
from fedlora.partition import (
    by_key,
    check_partition,
    dirichlet,
    disjoint,
    iid,
    label_histograms,
    parse_partition,
    partition,
    pathological,
    pathological_pairs,
    plot_label_histograms,
    similarity,
)

HYP = settings(  # FEDLORA_HYP_EXAMPLES=1000 for a longer soak; no example database in the tree
    max_examples=int(os.environ.get("FEDLORA_HYP_EXAMPLES", "40")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def balanced_labels(n_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(n_classes), per_class))


def kl(p: np.ndarray, q: np.ndarray) -> float:
    p = p / p.sum()
    q = q / q.sum()
    m = p > 0
    return float(np.sum(p[m] * np.log(p[m] / q[m])))


def dominant_share(hist: np.ndarray) -> np.ndarray:
    rows = hist[hist.sum(1) > 0]
    return rows.max(1) / rows.sum(1)


@st.composite
def labelled(draw, min_n=1, max_n=300, max_classes=8):
    n = draw(st.integers(min_n, max_n))
    n_classes = draw(st.integers(1, max_classes))
    labels = np.array(draw(st.lists(st.integers(0, n_classes - 1), min_size=n, max_size=n)))
    n_clients = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**32 - 1))
    return labels, n_clients, seed


# ------------------------------------------------------------------ every index exactly once
@HYP
@given(labelled())
def test_every_index_exactly_once(case):
    labels, m, seed = case
    n = labels.size
    check_partition(iid(n, m, seed), n)
    check_partition(disjoint(n, m, seed), n)
    check_partition(disjoint(labels, m, seed, stratify=True), n)
    check_partition(dirichlet(labels, m, 0.5, seed, min_size=0), n)
    check_partition(similarity(labels, m, seed % 101 / 100, seed), n)
    check_partition(pathological(labels, m, max(1, n // m // 2), seed), n)
    check_partition(by_key(labels), n)
    check_partition(by_key(labels, n_clients=min(m, np.unique(labels).size), seed=seed), n)
    for parts in [iid(n, m, seed), dirichlet(labels, m, 1.0, seed, min_size=0)]:
        assert len(parts) == m
        assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)


@HYP
@given(
    n_pairs=st.integers(1, 6),
    g=st.integers(1, 3),
    extra=st.lists(st.integers(0, 20), min_size=12, max_size=12),
    seed=st.integers(0, 10**6),
)
def test_pathological_pairs_exactly_two_classes(n_pairs, g, extra, seed):
    n_classes = 2 * n_pairs
    sizes = [g + e for e in extra[:n_classes]]
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(n_classes), sizes))
    parts = pathological_pairs(labels, n_pairs * g, seed)
    check_partition(parts, labels.size)
    for i, p in enumerate(parts):
        pair = i // g
        assert set(np.unique(labels[p]).tolist()) == {2 * pair, 2 * pair + 1}


def test_pathological_pairs_paper_setting():
    """LoRA-A² App. C: 20 clients, 20 classes; clients 2k, 2k+1 each hold half of classes 2k, 2k+1."""
    labels = balanced_labels(20, 50)
    parts = pathological_pairs(labels, seed=3)
    assert len(parts) == 20
    hist = label_histograms(labels, parts, 20)
    for k in range(10):
        for i in (2 * k, 2 * k + 1):
            assert np.flatnonzero(hist[i]).tolist() == [2 * k, 2 * k + 1]
            assert hist[i, 2 * k] == hist[i, 2 * k + 1] == 25
    assert (hist > 0).sum(1).tolist() == [2] * 20
    # string labels work too (classes = sorted distinct values)
    names = np.array(["a", "b", "c", "d"])[balanced_labels(4, 10)]
    p2 = pathological_pairs(names, seed=0)
    assert [sorted(set(names[p])) for p in p2] == [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]


# ------------------------------------------------------------------ determinism
SCHEMES = {
    "iid": lambda y, s: iid(y.size, 7, s),
    "dirichlet": lambda y, s: dirichlet(y, 7, 0.3, s),
    "pathological": lambda y, s: pathological(y, 7, 2, s),
    "similarity": lambda y, s: similarity(y, 7, 0.5, s),
    "disjoint": lambda y, s: disjoint(y, 7, s, stratify=True),
    "pairs": lambda y, s: pathological_pairs(y, 10, s),
    "by_key_grouped": lambda y, s: by_key(np.arange(y.size) % 23, 7, s),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_deterministic_per_seed_and_differs_across_seeds(name):
    y = balanced_labels(10, 60)
    a, b, c = SCHEMES[name](y, 11), SCHEMES[name](y, 11), SCHEMES[name](y, 12)
    assert all(np.array_equal(x, z) for x, z in zip(a, b))
    # (by_key_grouped: the seed only breaks ties in key size, and 23 near-equal keys have many)
    assert any(not np.array_equal(x, z) for x, z in zip(a, c))


# ------------------------------------------------------------------ dirichlet limits
def test_dirichlet_large_alpha_is_close_to_iid():
    y = balanced_labels(10, 2000)
    glob = np.bincount(y).astype(float)
    hist = label_histograms(y, dirichlet(y, 10, 1e4, seed=0), 10)
    kls = [kl(h.astype(float), glob) for h in hist]
    assert max(kls) < 5e-3, kls
    sizes = hist.sum(1)
    assert sizes.min() > 0.9 * sizes.mean()


def test_dirichlet_tiny_alpha_one_class_per_client():
    # Dir(α → 0) puts each class on a single client ...
    y = balanced_labels(5, 200)
    class_conc = []
    for seed in range(5):
        hist = label_histograms(y, dirichlet(y, 5, 1e-3, seed), 5)  # default min_size = 1
        assert hist.sum(1).min() >= 1
        class_conc.append(dominant_share(hist.T).mean())
    assert np.mean(class_conc) >= 0.95, class_conc
    # ... and with as many clients as classes and the NIID-Bench size cap, one class per client
    for n_classes, per_class in ((5, 200), (10, 100)):
        yk = balanced_labels(n_classes, per_class)
        shares = []
        for seed in range(5):
            hist = label_histograms(yk, dirichlet(yk, n_classes, 1e-3, seed, balance=True), n_classes)
            shares.append(dominant_share(hist).mean())
            assert hist.sum(1).min() >= 1
        assert np.mean(shares) >= 0.95, shares
    # without the cap and with min_size = 0, clients that get data mostly get one class
    y4 = balanced_labels(4, 100)
    shares = [dominant_share(label_histograms(y4, dirichlet(y4, 100, 1e-3, s, min_size=0), 4)).mean() for s in range(10)]
    assert np.mean(shares) >= 0.95, shares


def test_dirichlet_min_size_is_met():
    y = balanced_labels(4, 100)
    for seed in range(3):
        parts = dirichlet(y, 10, 0.1, seed, min_size=10)
        assert min(len(p) for p in parts) >= 10
        check_partition(parts, y.size)


def test_dirichlet_impossible_min_size_raises_clearly():
    y = balanced_labels(4, 25)  # n = 100
    with pytest.raises(ConfigError, match=r"min_size=11.*n_clients=10.*exceeds the 100 samples"):
        dirichlet(y, 10, 0.5, 0, min_size=11)
    with pytest.raises(ConfigError, match=r"max_tries=5.*min_size=1"):
        dirichlet(balanced_labels(2, 50), 10, 1e-3, 0, max_tries=5)  # 2 near-one-hot classes, 10 clients
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------ similarity
def test_similarity_one_is_iid_and_zero_is_sorted_chunks():
    y = balanced_labels(10, 300)
    for seed in (0, 1):
        s1 = similarity(y, 8, 1.0, seed)
        assert all(np.array_equal(a, b) for a, b in zip(s1, iid(y.size, 8, seed)))
        glob = np.bincount(y).astype(float)
        assert max(kl(h.astype(float), glob) for h in label_histograms(y, s1, 10)) < 0.05
    sorted_chunks = np.array_split(np.argsort(y, kind="stable"), 8)
    for seed in (0, 5):
        s0 = similarity(y, 8, 0.0, seed)
        assert all(np.array_equal(a, np.sort(b)) for a, b in zip(s0, sorted_chunks))
    # labels of client j all ≤ labels of client j+1 (contiguous label-sorted chunks)
    s0 = similarity(y, 8, 0.0, 0)
    assert all(y[s0[j]].max() <= y[s0[j + 1]].min() for j in range(7))


def test_similarity_heterogeneity_decreases_with_s():
    y = balanced_labels(10, 300)
    glob = np.bincount(y).astype(float)
    mean_kl = [
        np.mean([kl(h.astype(float) + 1e-12, glob) for h in label_histograms(y, similarity(y, 10, s, 0), 10)])
        for s in (0.0, 0.3, 0.7, 1.0)
    ]
    assert all(a > b for a, b in zip(mean_kl, mean_kl[1:])), mean_kl


# ------------------------------------------------------------------ pathological, disjoint, by_key
def test_pathological_k_classes_when_shards_align():
    y = balanced_labels(10, 100)  # 20 shards of 50 → every shard is one class
    for seed in range(3):
        hist = label_histograms(y, pathological(y, 10, 2, seed), 10)
        assert ((hist > 0).sum(1) <= 2).all()
        assert (hist.sum(1) == 100).all()


def test_pathological_gives_each_client_k_whole_shards_drawn_at_random():
    """Every label distinct (labels = 0..n−1), so the label sort is the identity and shard s is exactly
    the indices [s·size, (s+1)·size): each client must hold exactly k whole shards, every shard once; and
    which shards a client gets is a uniform random draw — over 400 seeds each (client, shard) pair comes
    up about 400·k/(M·k) = 100 times (sd ≈ 8.7), the shards of a client are not always neighbours (a
    sorted, consecutive deal), and the draw changes with the seed."""
    M, k, size = 4, 2, 5
    n = M * k * size
    labels = np.arange(n)[::-1].copy()  # distinct labels, not in index order: the sort must happen
    counts = np.zeros((M, M * k), dtype=int)
    adjacent, draws = 0, set()
    for seed in range(400):
        parts = pathological(labels, M, k, seed)
        owned = []
        for j, p in enumerate(parts):
            shards_of_j = np.unique((n - 1 - p) // size)  # shard of each index: by rank of its label
            assert shards_of_j.size == k and p.size == k * size, (seed, j, p)
            assert all(np.sum((n - 1 - p) // size == s) == size for s in shards_of_j)  # whole shards
            counts[j, shards_of_j] += 1
            adjacent += int(np.all(np.diff(shards_of_j) == 1))
            owned.append(tuple(shards_of_j))
        assert sorted(s for o in owned for s in o) == list(range(M * k)), seed  # every shard exactly once
        draws.add(tuple(owned))
    assert counts.min() >= 60 and counts.max() <= 140, counts
    # P(a client's 2 of 8 shards are neighbours) = 7 / C(8, 2) = 1/4: about 400 of the 1600 hands
    assert 300 <= adjacent <= 500, adjacent
    assert len(draws) > 350


def test_disjoint_more_clients_more_heterogeneity():
    y = balanced_labels(10, 300)
    glob = np.bincount(y) / y.size

    def mean_tv(m):
        h = label_histograms(y, disjoint(y, m, seed=0), 10).astype(float)
        return np.mean(0.5 * np.abs(h / h.sum(1, keepdims=True) - glob).sum(1))

    tv = [mean_tv(m) for m in (3, 20, 50)]
    assert tv[0] < tv[1] < tv[2], tv
    strat = label_histograms(y, disjoint(y, 50, 0, stratify=True), 10)
    assert strat.max() - strat.min() <= 1
    with pytest.raises(ConfigError, match="stratify"):
        disjoint(100, 5, stratify=True)


def test_by_key_one_client_per_key_mapping_and_grouping():
    keys = np.array(["sports", "tech", "sports", "food", "tech", "tech", "food"])
    parts, held = by_key(keys, return_keys=True)
    assert held == [["food"], ["sports"], ["tech"]]
    assert [p.tolist() for p in parts] == [[3, 6], [0, 2], [1, 4, 5]]
    parts = by_key(keys, mapping={"sports": 0, "tech": 1, "food": 1})
    assert [p.tolist() for p in parts] == [[0, 2], [1, 3, 4, 5, 6]]
    parts, held = by_key(keys, n_clients=2, return_keys=True)
    check_partition(parts, keys.size)
    assert sorted(map(len, held)) == [1, 2] and held[0] == ["tech"]  # largest key alone
    with pytest.raises(ConfigError, match="no client for key"):
        by_key(keys, mapping={"sports": 0})
    with pytest.raises(ConfigError, match=r"n_clients must be in \[1, 3\]"):
        by_key(keys, n_clients=4)


# ------------------------------------------------------------------ histograms and plot
@HYP
@given(labelled(max_n=200))
def test_histograms_sum_to_n(case):
    labels, m, seed = case
    parts = dirichlet(labels, m, 0.5, seed, min_size=0)
    hist = label_histograms(labels, parts, 8)
    assert hist.shape == (m, 8)
    assert hist.sum() == labels.size
    assert hist.sum(1).tolist() == [len(p) for p in parts]
    assert hist.sum(0).tolist() == np.bincount(labels, minlength=8).tolist()


def test_plot_label_histograms(tmp_path):
    y = balanced_labels(6, 50)
    hist = label_histograms(y, dirichlet(y, 8, 0.3, 0), 6)
    out = plot_label_histograms(hist, str(tmp_path / "h.png"), title="Dir(0.3)")
    data = (tmp_path / "h.png").read_bytes()
    assert out.endswith("h.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    plot_label_histograms(hist, str(tmp_path / "n.png"), normalize=True, class_names=list("abcdef"))
    with pytest.raises(ConfigError, match="integers"):
        label_histograms(np.array(["a", "b"]), [np.array([0, 1])])


# ------------------------------------------------------------------ specs and validation
def test_parse_partition():
    assert parse_partition("iid") == ("iid", {})
    assert parse_partition("dirichlet(0.5)") == ("dirichlet", {"alpha": 0.5})
    assert parse_partition(" dirichlet(alpha=0.1, min_size=10) ") == ("dirichlet", {"alpha": 0.1, "min_size": 10})
    assert parse_partition("similarity(0.3)") == ("similarity", {"s": 0.3})
    assert parse_partition("pathological(2)") == ("pathological", {"k": 2})
    assert parse_partition("by_key(topic)") == ("by_key", {"column": "topic"})
    assert parse_partition("by_key('restaurant name')") == ("by_key", {"column": "restaurant name"})
    assert parse_partition("disjoint(20)") == ("disjoint", {"n_clients": 20})
    assert parse_partition("pairs") == ("pathological_pairs", {})
    assert parse_partition("dirichlet(0.5, balance=True)")[1]["balance"] is True


def test_partition_dispatch_matches_functions():
    y = balanced_labels(10, 40)
    same = lambda a, b: len(a) == len(b) and all(np.array_equal(x, z) for x, z in zip(a, b))  # noqa: E731
    assert same(partition("dirichlet(0.5)", labels=y, n_clients=5, seed=3), dirichlet(y, 5, 0.5, 3))
    assert same(partition("dirichlet", alpha=0.5, labels=y, n_clients=5, seed=3), dirichlet(y, 5, 0.5, 3))
    assert same(partition("iid", n=400, n_clients=4, seed=1), iid(400, 4, 1))
    assert same(partition("iid", labels=y, n_clients=4, seed=1), iid(400, 4, 1))
    assert same(partition("disjoint(20)", labels=y, seed=2), disjoint(y, 20, 2))
    assert same(partition("similarity(0.2)", labels=y, n_clients=6), similarity(y, 6, 0.2, 0))
    assert same(partition("pathological(3)", labels=y, n_clients=6), pathological(y, 6, 3, 0))
    assert same(partition("pairs", labels=y), pathological_pairs(y))
    topics = np.arange(400) % 7
    assert same(partition("by_key(topic)", columns={"topic": topics}), by_key(topics))
    assert same(partition("by_key", keys=topics, n_clients=3), by_key(topics, 3))


Y = balanced_labels(4, 25)  # n = 100


@pytest.mark.parametrize(
    "spec, kwargs, pattern",
    [
        ("nope(1)", {}, r"unknown partition 'nope'.*dirichlet"),
        ("dirichlet(0)", {}, r"alpha must be a finite number > 0"),
        ("dirichlet(-1)", {}, r"alpha must be a finite number > 0"),
        ("dirichlet(float('nan'))", {}, r"literals"),
        ("dirichlet", {}, r"missing parameter alpha"),
        ("dirichlet(0.5, beta=2)", {}, r"unknown parameter\(s\) 'beta';"),
        ("dirichlet(0.5, min_size=-1)", {}, r"min_size must be an integer ≥ 0"),
        ("dirichlet(0.5, max_tries=0)", {}, r"max_tries must be an integer ≥ 1"),
        ("similarity(1.5)", {}, r"s must be a number in \[0, 1\]"),
        ("similarity(-0.1)", {}, r"s must be a number in \[0, 1\]"),
        ("pathological(0)", {}, r"k \(shards per client\) must be an integer ≥ 1"),
        ("pathological(30)", {}, r"need k ≤ n // n_clients = 20"),
        ("iid", {"n_clients": 0}, r"n_clients must be an integer in \[1, n=100\]"),
        ("iid", {"n_clients": 101}, r"n_clients must be an integer in \[1, n=100\]"),
        ("iid", {"n_clients": 2.5}, r"n_clients must be an integer"),
        ("iid", {"n_clients": 5, "seed": -1}, r"seed must be a non-negative integer"),
        ("iid", {"n_clients": None}, r"n_clients is required"),
        ("pairs", {"n_clients": 3}, r"multiple of n_classes/2 = 2"),
        ("disjoint(5)", {"n_clients": 6}, r"n_clients=5 in the spec but n_clients=6"),
        ("by_key(topic)", {}, r"by_key needs keys"),
        ("dirichlet(0.5", {}, r"not of the form"),
        ("dirichlet(0.5, 2)", {}, r"one positional argument \(alpha\)"),
        ("", {}, r"non-empty string"),
    ],
)
def test_bad_specs_raise_config_error(spec, kwargs, pattern):
    kw = {"labels": Y, "n_clients": 5, **kwargs}
    with pytest.raises(ConfigError, match=pattern):
        partition(spec, **kw)


def test_pairs_needs_even_classes_and_enough_samples():
    with pytest.raises(ConfigError, match="even number"):
        pathological_pairs(balanced_labels(3, 10))
    with pytest.raises(ConfigError, match="every class needs ≥ 4 samples"):
        pathological_pairs(np.array([0, 0, 0, 1, 1, 1, 1, 1]), n_clients=4)
    with pytest.raises(ConfigError, match="labels must be a 1-D array"):
        dirichlet(np.zeros((3, 2)), 2, 1.0)

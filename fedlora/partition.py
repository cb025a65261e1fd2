"""Client data partitioning (docs/design.md §5).

Every function here is a pure function of numpy arrays (labels, key columns) or a sample count,
deterministic given an integer ``seed`` (``numpy.random.default_rng(seed)``), and returns a
partition: a ``list`` of ``n_clients`` 1-D ``int64`` index arrays, each sorted ascending, whose
union is ``arange(n)`` with every index assigned to exactly one client.  Shuffling *within* a
client is the data loader's job.

Schemes (name in the registry → function):

======================  ==========================================================================
``iid``                 uniform random, near-equal sizes                               (:func:`iid`)
``dirichlet(alpha)``    per-class Dir(α) proportions, Hsu et al. 2019          (:func:`dirichlet`)
``pathological(k)``     McMahan et al. 2017 label-sorted shards, k per client (:func:`pathological`)
``similarity(s)``       SCAFFOLD §7 / PF2LoRA §5: s·100 % i.i.d. + rest label-sorted
                                                                                (:func:`similarity`)
``by_key(column)``      one client per distinct key (topic / domain / restaurant) (:func:`by_key`)
``disjoint(n)``         RoLoRA Table 2: n disjoint equal random shards          (:func:`disjoint`)
``pathological_pairs``  LoRA-A² App. C: pairs of clients share a pair of classes
                                                                        (:func:`pathological_pairs`)
======================  ==========================================================================

:func:`partition` dispatches a spec string such as ``"dirichlet(0.5)"`` or
``"dirichlet(alpha=0.1, min_size=10)"`` (parsed by :func:`parse_partition`); every bad name or
parameter raises :class:`fedlora.errors.ConfigError` naming the parameter and its allowed range.
:func:`label_histograms` / :func:`plot_label_histograms` (:func:`draw_label_histograms` on given axes) report the per-client label mix.

Labels may be any sortable 1-D values (ints, strings); classes are the sorted distinct values
(``np.unique``), so "class c" below means the c-th smallest label.
"""
from __future__ import annotations

import ast
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import ConfigError, plural, quoted

__all__ = [
    "validate_partition_spec",
    "iid",
    "dirichlet",
    "pathological",
    "similarity",
    "by_key",
    "disjoint",
    "pathological_pairs",
    "label_histograms",
    "plot_label_histograms",
    "draw_label_histograms",
    "check_partition",
    "parse_partition",
    "partition",
    "PARTITIONERS",
]

Partition = list[np.ndarray]


# ----------------------------------------------------------------------------- validation helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_seed(seed: Any, where: str) -> int:
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"{where}: seed must be a non-negative integer (got {seed!r})")
    return int(seed)


def _check_n_clients(n_clients: Any, n: int, where: str) -> int:
    if not _is_int(n_clients) or not 1 <= n_clients <= n:
        raise ConfigError(
            f"{where}: n_clients must be an integer in [1, n={n}] (got {n_clients!r}); "
            "every client needs at least one sample"
            if n >= 1
            else f"{where}: the data set is empty (n=0); nothing to partition"
        )
    return int(n_clients)


def _as_1d(x: Any, name: str, where: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ConfigError(f"{where}: {name} must be a 1-D array (got shape {arr.shape})")
    if arr.size == 0:
        raise ConfigError(f"{where}: {name} is empty; nothing to partition")
    return arr


def _codes(labels: Any, where: str, name: str = "labels") -> tuple[np.ndarray, np.ndarray]:
    """(classes, codes): sorted distinct values and the (n,) int64 class index of every sample."""
    arr = _as_1d(labels, name, where)
    try:
        classes, codes = np.unique(arr, return_inverse=True)
    except TypeError as e:  # e.g. object arrays mixing str and int
        raise ConfigError(f"{where}: {name} must be mutually comparable values ({e})") from None
    return classes, codes.reshape(-1).astype(np.int64)


def _group(owner: np.ndarray, n_clients: int) -> Partition:
    """owner: (n,) client id per sample → list of sorted index arrays, one per client."""
    order = np.argsort(owner, kind="stable")  # stable ⇒ indices ascending within a client
    counts = np.bincount(owner, minlength=n_clients)
    return [a.astype(np.int64, copy=False) for a in np.split(order, np.cumsum(counts)[:-1])]


def _deal(chunks: Sequence[np.ndarray]) -> Partition:
    return [np.sort(np.asarray(c, dtype=np.int64)) for c in chunks]


def check_partition(parts: Sequence[np.ndarray], n: int) -> None:
    """Raise ``AssertionError`` unless ``parts`` assigns every index of ``range(n)`` exactly once."""
    allidx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.array([])
    assert allidx.size == n, f"{allidx.size} assignments for {n} samples"
    assert np.array_equal(np.sort(allidx), np.arange(n)), "indices missing or assigned twice"


# ----------------------------------------------------------------------------- schemes
def iid(n: int, n_clients: int, seed: int = 0) -> Partition:
    """Uniform random split of ``range(n)`` into ``n_clients`` parts whose sizes differ by ≤ 1.

    Shapes: returns ``n_clients`` arrays of size ``n // n_clients`` or ``n // n_clients + 1``.
    """
    where = "iid"
    if not _is_int(n) or n < 1:
        raise ConfigError(f"{where}: n must be a positive integer (got {n!r})")
    n_clients = _check_n_clients(n_clients, int(n), where)
    rng = np.random.default_rng(_check_seed(seed, where))
    return _deal(np.array_split(rng.permutation(int(n)), n_clients))


def dirichlet(
    labels: Any,
    n_clients: int,
    alpha: float,
    seed: int = 0,
    *,
    min_size: int = 1,
    max_tries: int = 1000,
    balance: bool = False,
) -> Partition:
    """Label-skew split with per-class Dirichlet proportions (Hsu, Qi & Brown 2019, §3;
    used by LoRA-A² §5.1 / App. A with α ∈ {0.01, 0.1, 0.5} and 30 clients).

    For every class c (in label order) draw ``p_c ~ Dir(α·1_{n_clients})`` and give client j the
    ``[⌊n_c·P_{j-1}⌋, ⌊n_c·P_j⌋)`` slice of a random permutation of the class (P = cumsum p_c).
    α → ∞ approaches i.i.d. label mixes; α → 0 puts each class on a single client.

    The whole draw is repeated (fresh proportions; at most ``max_tries`` times) until every client
    holds at least ``min_size`` samples (the FedLab / FederatedScope ``min_size`` rule).
    ``balance=True`` additionally applies the NIID-Bench cap (Li et al. 2022, ICDE): a client that
    already holds ≥ n / n_clients samples gets proportion 0 for the remaining classes.

    Args:
        labels: (n,) class label of every sample.
        n_clients: number of clients, 1 ≤ n_clients ≤ n.
        alpha: concentration α > 0.
        min_size: minimum samples per client, 0 ≤ min_size and min_size·n_clients ≤ n.
        max_tries: attempts before giving up (≥ 1).
        balance: apply the NIID-Bench size cap.
    Returns: ``n_clients`` sorted index arrays.
    Raises: ConfigError on bad parameters, or when no draw in ``max_tries`` meets ``min_size``.
    """
    where = "dirichlet"
    _, codes = _codes(labels, where)
    n = codes.size
    n_clients = _check_n_clients(n_clients, n, where)
    seed = _check_seed(seed, where)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (
        math.isfinite(alpha) and alpha > 0
    ):
        raise ConfigError(f"{where}: alpha must be a finite number > 0 (got {alpha!r})")
    if not _is_int(min_size) or min_size < 0:
        raise ConfigError(f"{where}: min_size must be an integer ≥ 0 (got {min_size!r})")
    if min_size * n_clients > n:
        raise ConfigError(
            f"{where}: min_size={min_size} per client × n_clients={n_clients} = "
            f"{min_size * n_clients} exceeds the {n} samples; need min_size ≤ n // n_clients = "
            f"{n // n_clients}"
        )
    if not _is_int(max_tries) or max_tries < 1:
        raise ConfigError(f"{where}: max_tries must be an integer ≥ 1 (got {max_tries!r})")

    class_sizes = np.bincount(codes)
    n_classes = class_sizes.size
    rng = np.random.default_rng(seed)
    conc = np.full(n_clients, float(alpha))
    cap = n / n_clients
    counts = None
    for _ in range(max_tries):
        # counts[c, j]: samples of class c given to client j.  Only counts are drawn per try; the
        # (costlier) permutation of samples happens once, after a draw is accepted.
        counts = np.zeros((n_classes, n_clients), dtype=np.int64)
        held = np.zeros(n_clients, dtype=np.int64)
        for c in range(n_classes):
            p = rng.dirichlet(conc)
            if balance:
                p = p * (held < cap)
            s = p.sum()
            if not np.isfinite(s) or s <= 0:  # all mass on capped clients / underflow
                eligible = (held < cap) if balance else np.ones(n_clients, dtype=bool)
                if not eligible.any():
                    eligible[:] = True
                p = np.zeros(n_clients)
                p[rng.choice(np.flatnonzero(eligible))] = 1.0
                s = 1.0
            cuts = np.floor(np.cumsum(p / s) * class_sizes[c]).astype(np.int64)
            cuts = np.minimum(cuts, class_sizes[c])
            cuts[-1] = class_sizes[c]
            counts[c] = np.diff(cuts, prepend=0)
            held += counts[c]
        if held.min() >= min_size:
            break
    else:
        raise ConfigError(
            f"{where}: no draw in max_tries={max_tries} gave every one of the {n_clients} clients "
            f"≥ min_size={min_size} samples (alpha={alpha}, n={n}, {plural(n_classes, 'class', 'classes')}; smallest "
            f"client in the last draw: {int(held.min())}). Lower min_size, raise alpha, use fewer "
            "clients, pass balance=True, or raise max_tries."
        )
    owner = np.empty(n, dtype=np.int64)
    for c in range(n_classes):
        idx = rng.permutation(np.flatnonzero(codes == c))
        owner[idx] = np.repeat(np.arange(n_clients), counts[c])
    return _group(owner, n_clients)


def pathological(labels: Any, n_clients: int, k: int = 2, seed: int = 0) -> Partition:
    """McMahan et al. 2017 (FedAvg, §3 "pathological non-IID"): sort the data by label, cut it into
    ``n_clients·k`` contiguous shards of near-equal size, and give each client ``k`` random shards.

    Within a class the order is randomised (seeded) before the stable label sort, so which
    samples of a class land in a shard depends on the seed.  A client sees at most ``k`` classes
    plus shard-boundary spill-over; two of its shards may come from the same class (as in the paper).

    Args: labels (n,); 1 ≤ n_clients; k ≥ 1 with n_clients·k ≤ n.
    Returns: ``n_clients`` sorted index arrays (sizes differ by at most k).
    """
    where = "pathological"
    _, codes = _codes(labels, where)
    n = codes.size
    n_clients = _check_n_clients(n_clients, n, where)
    if not _is_int(k) or k < 1:
        raise ConfigError(f"{where}: k (shards per client) must be an integer ≥ 1 (got {k!r})")
    if n_clients * k > n:
        raise ConfigError(
            f"{where}: n_clients·k = {n_clients}·{k} = {n_clients * k} shards exceeds the {n} "
            f"samples; need k ≤ n // n_clients = {n // n_clients}"
        )
    rng = np.random.default_rng(_check_seed(seed, where))
    perm = rng.permutation(n)
    order = perm[np.argsort(codes[perm], kind="stable")]
    shards = np.array_split(order, n_clients * k)
    shard_ids = rng.permutation(n_clients * k).reshape(n_clients, k)
    return _deal([np.concatenate([shards[s] for s in row]) for row in shard_ids])


def similarity(labels: Any, n_clients: int, s: float, seed: int = 0) -> Partition:
    """SCAFFOLD (Karimireddy et al. 2020, §7) as used by PF2LoRA (§5, "similarity s ∈ [0, 1]").

    A random ``round(s·n)`` samples are shuffled and dealt evenly (``np.array_split``) to the
    clients; the remaining samples are sorted by label (stable, ties in index order) and dealt in
    ``n_clients`` contiguous near-equal chunks.  Client j gets i.i.d. chunk j ∪ sorted chunk j.

    ``similarity(s=1)`` is exactly :func:`iid` with the same seed; ``similarity(s=0)`` is
    ``np.array_split(np.argsort(labels, kind="stable"), n_clients)`` (seed-independent).

    Args: labels (n,); 1 ≤ n_clients ≤ n; 0 ≤ s ≤ 1.
    Returns: ``n_clients`` sorted index arrays (sizes differ by at most 2).
    """
    where = "similarity"
    _, codes = _codes(labels, where)
    n = codes.size
    n_clients = _check_n_clients(n_clients, n, where)
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not 0.0 <= s <= 1.0:
        raise ConfigError(f"{where}: s must be a number in [0, 1] (got {s!r})")
    rng = np.random.default_rng(_check_seed(seed, where))
    n_iid = int(round(float(s) * n))
    iid_part = rng.permutation(n)[:n_iid]  # s = 1: the very draw iid(n, n_clients, seed) makes
    rest = np.ones(n, dtype=bool)
    rest[iid_part] = False
    rest_idx = np.flatnonzero(rest)
    rest_sorted = rest_idx[np.argsort(codes[rest_idx], kind="stable")]
    a = np.array_split(iid_part, n_clients)
    b = np.array_split(rest_sorted, n_clients)
    return _deal([np.concatenate([x, y]) for x, y in zip(a, b)])


def by_key(
    keys: Any,
    n_clients: int | None = None,
    seed: int = 0,
    *,
    mapping: Mapping[Any, int] | None = None,
    return_keys: bool = False,
) -> Partition | tuple[Partition, list[list[Any]]]:
    """Natural split by a key column (PF2LoRA's NLG splits by domain / restaurant name, the SQuAD
    split by article topic): samples sharing a key value go to the same client.

    * default (``n_clients`` None or equal to the number of distinct keys): one client per distinct
      key, in sorted key order;
    * ``mapping``: explicit ``{key: client_id}`` for every distinct key; client ids must be
      0..n_clients-1 (n_clients defaults to max id + 1) and every client must get a key;
    * ``n_clients`` < number of keys: keys are grouped onto clients greedily by size (largest key
      first onto the currently smallest client; the seed only breaks ties in key order).

    Args: keys (n,) hashable, sortable values.
    Returns: ``n_clients`` sorted index arrays; with ``return_keys=True`` also, per client, the
    list of key values it holds.
    """
    where = "by_key"
    values, codes = _codes(keys, where, name="keys")
    n_keys = values.size
    n = codes.size
    sizes = np.bincount(codes, minlength=n_keys)
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{where}: mapping must be a dict key → client id (got {type(mapping).__name__})")
        missing = [v for v in values.tolist() if v not in mapping]
        if missing:
            raise ConfigError(
                f"{where}: mapping has no client for key(s) {missing[:5]}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            )
        ids = [mapping[v] for v in values.tolist()]
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ConfigError(f"{where}: mapping values must be client ids, integers ≥ 0")
        m = max(ids) + 1 if n_clients is None else n_clients
        m = _check_n_clients(m, n, where)
        if max(ids) >= m:
            raise ConfigError(f"{where}: mapping uses client id {max(ids)} but n_clients={m} (ids must be < n_clients)")
        empty = sorted(set(range(m)) - set(ids))
        if empty:
            raise ConfigError(f"{where}: mapping gives no key to client(s) {empty[:5]}; every client needs data")
        key_client = np.asarray(ids, dtype=np.int64)
        n_clients = m
    elif n_clients is None or n_clients == n_keys:
        if n_clients is not None:
            _check_n_clients(n_clients, n, where)
        key_client = np.arange(n_keys)
        n_clients = n_keys
    else:
        n_clients = _check_n_clients(n_clients, n, where)
        if n_clients > n_keys:
            raise ConfigError(
                f"{where}: n_clients must be in [1, {n_keys}] (the number of distinct keys) — a key's "
                f"samples are never split across clients (got n_clients={n_clients})"
            )
        rng = np.random.default_rng(_check_seed(seed, where))
        tie = rng.permutation(n_keys)
        order = np.lexsort((tie, -sizes))  # largest first, seeded tie-break
        load = np.zeros(n_clients, dtype=np.int64)
        key_client = np.empty(n_keys, dtype=np.int64)
        for kidx in order:
            j = int(np.argmin(load))
            key_client[kidx] = j
            load[j] += sizes[kidx]
    parts = _group(key_client[codes], n_clients)
    if return_keys:
        held = [[v for v, c in zip(values.tolist(), key_client.tolist()) if c == j] for j in range(n_clients)]
        return parts, held
    return parts


def disjoint(labels_or_n: Any, n_clients: int, seed: int = 0, *, stratify: bool = False) -> Partition:
    """RoLoRA (Chen et al. 2024, §4 "Effect of Data Heterogeneity", Table 2): the fixed training set
    is split into ``n_clients`` (3 → 20 → 50) non-overlapping shards, so more clients ⇒ fewer
    samples each ⇒ larger sampling skew between clients (heterogeneity grows with n_clients while
    the total sample count stays constant).  The paper states only "no overlap"; we read it as
    uniform random equal-size shards, i.e. :func:`iid` of the whole set.

    ``stratify=True`` (needs labels) deals every class round-robin from a random client offset,
    so class shares per client match the global ones up to ±1 sample (the least heterogeneous
    disjoint split — a control for the sampling-skew effect).

    Args: labels_or_n: (n,) labels or the sample count n; 1 ≤ n_clients ≤ n.
    Returns: ``n_clients`` sorted index arrays with sizes differing by ≤ 1 (stratified: per-class
    counts also differ by ≤ 1).
    """
    where = "disjoint"
    if _is_int(labels_or_n):
        if stratify:
            raise ConfigError(f"{where}: stratify=True needs labels, not just a sample count")
        return iid(int(labels_or_n), n_clients, seed)
    _, codes = _codes(labels_or_n, where)
    n = codes.size
    n_clients = _check_n_clients(n_clients, n, where)
    seed = _check_seed(seed, where)
    if not stratify:
        return iid(n, n_clients, seed)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    order = perm[np.argsort(codes[perm], kind="stable")]  # classes contiguous, random within
    # deal the class-sorted sequence round-robin: position t → client (t mod n_clients)
    owner = np.empty(n, dtype=np.int64)
    owner[order] = (np.arange(n) + int(rng.integers(n_clients))) % n_clients
    return _group(owner, n_clients)


def pathological_pairs(labels: Any, n_clients: int | None = None, seed: int = 0) -> Partition:
    """LoRA-A² (Koo et al., App. C "Pathologic Setting", Table 7 / Fig. 4): with 20 Newsgroups and
    K = 20 clients, clients (2k−1) and (2k) exclusively hold half each of classes (2k−1) and (2k),
    k = 1..10 — every client has exactly two classes, consecutive clients share them, others share
    none.

    Generalised: with C classes (C even), the sorted classes form C/2 consecutive pairs; pair p
    (classes 2p, 2p+1) is held by g = n_clients / (C/2) consecutive clients (g = 2 in the paper),
    each getting a random 1/g of each of the two classes (``np.array_split`` of a seeded
    permutation).  ``n_clients`` defaults to C (the paper); it must be a multiple of C/2, and every
    class needs ≥ g samples so that each client sees both of its classes.

    Args: labels (n,) with an even number C of distinct values.
    Returns: ``n_clients`` sorted index arrays; client i holds classes 2⌊i/g⌋ and 2⌊i/g⌋+1.
    """
    where = "pathological_pairs"
    _, codes = _codes(labels, where)
    n = codes.size
    class_sizes = np.bincount(codes)
    n_classes = class_sizes.size
    if n_classes < 2 or n_classes % 2:
        raise ConfigError(
            f"{where}: needs an even number ≥ 2 of distinct labels (got {n_classes}); every class "
            "must belong to exactly one pair"
        )
    n_pairs = n_classes // 2
    if n_clients is None:
        n_clients = n_classes
    n_clients = _check_n_clients(n_clients, n, where)
    if n_clients % n_pairs:
        raise ConfigError(
            f"{where}: n_clients must be a positive multiple of n_classes/2 = {n_pairs} (each class "
            f"pair is shared by the same number of clients; LoRA-A² uses n_clients = n_classes = "
            f"{n_classes}); got n_clients={n_clients}"
        )
    g = n_clients // n_pairs
    if class_sizes.min() < g:
        raise ConfigError(
            f"{where}: every class needs ≥ {g} samples to give each of its {g} clients one "
            f"(smallest class has {int(class_sizes.min())})"
        )
    rng = np.random.default_rng(_check_seed(seed, where))
    owner = np.empty(n, dtype=np.int64)
    for c in range(n_classes):
        idx = rng.permutation(np.flatnonzero(codes == c))
        first = (c // 2) * g
        for j, chunk in enumerate(np.array_split(idx, g)):
            owner[chunk] = first + j
    return _group(owner, n_clients)


# ----------------------------------------------------------------------------- reporting
def label_histograms(labels: Any, parts: Sequence[np.ndarray], n_classes: int | None = None) -> np.ndarray:
    """Per-client label counts.

    Args:
        labels: (n,) integer labels in [0, n_classes).  (For string labels pass
            ``np.unique(labels, return_inverse=True)[1]``.)
        parts: a partition (list of index arrays).
        n_classes: number of classes; default ``labels.max() + 1``.
    Returns: (n_clients, n_classes) int64 counts; row j sums to ``len(parts[j])``.
    """
    where = "label_histograms"
    lab = _as_1d(labels, "labels", where)
    if not np.issubdtype(lab.dtype, np.integer):
        raise ConfigError(f"{where}: labels must be integers in [0, n_classes) (got dtype {lab.dtype})")
    if lab.min() < 0:
        raise ConfigError(f"{where}: labels must be ≥ 0 (got {int(lab.min())})")
    n_classes = int(lab.max()) + 1 if n_classes is None else n_classes
    if not _is_int(n_classes) or n_classes < int(lab.max()) + 1:
        raise ConfigError(f"{where}: n_classes must be an integer > max label {int(lab.max())} (got {n_classes!r})")
    hist = np.zeros((len(parts), int(n_classes)), dtype=np.int64)
    for j, p in enumerate(parts):
        hist[j] = np.bincount(lab[np.asarray(p, dtype=np.int64)], minlength=n_classes)
    return hist


def draw_label_histograms(ax: Any, hist: Any, *, class_names: Sequence[str] | None = None,
                          normalize: bool = False, legend: bool = True) -> None:
    """Draw the stacked bars of a (n_clients, n_classes) histogram on the matplotlib axes ``ax``: one bar
    per client (x = 0 … n_clients − 1), one colour per class (tab10, tab20 beyond 10 classes), a legend
    of the classes beside the axes (up to 20 classes) unless ``legend=False``. ``normalize=True`` draws
    class shares. The one drawer of label histograms: ``plot_label_histograms`` and ``fedlora plot``'s
    split figures (``fedlora.llm.plots``) use it."""
    import matplotlib.pyplot as plt

    h = np.asarray(hist, dtype=float)
    if h.ndim != 2:
        raise ConfigError(f"plot_label_histograms: hist must be 2-D (n_clients, n_classes), got shape {h.shape}")
    if normalize:
        h = h / np.maximum(h.sum(axis=1, keepdims=True), 1)
    n_clients, n_classes = h.shape
    cmap = plt.get_cmap("tab20" if n_classes > 10 else "tab10")
    x = np.arange(n_clients)
    bottom = np.zeros(n_clients)
    for c in range(n_classes):
        label = class_names[c] if class_names is not None else str(c)
        ax.bar(x, h[:, c], bottom=bottom, width=0.85, color=cmap(c % cmap.N), label=label, linewidth=0)
        bottom += h[:, c]
    ax.set_xlabel("client")
    ax.set_ylabel("share of samples" if normalize else "samples")
    ax.set_xlim(-0.5, n_clients - 0.5)
    if legend and n_classes <= 20:
        ax.legend(title="class", fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")


def plot_label_histograms(
    hist: Any,
    path: str,
    *,
    title: str | None = None,
    class_names: Sequence[str] | None = None,
    normalize: bool = False,
) -> str:
    """Stacked bar chart of a (n_clients, n_classes) histogram: one bar per client, one colour per
    class (matplotlib, Agg backend; no display needed).  ``normalize=True`` plots class shares.
    Writes ``path`` (format from its suffix) and returns it.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    h = np.asarray(hist, dtype=float)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * (h.shape[0] if h.ndim == 2 else 1) + 2), 4.0))
    try:
        draw_label_histograms(ax, h, class_names=class_names, normalize=normalize)
    except ConfigError:
        plt.close(fig)
        raise
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- registry / specs
# name → (function, data argument, positional spec parameter)
PARTITIONERS: dict[str, tuple[Callable[..., Any], str, str | None]] = {
    "iid": (iid, "n", None),
    "dirichlet": (dirichlet, "labels", "alpha"),
    "pathological": (pathological, "labels", "k"),
    "similarity": (similarity, "labels", "s"),
    "by_key": (by_key, "keys", "column"),
    "disjoint": (disjoint, "labels_or_n", "n_clients"),
    "pathological_pairs": (pathological_pairs, "labels", None),
}
_ALIASES = {"pairs": "pathological_pairs", "lda": "dirichlet", "shards": "pathological", "key": "by_key"}


def _literal(node: ast.AST, spec: str) -> Any:
    if isinstance(node, ast.Name):  # bare identifier, e.g. by_key(topic)
        return {"True": True, "False": False, "None": None}.get(node.id, node.id)
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError):
        raise ConfigError(f"partition spec {spec!r}: arguments must be literals (numbers, strings)") from None


def parse_partition(spec: str) -> tuple[str, dict[str, Any]]:
    """Parse ``"name"`` or ``"name(arg, key=value, ...)"`` into ``(name, params)``.

    The positional argument fills the scheme's main parameter: ``dirichlet(0.5)`` → alpha,
    ``pathological(2)`` → k, ``similarity(0.3)`` → s, ``disjoint(20)`` → n_clients,
    ``by_key(topic)`` → column.  Aliases: pairs, lda, shards, key.

    >>> parse_partition("dirichlet(0.5, min_size=10)")
    ('dirichlet', {'alpha': 0.5, 'min_size': 10})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"partition spec must be a non-empty string like 'dirichlet(0.5)' (got {spec!r})")
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        raise ConfigError(f"partition spec {spec!r} is not of the form name or name(args)") from None
    if isinstance(tree, ast.Name):
        name, args, kwargs = tree.id, [], []
    elif isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name):
        name, args, kwargs = tree.func.id, tree.args, tree.keywords
    else:
        raise ConfigError(f"partition spec {spec!r} is not of the form name or name(args)")
    name = _ALIASES.get(name, name)
    if name not in PARTITIONERS:
        raise ConfigError(f"unknown partition {name!r}; choose one of {', '.join(sorted(PARTITIONERS))}")
    _, _, main = PARTITIONERS[name]
    params: dict[str, Any] = {}
    if args:
        if main is None or len(args) > 1:
            allowed = "no positional argument" if main is None else f"one positional argument ({main})"
            raise ConfigError(f"partition spec {spec!r}: {name} takes {allowed}; pass others as key=value")
        params[main] = _literal(args[0], spec)
    for kw in kwargs:
        if kw.arg is None or kw.arg in params:
            raise ConfigError(f"partition spec {spec!r}: bad or repeated keyword {kw.arg!r}")
        params[kw.arg] = _literal(kw.value, spec)
    return name, params


def validate_partition_spec(spec: str, extra: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """``parse_partition`` plus what needs no data: the scheme's parameters are known and its main
    parameter is there (``dirichlet(a=0.5)``, ``similarity()`` are refused). A config is checked with
    this before any data is read, so a dry run refuses what the real run would. ``extra``: keyword
    parameters given beside the spec (they override it)."""
    name, sp = parse_partition(spec)
    sp.update(extra or {})
    fn, _, main = PARTITIONERS[name]
    allowed = [p for p in inspect.signature(fn).parameters][1:]
    unknown = sorted(set(sp) - set(allowed) - {"column"})
    if unknown:
        raise ConfigError(f"partition {name!r}: unknown parameter(s) {quoted(unknown)}; allowed: {', '.join(allowed)}")
    if main is not None and main not in ("n_clients", "column") and main not in sp:
        if inspect.signature(fn).parameters[main].default is inspect.Parameter.empty:
            raise ConfigError(f"partition {spec!r}: missing parameter {main} (e.g. '{name}(<{main}>)')")
    return name, sp


def partition(
    spec: str,
    *,
    labels: Any = None,
    keys: Any = None,
    n: int | None = None,
    columns: Mapping[str, Any] | None = None,
    n_clients: int | None = None,
    seed: int = 0,
    **params: Any,
) -> Partition:
    """Dispatch a spec string (see :func:`parse_partition`) to its scheme.

    Data: ``labels`` (n,) for label-based schemes; ``keys`` (n,) or ``columns[column]`` for by_key;
    ``iid`` / ``disjoint`` also accept just ``n``.  Extra keyword ``params`` override the spec's.
    Returns the scheme's partition (``n_clients`` sorted index arrays).
    """
    name, sp = validate_partition_spec(spec, params)
    fn, data_kind, main = PARTITIONERS[name]
    if "n_clients" in sp:
        if n_clients is not None and sp["n_clients"] != n_clients:
            raise ConfigError(f"partition {spec!r}: n_clients={sp['n_clients']} in the spec but n_clients={n_clients} given")
        n_clients = sp.pop("n_clients")
    if "seed" in sp:
        seed = sp.pop("seed")

    if data_kind == "keys":
        column = sp.pop("column", None)
        if keys is None:
            if column is None or columns is None or column not in columns:
                have = sorted(columns) if columns is not None else []
                raise ConfigError(
                    f"partition {spec!r}: by_key needs keys=<array>, or columns={{name: array}} with "
                    f"the column named in the spec (spec column {column!r}; columns given: {have})"
                )
            keys = columns[column]
        data: Any = keys
    elif data_kind == "labels":
        if labels is None:
            raise ConfigError(f"partition {spec!r}: {name} needs labels=<(n,) array>")
        data = labels
    else:  # "n" or "labels_or_n"
        if labels is not None:
            data = labels if data_kind == "labels_or_n" else len(np.asarray(labels))
        elif n is not None:
            data = n
        elif keys is not None:
            data = len(np.asarray(keys))
        else:
            raise ConfigError(f"partition {spec!r}: {name} needs n=<int> or labels=<(n,) array>")

    allowed = [p for p in inspect.signature(fn).parameters][1:]
    unknown = sorted(set(sp) - set(allowed))
    if unknown:
        raise ConfigError(f"partition {name!r}: unknown parameter(s) {quoted(unknown)}; allowed: {', '.join(allowed)}")
    if n_clients is None and name not in ("by_key", "pathological_pairs"):
        raise ConfigError(f"partition {spec!r}: n_clients is required")
    if main is not None and main not in ("n_clients", "column") and main not in sp:
        if inspect.signature(fn).parameters[main].default is inspect.Parameter.empty:
            raise ConfigError(f"partition {spec!r}: missing parameter {main} (e.g. '{name}(<{main}>)')")
    if n_clients is not None:
        sp["n_clients"] = n_clients
    return fn(data, seed=seed, **sp)

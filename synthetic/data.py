"""Ground truths and data of the rank-recovery experiment ([PF2LoRA] §5; docs/design.md §6).

Orientation: the paper writes Y = X W* + ε with W* ∈ R^{d_in × d_out}; the adapter layer computes
Y = X ΔWᵀ, so the model's estimate in the paper's orientation is Ŵ = ΔWᵀ.

Noise: the paper writes ε ~ N(0, 0.1) / N(0, 0.2); we read the second argument as the standard
deviation (docs/design.md §6), so the irreducible test MSE is 0.01 / 0.04.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedlora.errors import ConfigError

__all__ = ["ClientTask", "GROUND_TRUTHS", "make_clients", "TASKS", "make_heterogeneous_clients", "per_client"]


def per_client(value: Any, n_clients: int) -> Any:
    """A per-client option as a tuple: one value (a number, or a list of one) is every client's, as
    for the other per-client options; a longer sequence is kept as given (its length is checked by
    the caller's validation, which names the flag). Anything else is returned unchanged."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (value,) * n_clients
    if isinstance(value, (list, tuple)):
        return tuple(value) * n_clients if len(value) == 1 else tuple(value)
    return value

GROUND_TRUTHS = ("independent", "shared-private")


@dataclass(frozen=True)
class ClientTask:
    """One client's regression task. Shapes: X (n, d_in), Y (n, d_out), W_star (d_in, d_out)."""

    X_train: torch.Tensor
    Y_train: torch.Tensor
    X_test: torch.Tensor
    Y_test: torch.Tensor
    W_star: torch.Tensor
    true_rank: int
    noise_std: float


def _orthonormal(n: int, k: int, g: torch.Generator, dtype) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=dtype))
    return q * torch.sign(torch.diagonal(r))  # unique, sign-fixed Haar sample


def make_clients(
    ground_truth: str,
    seed: int,
    *,
    ranks: tuple[int, ...] = (3, 4),
    shared_rank: int = 2,
    d_in: int = 10,
    d_out: int = 10,
    n_samples: int = 1000,
    n_train: int = 700,
    noise_std: tuple[float, ...] = (0.1, 0.2),
    singular_value: float = 10.0,
    dtype: torch.dtype = torch.float64,
) -> list[ClientTask]:
    """Build one federation's clients.

    ``independent`` (the paper's setup): W_k* = A_k* B_k*, A_k* ∈ R^{d_in×r_k}, B_k* ∈ R^{r_k×d_out},
    entries N(0, 1), independent across clients.

    ``shared-private`` (ours, docs/design.md §6): W_k* = S + P_k with S of rank ``shared_rank`` common to all
    clients and P_k of rank r_k − shared_rank private to client k. All non-zero singular values
    equal ``singular_value`` and the private directions are orthogonal to the shared ones, so the
    true rank is r_k and the 90 %-energy rank of W_k* is r_k too.
    """
    if ground_truth not in GROUND_TRUTHS:
        raise ConfigError(f"--ground-truth must be one of {', '.join(GROUND_TRUTHS)}, got {ground_truth!r}")
    if len(noise_std) != len(ranks):
        raise ConfigError(f"noise_std needs one value per client ({len(ranks)}), got {len(noise_std)}")
    if not 0 < n_train < n_samples:
        raise ConfigError(f"n_train must be in (0, n_samples={n_samples}), got {n_train}")
    for r in ranks:
        if not 1 <= r <= min(d_in, d_out):
            raise ConfigError(f"true ranks must be in [1, min(d_in, d_out) = {min(d_in, d_out)}], got {r}")
    g = torch.Generator().manual_seed(seed)
    stars = []
    if ground_truth == "independent":
        for r in ranks:
            a = torch.randn(d_in, r, generator=g, dtype=dtype)
            b = torch.randn(r, d_out, generator=g, dtype=dtype)
            stars.append(a @ b)
    else:
        if not 0 <= shared_rank <= min(ranks):
            raise ConfigError(f"--shared-rank must be in [0, min(true ranks) = {min(ranks)}], got {shared_rank}")
        u_s = _orthonormal(d_in, d_in, g, dtype)
        v_s = _orthonormal(d_out, d_out, g, dtype)
        shared = singular_value * u_s[:, :shared_rank] @ v_s[:, :shared_rank].T
        for r in ranks:
            p = r - shared_rank
            # private directions: a random orthonormal set inside the complement of the shared ones
            u_p = u_s[:, shared_rank:] @ _orthonormal(d_in - shared_rank, p, g, dtype)
            v_p = v_s[:, shared_rank:] @ _orthonormal(d_out - shared_rank, p, g, dtype)
            stars.append(shared + singular_value * u_p @ v_p.T)
    clients = []
    for w, r, sd in zip(stars, ranks, noise_std):
        X = torch.randn(n_samples, d_in, generator=g, dtype=dtype)
        Y = X @ w + sd * torch.randn(n_samples, d_out, generator=g, dtype=dtype)
        clients.append(ClientTask(X[:n_train], Y[:n_train], X[n_train:], Y[n_train:], w, r, sd))
    return clients


# --- heterogeneous federations for `fedlora synthetic compare` (docs/design.md §6 "compare") ---------------

TASKS = ("regression", "classification")


def make_heterogeneous_clients(
    task: str,
    seed: int,
    heterogeneity: float,
    *,
    n_clients: int = 4,
    d_in: int = 10,
    d_out: int = 10,
    shared_rank: int = 2,
    private_rank: int = 2,
    n_train: tuple[int, ...] = (60, 80, 100, 120),
    n_test: int = 500,
    noise_std: float = 0.5,
    singular_value: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> list[ClientTask]:
    """M clients with W_k* = S + h·P_k: S shared (rank ``shared_rank``), P_k private (rank
    ``private_rank``, directions orthogonal to S's), all non-zero singular values ``singular_value``.

    ``heterogeneity`` h ≥ 0 is a knob: h = 0 gives identical clients. Everything random (S, P_k, X,
    the noise) is drawn from ``seed`` alone, in the same order for every h, so an h-sweep at one
    seed changes only h.

    ``regression``: Y = X W_k* + ε, ε ~ N(0, noise_std²) (Y: (n, d_out)).
    ``classification``: d_out = C classes, labels y = argmax(X W_k* + G), G i.i.d. standard Gumbel —
    an exact draw from softmax(X W_k*) (the Gumbel-max trick), so W_k* is the Bayes-optimal
    logit map and the test cross-entropy has a floor. Y: (n,) int64; ``noise_std`` is unused.

    Client k has ``n_train[k]`` training and ``n_test`` test samples (unequal n_k make the weighted
    mean w_k ∝ n_k differ from the unweighted one). ``true_rank`` is rank W_k*.
    """
    if task not in TASKS:
        raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if not (isinstance(heterogeneity, (int, float)) and heterogeneity >= 0):
        raise ConfigError(f"--heterogeneity values must be numbers ≥ 0, got {heterogeneity!r}")
    if n_clients < 1:
        raise ConfigError(f"--clients must be ≥ 1, got {n_clients}")
    if len(n_train) != n_clients:
        raise ConfigError(f"--n-train needs one value per client ({n_clients}), got {len(n_train)}")
    if any(n < 1 for n in n_train) or n_test < 1:
        raise ConfigError(f"--n-train and --n-test must be ≥ 1, got {tuple(n_train)}, {n_test}")
    if not 1 <= shared_rank <= min(d_in, d_out):
        raise ConfigError(f"--shared-rank must be in [1, min(d_in, d_out) = {min(d_in, d_out)}], got {shared_rank}")
    room = min(d_in, d_out) - shared_rank
    if not 0 <= private_rank <= room:
        raise ConfigError(f"--private-rank must be in [0, min(d_in, d_out) − shared rank = {room}], got {private_rank}")
    if noise_std < 0 or singular_value <= 0:
        raise ConfigError(f"need noise_std ≥ 0 and singular_value > 0, got {noise_std}, {singular_value}")
    g = torch.Generator().manual_seed(seed)
    u_s = _orthonormal(d_in, d_in, g, dtype)
    v_s = _orthonormal(d_out, d_out, g, dtype)
    shared = singular_value * u_s[:, :shared_rank] @ v_s[:, :shared_rank].T
    privates = []
    for _ in range(n_clients):
        u_p = u_s[:, shared_rank:] @ _orthonormal(d_in - shared_rank, private_rank, g, dtype)
        v_p = v_s[:, shared_rank:] @ _orthonormal(d_out - shared_rank, private_rank, g, dtype)
        privates.append(singular_value * u_p @ v_p.T)
    clients = []
    for k, p in enumerate(privates):
        w = shared + heterogeneity * p
        n = n_train[k] + n_test
        X = torch.randn(n, d_in, generator=g, dtype=dtype)
        if task == "regression":
            Y = X @ w + noise_std * torch.randn(n, d_out, generator=g, dtype=dtype)
        else:
            gumbel = -torch.log(-torch.log(torch.rand(n, d_out, generator=g, dtype=dtype).clamp_min(1e-300)))
            Y = torch.argmax(X @ w + gumbel, dim=-1)
        rank = shared_rank + (private_rank if heterogeneity > 0 else 0)
        clients.append(ClientTask(X[:n_train[k]], Y[:n_train[k]], X[n_train[k]:], Y[n_train[k]:], w, rank,
                                  noise_std if task == "regression" else 0.0))
    return clients

"""LoRA-A² server-side math: importance scores, global rank selection, masks, sparse uploads and
the server update ([LoRA-A²] Algorithms 1–2, eq. 4–6; docs/design.md §4.5).

Shapes (PEFT orientation; the paper's B ∈ R^{d1×r_G}, A ∈ R^{r_G×d2} already match): per module m,
B (d_out, r_m), A (r_m, d_in). Modules are given as ``Mapping[str, Tensor]``; the mapping's order is
the tie-break order of the global selection.

Round parity (Algorithm 1, 1-based t): ``t % 2 = 1`` trains B, otherwise A; with a 0-based round
index that is :func:`fedlora.aggmath.exact.trained_factor` ('B' on round 0, 2, …).

* B-round score (eq. 4): S_i = ‖ΔB[:, i] A[i, :]‖_F = ‖ΔB[:, i]‖·‖A[i, :]‖ (a rank-1 outer product);
  A-round: S_i = ‖B[:, i]‖·‖ΔA[i, :]‖.
* Selection (§4.2): the top r_i·N scores over all N modules of the model (some modules may get 0).
* Mask (eq. 5–6): ΔB ⊙ M keeps the selected columns of ΔB (rows of ΔA).
* Upload (§4.2 "uploads B_k ⊙ M_k"): only the selected columns/rows and their int indices.
* Server (Algorithm 1 lines "B^{(t+1)} = B^{(t)} + Σ_k w_k B_k^{(t+1)}"): B_new = B_saved + Σ_k w_k ΔB_k
  with w_k normalised over all participating clients; a coordinate that only some clients selected
  gets Σ_{k selecting} w_k ΔB_k — diluted by the others' zeros, not renormalised (docs/design.md §4.5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import ConfigError
from ._checks import check_factor_name, check_finite, check_weights, is_int

__all__ = [
    "importance_scores",
    "select_ranks",
    "rank_mask",
    "mask_delta",
    "SparseDelta",
    "pack_upload",
    "unpack_delta",
    "upload_nbytes",
    "upload_tensors",
    "upload_from_tensors",
    "server_update",
]


def importance_scores(deltas: Mapping[str, torch.Tensor], frozen: Mapping[str, torch.Tensor],
                      factor: str) -> dict[str, torch.Tensor]:
    """Per-rank importance ([LoRA-A²] eq. 4) of every module; returns name → float64 scores (r_m,).

    ``factor='B'`` (B-round): deltas[m] = ΔB (d_out, r), frozen[m] = A (r, d_in), S_i = ‖ΔB[:,i]‖‖A[i,:]‖.
    ``factor='A'`` (A-round): deltas[m] = ΔA (r, d_in), frozen[m] = B (d_out, r), S_i = ‖B[:,i]‖‖ΔA[i,:]‖.
    (The LoRA scale s is common to all ranks of a module and is left out, as in eq. 4.)
    """
    fn = "importance_scores"
    check_factor_name(fn, factor)
    if set(deltas) != set(frozen):
        raise ConfigError(f"{fn}: deltas and frozen must name the same modules; "
                          f"only in deltas: {sorted(set(deltas) - set(frozen))}, "
                          f"only in frozen: {sorted(set(frozen) - set(deltas))}")
    if not deltas:
        raise ConfigError(f"{fn}: need at least one module")
    out = {}
    for m, d in deltas.items():
        f = frozen[m]
        if d.dim() != 2 or f.dim() != 2:
            raise ConfigError(f"{fn}: module {m!r}: delta and frozen factor must be 2-D")
        check_finite(fn, f"deltas[{m!r}]", d)
        check_finite(fn, f"frozen[{m!r}]", f)
        if factor == "B":  # ΔB (d_out, r), A (r, d_in)
            if d.shape[1] != f.shape[0]:
                raise ConfigError(f"{fn}: module {m!r}: ΔB has rank {d.shape[1]} (columns) but A has "
                                  f"{f.shape[0]} rows; B-round needs ΔB (d_out, r) and A (r, d_in)")
            out[m] = torch.linalg.vector_norm(d.to(torch.float64), dim=0) * \
                torch.linalg.vector_norm(f.to(torch.float64), dim=1)
        else:  # ΔA (r, d_in), B (d_out, r)
            if d.shape[0] != f.shape[1]:
                raise ConfigError(f"{fn}: module {m!r}: ΔA has rank {d.shape[0]} (rows) but B has "
                                  f"{f.shape[1]} columns; A-round needs ΔA (r, d_in) and B (d_out, r)")
            out[m] = torch.linalg.vector_norm(f.to(torch.float64), dim=0) * \
                torch.linalg.vector_norm(d.to(torch.float64), dim=1)
    return out


def select_ranks(scores: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
    """Global top-(budget·N) selection over all N modules ([LoRA-A²] §4.2); name → sorted int64 indices.

    ``budget`` is the client's rank budget r_i, an integer with 1 ≤ r_i and r_i·N ≤ Σ_m r_m.
    Modules may receive 0 ranks (empty index tensor). Ties are broken by module order (mapping
    order), then by rank index — deterministic.
    """
    fn = "select_ranks"
    if not scores:
        raise ConfigError(f"{fn}: need at least one module")
    names = list(scores)
    flat = []
    for m in names:
        sc = scores[m]
        if sc.dim() != 1 or sc.numel() < 1:
            raise ConfigError(f"{fn}: scores[{m!r}] must be a non-empty 1-D tensor (one score per rank)")
        if not bool(torch.isfinite(sc).all()):
            raise ConfigError(f"{fn}: scores[{m!r}] contains NaN or inf; scores must be finite")
        flat.append(sc.to(torch.float64))
    total = sum(int(s.numel()) for s in flat)
    n = len(names)
    if not is_int(budget) or budget < 1 or budget * n > total:
        raise ConfigError(f"{fn}: budget (rank budget r_i) must be an integer with 1 ≤ r_i and r_i·N ≤ "
                          f"{total} total ranks (N = {n} modules), i.e. in [1, {total // n}], got {budget!r}")
    budget = int(budget)
    cat = torch.cat(flat)
    order = torch.sort(cat, descending=True, stable=True).indices[: budget * n]
    chosen = torch.zeros(total, dtype=torch.bool, device=cat.device)
    chosen[order] = True
    out, start = {}, 0
    for m, s in zip(names, flat):
        out[m] = torch.nonzero(chosen[start:start + s.numel()]).flatten().to(torch.int64)
        start += s.numel()
    return out


def _check_indices(fn: str, name: str, idx: torch.Tensor, rank: int) -> None:
    if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ConfigError(f"{fn}: {name} must be a 1-D integer tensor of rank indices")
    if idx.numel():
        if int(idx.min()) < 0 or int(idx.max()) >= rank:
            raise ConfigError(f"{fn}: {name} must lie in [0, {rank - 1}], got {idx.tolist()}")
        if torch.unique(idx).numel() != idx.numel():
            raise ConfigError(f"{fn}: {name} must not repeat a rank index, got {idx.tolist()}")


def rank_mask(shape: Sequence[int], index: torch.Tensor, factor: str, dtype=torch.float32) -> torch.Tensor:
    """Mask M of eq. 5: for B (d_out, r) ones in the selected columns, for A (r, d_in) in the selected rows."""
    fn = "rank_mask"
    check_factor_name(fn, factor)
    if len(shape) != 2:
        raise ConfigError(f"{fn}: shape must be (d_out, r) for B or (r, d_in) for A, got {tuple(shape)}")
    rank = shape[1] if factor == "B" else shape[0]
    _check_indices(fn, "index", index, rank)
    sel = torch.zeros(rank, dtype=dtype)
    sel[index.long()] = 1
    return (sel.expand(shape[0], rank) if factor == "B" else sel[:, None].expand(rank, shape[1])).clone()


def mask_delta(delta: torch.Tensor, index: torch.Tensor, factor: str) -> torch.Tensor:
    """ΔB ⊙ M (selected columns kept) or ΔA ⊙ M (selected rows kept) — eq. 6; a new tensor."""
    return delta * rank_mask(delta.shape, index, factor, dtype=delta.dtype)


@dataclass(frozen=True)
class SparseDelta:
    """One module's upload: the selected columns of ΔB (values (d_out, n_sel)) or rows of ΔA
    (values (n_sel, d_in)), their rank ``indices`` (n_sel,), and the dense ``shape`` (d_out, r) / (r, d_in).

    ``nbytes`` = values.numel()·values.element_size() + indices.numel()·indices.element_size() — the
    tensor bytes on the wire (a serialised Payload adds its header on top).
    """

    values: torch.Tensor
    indices: torch.Tensor
    factor: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.indices.numel() * self.indices.element_size()


def pack_upload(deltas: Mapping[str, torch.Tensor], selected: Mapping[str, torch.Tensor], factor: str,
                index_dtype: torch.dtype = torch.int64) -> dict[str, SparseDelta]:
    """Sparse upload of the selected ranks of every module (copies; delta dtype kept)."""
    fn = "pack_upload"
    check_factor_name(fn, factor)
    if set(deltas) != set(selected):
        raise ConfigError(f"{fn}: deltas and selected must name the same modules")
    if index_dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise ConfigError(f"{fn}: index_dtype must be an integer dtype, got {index_dtype}")
    out = {}
    for m, d in deltas.items():
        if d.dim() != 2:
            raise ConfigError(f"{fn}: deltas[{m!r}] must be 2-D")
        idx = selected[m]
        rank = d.shape[1] if factor == "B" else d.shape[0]
        _check_indices(fn, f"selected[{m!r}]", idx, rank)
        if rank - 1 > torch.iinfo(index_dtype).max:
            raise ConfigError(f"{fn}: index_dtype {index_dtype} cannot hold rank index {rank - 1}")
        idx_l = idx.long()
        vals = d[:, idx_l] if factor == "B" else d[idx_l, :]
        out[m] = SparseDelta(vals.clone().contiguous(), idx.to(index_dtype).clone(), factor, (int(d.shape[0]), int(d.shape[1])))
    return out


def unpack_delta(sd: SparseDelta, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense ΔB ⊙ M (d_out, r) or ΔA ⊙ M (r, d_in) from a :class:`SparseDelta`."""
    fn = "unpack_delta"
    check_factor_name(fn, sd.factor)
    rows, cols = sd.shape
    rank = cols if sd.factor == "B" else rows
    _check_indices(fn, "indices", sd.indices, rank)
    n = sd.indices.numel()
    want = (rows, n) if sd.factor == "B" else (n, cols)
    if tuple(sd.values.shape) != want:
        raise ConfigError(f"{fn}: values have shape {tuple(sd.values.shape)}, expected {want} for factor "
                          f"{sd.factor!r} with dense shape {sd.shape} and {n} indices")
    out = torch.zeros(sd.shape, dtype=dtype or sd.values.dtype)
    if sd.factor == "B":
        out[:, sd.indices.long()] = sd.values.to(out.dtype)
    else:
        out[sd.indices.long(), :] = sd.values.to(out.dtype)
    return out


def upload_nbytes(upload: Mapping[str, SparseDelta]) -> int:
    """Σ over modules of selected entries × value dtype size + index count × index dtype size."""
    return sum(sd.nbytes for sd in upload.values())


def upload_tensors(upload: Mapping[str, SparseDelta]) -> dict[str, torch.Tensor]:
    """Flat name → tensor map for a :class:`~fedlora.payload.Payload`: ``{m}.values``, ``{m}.indices``."""
    out = {}
    for m, sd in upload.items():
        out[f"{m}.values"] = sd.values
        out[f"{m}.indices"] = sd.indices
    return out


def upload_from_tensors(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]],
                        factor: str) -> dict[str, SparseDelta]:
    """Inverse of :func:`upload_tensors` on the server: ``shapes[m]`` is the global factor's dense shape.

    Module names may contain dots; keys are split at the last ``.values`` / ``.indices`` suffix.
    """
    fn = "upload_from_tensors"
    check_factor_name(fn, factor)
    out = {}
    for key in tensors:
        if key.endswith(".values"):
            m = key[: -len(".values")]
            if f"{m}.indices" not in tensors:
                raise ConfigError(f"{fn}: {key!r} has no matching {m + '.indices'!r}")
            if m not in shapes:
                raise ConfigError(f"{fn}: unknown module {m!r}; known: {sorted(shapes)}")
            sd = SparseDelta(tensors[key], tensors[f"{m}.indices"], factor, tuple(int(x) for x in shapes[m]))
            unpack_delta(sd)  # validates indices and value shape
            out[m] = sd
        elif not key.endswith(".indices"):
            raise ConfigError(f"{fn}: unexpected tensor {key!r}; keys must end in '.values' or '.indices'")
        elif key[: -len(".indices")] + ".values" not in tensors:
            raise ConfigError(f"{fn}: {key!r} has no matching values tensor")
    return out


def server_update(saved: Mapping[str, torch.Tensor], uploads: Sequence[Mapping[str, SparseDelta]],
                  weights, factor: str) -> dict[str, torch.Tensor]:
    """B_new = B_saved + Σ_k w_k ΔB_k (or A_new = A_saved + Σ_k w_k ΔA_k), [LoRA-A²] Algorithm 1.

    ``saved``: the global factor of every module at the start of the round, B (d_out, r) or A (r, d_in).
    ``uploads[k]``: client k's sparse deltas; a module may be missing (0 ranks selected there).
    ``weights``: one per participating client, normalised over them (w_k = n_k / Σ_{j∈K^(t)} n_j).
    Coordinates selected by no client are returned unchanged; those selected by some clients get
    Σ_{k selecting} w_k ΔB_k (diluted, not renormalised). Accumulates in float64; returns new tensors
    in the saved dtype for every module of ``saved``.
    """
    fn = "server_update"
    check_factor_name(fn, factor)
    if len(uploads) == 0:
        raise ConfigError(f"{fn}: need at least one client upload")
    w = check_weights(fn, weights, len(uploads))
    acc = {m: t.to(torch.float64).clone() for m, t in saved.items()}
    for k, up in enumerate(uploads):
        for m, sd in up.items():
            if m not in saved:
                raise ConfigError(f"{fn}: client {k} uploads unknown module {m!r}; known: {sorted(saved)}")
            if sd.factor != factor:
                raise ConfigError(f"{fn}: client {k} module {m!r} carries factor {sd.factor!r}, "
                                  f"this round aggregates {factor!r}")
            if tuple(sd.shape) != tuple(saved[m].shape):
                raise ConfigError(f"{fn}: client {k} module {m!r} has dense shape {tuple(sd.shape)}, "
                                  f"expected {tuple(saved[m].shape)}")
            check_finite(fn, f"uploads[{k}][{m!r}].values", sd.values)
            dense = unpack_delta(sd, dtype=torch.float64)
            acc[m] = acc[m] + w[k] * dense
    return {m: acc[m].to(saved[m].dtype) for m in saved}

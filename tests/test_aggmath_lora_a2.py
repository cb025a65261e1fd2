"""Property tests for fedlora.aggmath.lora_a2: scores (eq. 4), global top-(r_i·N) selection, masks
(eq. 5–6), sparse uploads and their byte counts, the server update (Algorithm 1) and its exactness."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlora.aggmath.exact import exact_delta
from fedlora.aggmath.lora_a2 import (SparseDelta, importance_scores, mask_delta, pack_upload, rank_mask,
                                     select_ranks, server_update, unpack_delta, upload_from_tensors, upload_nbytes,
                                     upload_tensors)
from fedlora.errors import ConfigError
from fedlora.payload import Payload

FAST = settings(max_examples=30, deadline=None)
D64 = torch.float64



def _modules(g, shapes, r, dtype=D64):
    """Global factors per module: B (d_out, r) and A (r, d_in)."""
    Bs = {f"m{i}": torch.randn(do, r, generator=g, dtype=dtype) for i, (do, di) in enumerate(shapes)}
    As = {f"m{i}": torch.randn(r, di, generator=g, dtype=dtype) for i, (do, di) in enumerate(shapes)}
    return Bs, As


def _snap(d):
    return {k: v.clone() for k, v in d.items()}


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


shapes_st = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=6)


@FAST
@given(seed=st.integers(0, 2**31 - 1), shapes=shapes_st, r=st.integers(1, 32), factor=st.sampled_from("AB"),
       data=st.data())
def test_scores_and_global_selection(seed, shapes, r, factor, data):
    g = torch.Generator().manual_seed(seed)
    Bs, As = _modules(g, shapes, r)
    deltas = {m: torch.randn_like(Bs[m] if factor == "B" else As[m]) for m in Bs}
    frozen = As if factor == "B" else Bs
    snap = [_snap(deltas), _snap(frozen)]
    scores = importance_scores(deltas, frozen, factor)
    for m in Bs:  # eq. 4: S_i = ‖ΔB[:, i] A[i, :]‖_F (or ‖B[:, i] ΔA[i, :]‖_F)
        ref = torch.stack([torch.linalg.matrix_norm(torch.outer(deltas[m][:, i], frozen[m][i]) if factor == "B"
                                                    else torch.outer(frozen[m][:, i], deltas[m][i]))
                           for i in range(r)])
        assert torch.allclose(scores[m], ref, rtol=1e-12, atol=1e-300)
    budget = data.draw(st.integers(1, r))
    scores_snap = _snap(scores)
    sel = select_ranks(scores, budget)
    assert _same(scores_snap, scores)
    for m in Bs:
        d_snap = deltas[m].clone()
        mask_delta(deltas[m], sel[m], factor)
        assert torch.equal(d_snap, deltas[m])
    N = len(Bs)
    assert sum(int(v.numel()) for v in sel.values()) == budget * N
    chosen = torch.cat([scores[m][sel[m]] for m in Bs])
    rest = torch.cat([scores[m][torch.tensor([i for i in range(r) if i not in set(sel[m].tolist())], dtype=torch.long)]
                      for m in Bs])
    if rest.numel():
        assert float(chosen.min()) >= float(rest.max())
    for m in Bs:
        assert sel[m].dtype == torch.int64 and torch.equal(sel[m], torch.sort(sel[m]).values)
    assert _same(snap[0], deltas) and _same(snap[1], frozen)


def test_selection_can_give_a_module_zero_ranks():
    scores = {"q": torch.tensor([5.0, 4.0, 3.0]), "v": torch.tensor([0.1, 0.2, 0.0]), "o": torch.tensor([9.0, 0.5, 1.0])}
    sel = select_ranks(scores, 2)  # top 6 of 9
    assert sel["q"].tolist() == [0, 1, 2] and sel["v"].tolist() == [] and sel["o"].tolist() == [0, 1, 2]
    tie = select_ranks({"a": torch.zeros(2), "b": torch.zeros(2)}, 1)  # ties: module order, then index
    assert tie["a"].tolist() == [0, 1] and tie["b"].tolist() == []


@FAST
@given(seed=st.integers(0, 2**31 - 1), shapes=shapes_st, r=st.integers(1, 32), factor=st.sampled_from("AB"),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       index_dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]), data=st.data())
def test_upload_carries_exactly_the_selected_ranks(seed, shapes, r, factor, dtype, index_dtype, data):
    g = torch.Generator().manual_seed(seed)
    Bs, As = _modules(g, shapes, r, dtype)
    deltas = Bs if factor == "B" else As  # any tensors of the factor's shape
    scores = {m: torch.rand(r, generator=g, dtype=D64) for m in deltas}
    sel = select_ranks(scores, data.draw(st.integers(1, r)))
    snap = _snap(deltas)
    up = pack_upload(deltas, sel, factor, index_dtype=index_dtype)
    expected_bytes = 0
    for m, sd in up.items():
        d = deltas[m]
        assert torch.equal(sd.indices.long(), sel[m]) and sd.indices.dtype == index_dtype
        if factor == "B":
            assert sd.values.shape == (d.shape[0], sel[m].numel())
            assert torch.equal(sd.values, d[:, sel[m]])
        else:
            assert sd.values.shape == (sel[m].numel(), d.shape[1])
            assert torch.equal(sd.values, d[sel[m], :])
        assert sd.values.dtype == dtype
        assert torch.equal(unpack_delta(sd), mask_delta(d, sel[m], factor))
        n_entries = sel[m].numel() * (d.shape[0] if factor == "B" else d.shape[1])
        expected_bytes += n_entries * d.element_size() + sel[m].numel() * torch.tensor([], dtype=index_dtype).element_size()
    assert upload_nbytes(up) == expected_bytes
    # what actually goes on the wire: the same tensors plus the safetensors header
    payload = Payload(upload_tensors(up))
    assert payload.nbytes >= expected_bytes
    back = Payload.from_bytes(payload.to_bytes())
    assert all(torch.equal(back.tensors[k], v) for k, v in upload_tensors(up).items())
    rebuilt = upload_from_tensors(back.tensors, {m: d.shape for m, d in deltas.items()}, factor)
    assert set(rebuilt) == set(up)
    assert all(torch.equal(unpack_delta(rebuilt[m]), unpack_delta(up[m])) for m in up)
    assert _same(snap, deltas)


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 16), shapes=shapes_st, r=st.integers(1, 32),
       factor=st.sampled_from("AB"), s=st.floats(0.01, 32.0), data=st.data())
def test_server_update_dilution_and_exactness(seed, K, shapes, r, factor, s, data):
    """B_new = B_saved + Σ_k w_k ΔB_k (w over all participants); ΔW exact = Σ_k w_k s B_k A."""
    g = torch.Generator().manual_seed(seed)
    Bs, As = _modules(g, shapes, r)
    saved = Bs if factor == "B" else As
    frozen = As if factor == "B" else Bs
    budgets = data.draw(st.lists(st.integers(1, r), min_size=K, max_size=K))
    w = data.draw(st.lists(st.floats(0.05, 10.0), min_size=K, max_size=K))
    w_n = torch.tensor(w, dtype=D64) / sum(w)
    uploads, masked = [], []
    for k in range(K):
        deltas = {m: torch.randn(saved[m].shape, generator=g, dtype=D64) for m in saved}
        sel = select_ranks(importance_scores(deltas, frozen, factor), budgets[k])
        masked.append({m: mask_delta(deltas[m], sel[m], factor) for m in saved})
        up = pack_upload(deltas, sel, factor)
        if K > 1 and k == 0:  # a client may omit modules where it selected nothing
            up = {m: sd for m, sd in up.items() if sd.indices.numel()}
        uploads.append(up)
    snap_saved, snap_up = _snap(saved), [dict(u) for u in uploads]
    new = server_update(saved, uploads, w, factor)
    for m in saved:
        ref = saved[m] + sum(w_n[k] * masked[k][m] for k in range(K))
        assert torch.allclose(new[m], ref, rtol=1e-12, atol=1e-12)
        # coordinates no client selected are bit-for-bit unchanged (no renormalisation anywhere)
        any_sel = sum(rank_mask(saved[m].shape, uploads[k][m].indices, factor) if m in uploads[k]
                      else torch.zeros(saved[m].shape) for k in range(K)) > 0
        assert torch.equal(new[m][~any_sel], saved[m][~any_sel])
        # exactness: the aggregated ΔW equals Σ_k w_k ΔW_k of the clients' local factors
        locals_ = [saved[m] + masked[k][m] for k in range(K)]
        if factor == "B":
            target = exact_delta(locals_, [frozen[m]] * K, w, s)
            got = s * new[m] @ frozen[m]
        else:
            target = exact_delta([frozen[m]] * K, locals_, w, s)
            got = s * frozen[m] @ new[m]
        assert float(torch.linalg.matrix_norm(got - target)) <= 1e-10 * float(torch.linalg.matrix_norm(target)) + 1e-300
    assert _same(snap_saved, saved)
    assert all(u is v for a, b in zip(snap_up, uploads) for u, v in zip(a.values(), b.values()))


def test_dilution_is_not_renormalised():
    saved = {"m": torch.zeros(2, 3, dtype=D64)}
    d1 = {"m": torch.ones(2, 3, dtype=D64)}
    up1 = pack_upload(d1, {"m": torch.tensor([1])}, "B")   # client 1 selects column 1
    up2 = pack_upload(d1, {"m": torch.tensor([2])}, "B")   # client 2 selects column 2
    new = server_update(saved, [up1, up2, {}], [1, 1, 2], "B")  # client 3 sent nothing
    assert new["m"][:, 0].tolist() == [0.0, 0.0]
    assert new["m"][:, 1].tolist() == [0.25, 0.25] and new["m"][:, 2].tolist() == [0.25, 0.25]


def test_float32_saved_unselected_bits_preserved():
    saved = {"m": torch.randn(4, 5)}
    up = pack_upload({"m": torch.randn(4, 5)}, {"m": torch.tensor([3])}, "B")
    new = server_update(saved, [up], [1.0], "B")
    assert new["m"].dtype == torch.float32
    keep = [0, 1, 2, 4]
    assert torch.equal(new["m"][:, keep], saved["m"][:, keep])


def test_errors():
    g = torch.Generator().manual_seed(0)
    Bs, As = _modules(g, [(4, 3), (5, 2)], 3)
    dB = {m: torch.randn_like(b) for m, b in Bs.items()}
    sc = importance_scores(dB, As, "B")
    with pytest.raises(ConfigError, match="budget"):
        select_ranks(sc, 0)
    with pytest.raises(ConfigError, match="budget"):
        select_ranks(sc, 4)
    with pytest.raises(ConfigError, match="factor"):
        importance_scores(dB, As, "C")
    with pytest.raises(ConfigError, match="B-round"):
        importance_scores(dB, Bs, "B")
    with pytest.raises(ConfigError, match="same modules"):
        importance_scores(dB, {"m0": As["m0"]}, "B")
    with pytest.raises(ConfigError, match="finite"):
        select_ranks({"m": torch.tensor([1.0, float("nan")])}, 1)
    with pytest.raises(ConfigError, match="repeat"):
        pack_upload({"m0": dB["m0"]}, {"m0": torch.tensor([1, 1])}, "B")
    with pytest.raises(ConfigError, match="lie in"):
        pack_upload({"m0": dB["m0"]}, {"m0": torch.tensor([3])}, "B")
    up = pack_upload(dB, select_ranks(sc, 1), "B")
    with pytest.raises(ConfigError, match="unknown module"):
        server_update({"m0": Bs["m0"]}, [up], [1.0], "B")
    with pytest.raises(ConfigError, match="factor"):
        server_update(Bs, [up], [1.0], "A")
    with pytest.raises(ConfigError, match="weights"):
        server_update(Bs, [up, up], [1.0, -1.0], "B")
    with pytest.raises(ConfigError, match="weights"):
        server_update(Bs, [up, up], [0.0, 0.0], "B")
    with pytest.raises(ConfigError, match="dense shape"):
        server_update({"m0": torch.zeros(4, 4), "m1": Bs["m1"]}, [up], [1.0], "B")
    with pytest.raises(ConfigError, match="unexpected tensor"):
        upload_from_tensors({"m0.weird": torch.zeros(1)}, {"m0": (4, 3)}, "B")
    with pytest.raises(ConfigError, match="unknown module"):
        upload_from_tensors(upload_tensors(up), {"m0": (4, 3)}, "B")
    assert select_ranks(sc, __import__("numpy").int64(1)).keys() == sc.keys()
    with pytest.raises(ConfigError, match="values have shape"):
        unpack_delta(SparseDelta(torch.zeros(4, 2), torch.tensor([0]), "B", (4, 3)))

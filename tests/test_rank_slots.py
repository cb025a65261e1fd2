"""One rank-slot helper (``fedlora.methods.base.RankSlots``) and one classifier-head helper in the method base:
per-client ranks on a stacked adapter (mask, truncated upload, zero-padded download), used by HetLoRA, FlexLoRA and
FLoRA alike. Expected values are built slot by slot here, not with the helper's own tensor algebra."""
import pathlib
import re

import torch

from fedlora.methods.base import Method, RankSlots
from fedlora.payload import Payload

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _factors(G=3, slots=4, d_in=5, d_out=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(G, slots, d_in, generator=g, dtype=torch.float64),
            torch.randn(G, d_out, slots, generator=g, dtype=torch.float64))


def test_apply_zeroes_exactly_the_unused_slots():
    A, B = _factors()
    A0, B0 = A.clone(), B.clone()
    ranks = torch.tensor([1, 4, 2])
    slots = RankSlots(ranks, 4)
    assert slots.mask.tolist() == [[True, False, False, False], [True] * 4, [True, True, False, False]]
    slots.apply({"a": A, "b": B}, [("a", "b")])
    for i, r in enumerate(ranks.tolist()):
        for j in range(4):
            if j < r:  # kept bit for bit
                assert torch.equal(A[i, j], A0[i, j]) and torch.equal(B[i, :, j], B0[i, :, j])
            else:
                assert (A[i, j] == 0).all() and (B[i, :, j] == 0).all()
    slots.set(torch.tensor([4, 4, 3]))  # the mask follows new ranks
    assert slots.mask.sum(1).tolist() == [4, 4, 3] and slots.rank(2) == 3


def test_truncate_is_a_copy_of_the_first_r_slots():
    A, B = _factors(seed=1)
    slots = RankSlots(torch.tensor([2, 3, 1]), 4)
    up = slots.truncate({"x.lora_A": A, "x.lora_B": B}, [("x.lora_A", "x.lora_B")], 1)
    assert list(up) == ["x.lora_A", "x.lora_B"]
    assert up["x.lora_A"].shape == (3, 5) and up["x.lora_B"].shape == (2, 3)
    for j in range(3):
        assert torch.equal(up["x.lora_A"][j], A[1, j]) and torch.equal(up["x.lora_B"][:, j], B[1, :, j])
    A0, B0 = A.clone(), B.clone()
    up["x.lora_A"].add_(1.0)  # a snapshot: the model is untouched
    up["x.lora_B"].add_(1.0)
    assert torch.equal(A, A0) and torch.equal(B, B0)


def test_pad_into_writes_q_slots_and_zeroes_the_rest():
    A, B = _factors(seed=2)
    other = A[0].clone(), B[0].clone()
    a = torch.arange(10, dtype=torch.float32).view(2, 5)
    b = torch.arange(4, dtype=torch.float32).view(2, 2) + 100
    RankSlots.pad_into(A, B, 2, a, b)
    for j in range(4):
        want_a = a[j].double() if j < 2 else torch.zeros(5, dtype=torch.float64)
        want_b = b[:, j].double() if j < 2 else torch.zeros(2, dtype=torch.float64)
        assert torch.equal(A[2, j], want_a) and torch.equal(B[2, :, j], want_b)
    assert torch.equal(A[0], other[0]) and torch.equal(B[0], other[1])  # other replicas untouched


def test_aggregate_head_is_the_weighted_mean_of_the_head_only():
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    p = [Payload({"x.lora_A": torch.ones(1, 2), "clf.head_weight": torch.full((2, 3), float(k)),
                  "clf.head_bias": torch.full((2,), 2.0 * k)}) for k in (1, 3)]
    out = Method.aggregate_head(p, w)
    assert sorted(out) == ["clf.head_bias", "clf.head_weight"]
    assert torch.allclose(out["clf.head_weight"], torch.full((2, 3), 0.25 * 1 + 0.75 * 3))
    assert torch.allclose(out["clf.head_bias"], torch.full((2,), 0.25 * 2 + 0.75 * 6))
    assert Method.aggregate_head([Payload({"x.lora_A": torch.ones(1, 2)})], torch.ones(1)) == {}


def test_rank_slots_have_one_owner():
    """No method module builds its own slot mask, truncates factors by slicing, or averages the head itself."""
    patterns = [r"_rank_mask", r"\[replica, :r\]", r"\[replica, :, :r\]", r'endswith\(\("head_weight", "head_bias"\)\)']
    found = [f"{p.name}: {pat}" for p in sorted((ROOT / "fedlora/methods").glob("*.py")) if p.name != "base.py"
             for pat in patterns if re.search(pat, p.read_text())]
    assert not found, found

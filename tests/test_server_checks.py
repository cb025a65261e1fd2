"""Uploads are untrusted input (fedlora.server.UploadSpec) and checkpoints survive corruption
(fedlora.checkpoint): each rule refuses its bad case and passes the honest one."""
import pytest
import torch

from fedlora.checkpoint import list_checkpoints, load_checkpoint, write_checkpoint
from fedlora.errors import ConfigError
from fedlora.payload import Payload
from fedlora.server import UploadSpec

SPEC = UploadSpec({"l.lora_A": ((4, 8), torch.float32), "l.lora_B": ((6, 4), torch.float32)})


def test_honest_uploads_pass_including_truncated_ranks_and_index_sets():
    assert SPEC.check(Payload({"l.lora_A": torch.zeros(4, 8), "l.lora_B": torch.zeros(6, 4)})) is None
    assert SPEC.check(Payload({"l.lora_A": torch.zeros(2, 8), "l.lora_B": torch.zeros(6, 2)})) is None  # r_k < r
    assert SPEC.check(Payload({"l.lora_B.values": torch.zeros(6, 2),
                               "l.lora_B.indices": torch.tensor([0, 3])})) is None


@pytest.mark.parametrize("tensors,says", [
    ({"l.lora_C": torch.zeros(4, 8)}, "unexpected tensor"),
    ({"l.lora_A": torch.zeros(4, 8, 1)}, "dimensions"),
    ({"l.lora_A": torch.zeros(5, 8)}, "exceeds"),
    ({"l.lora_A": torch.zeros(4, 8, dtype=torch.float64)}, "dtype"),
    ({"l.lora_A": torch.full((4, 8), float("nan"))}, "non-finite"),
    ({"l.lora_A": torch.full((4, 8), float("inf"))}, "non-finite"),
    ({"l.lora_B.values": torch.zeros(6, 1), "l.lora_B.indices": torch.tensor([6])}, "outside"),
    ({"l.lora_B.values": torch.zeros(6, 1), "l.lora_B.indices": torch.tensor([0.0])}, "int64"),
])
def test_each_kind_of_bad_upload_is_refused_with_its_reason(tensors, says):
    why = SPEC.check(Payload(tensors))
    assert why is not None and says in why, why


def test_an_upload_larger_than_any_honest_one_or_than_declared_is_refused():
    honest = Payload({"l.lora_A": torch.zeros(4, 8)})
    assert SPEC.check(honest, declared_nbytes=honest.nbytes - 1) is not None
    assert SPEC.check(honest, declared_nbytes=honest.nbytes) is None
    bloated = Payload({"l.lora_A": torch.zeros(4, 8)}, {"x": "y" * (SPEC.max_nbytes + 1)})
    assert "larger than any" in SPEC.check(bloated)


def test_checkpoints_keep_the_last_two_and_fall_back_past_a_corrupted_one(tmp_path):
    for r in (1, 2, 3):
        write_checkpoint(tmp_path, r, {"a.bin": bytes([r]) * 10, "b.bin": b"x" * r}, meta={"r": r})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round_000003", "round_000002"]
    ck = load_checkpoint(tmp_path)
    assert ck.round == 3 and ck.files["a.bin"] == bytes([3]) * 10 and ck.meta == {"r": 3} and not ck.skipped
    (tmp_path / "round_000003" / "a.bin").write_bytes(bytes([3]) * 9)  # truncated
    ck = load_checkpoint(tmp_path)
    assert ck.round == 2 and "does not match its hash" in ck.skipped[0][1]
    (tmp_path / "round_000002" / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match="no intact checkpoint"):
        load_checkpoint(tmp_path)


def test_a_dead_writers_temporary_folder_is_ignored_and_cleared(tmp_path):
    write_checkpoint(tmp_path, 1, {"a.bin": b"1"})
    (tmp_path / ".round_000002.tmp-999999").mkdir()
    assert load_checkpoint(tmp_path).round == 1
    write_checkpoint(tmp_path, 2, {"a.bin": b"2"})
    assert not (tmp_path / ".round_000002.tmp-999999").exists()
    with pytest.raises(ValueError):
        write_checkpoint(tmp_path, 3, {"../evil": b""})

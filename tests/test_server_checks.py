"""Uploads are untrusted input (fedlora.server.UploadSpec) and checkpoints survive corruption
(fedlora.checkpoint): each rule refuses its bad case and passes the honest one; the round protocol
(fedlora.server.Server) charges a failing client the download it received and counts min_clients after
incomplete uploads are dropped."""
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


def test_an_upload_with_one_nan_element_is_refused():
    """One non-finite element among finite ones is enough (not only an all-NaN or all-inf tensor)."""
    for bad in (float("nan"), float("inf"), -float("inf")):
        a = torch.zeros(4, 8)
        a[2, 5] = bad
        why = SPEC.check(Payload({"l.lora_A": a, "l.lora_B": torch.zeros(6, 4)}))
        assert why == "'l.lora_A': non-finite values", why


def test_a_checkpoint_corrupted_at_the_same_size_is_skipped(tmp_path):
    """One byte flipped (the file's length unchanged): the hash, not only the size, finds it."""
    for r in (1, 2):
        write_checkpoint(tmp_path, r, {"a.bin": bytes(range(16)) * r}, meta={"r": r})
    f = tmp_path / "round_000002" / "a.bin"
    blob = bytearray(f.read_bytes())
    blob[7] ^= 0x01
    f.write_bytes(bytes(blob))
    ck = load_checkpoint(tmp_path)
    assert ck.round == 1 and ck.files["a.bin"] == bytes(range(16)) and ck.meta == {"r": 1}
    assert ck.skipped and "a.bin does not match its hash" in ck.skipped[0][1]


# --------------------------------------------------------------------------------------------------
# the round protocol (fedlora.server.Server) with clients that fail in each way, one executor of the test's own
from fedlora.errors import RoundFailed  # noqa: E402
from fedlora.methods.fedavg import FedAvgLoRA  # noqa: E402
from fedlora.server import ClientFailure, ClientUpdate, Federation, Server  # noqa: E402

SIZES = [1.0, 2.0, 3.0, 4.0]


def _upload(k: int, rnd: int) -> dict:
    g = torch.Generator().manual_seed(100 * rnd + k)
    return {"l.lora_A": torch.randn(4, 8, generator=g), "l.lora_B": torch.randn(6, 4, generator=g)}


class _Clients:
    """Not live, no shared base (as the slot runtime's clients): each client applies its download and reports the
    bytes it received — the safetensors size of what the server sent it — whatever then goes wrong.
    ``faults[(client, round)]``: "nan_loss", "nan_element" (one NaN in its upload), "incomplete" (no lora_B),
    "raise" (fails before receiving anything)."""
    live, shared_base = False, False

    def __init__(self, faults):
        self.faults, self.received = faults, {}

    def train(self, rnd, clients, downloads):
        out = {}
        for k in clients:
            fault = self.faults.get((k, rnd))
            if fault == "raise":
                out[k] = ClientFailure("boom", "error")
                continue
            got = Payload(dict(downloads[k].state)).nbytes if downloads[k].state else 0
            self.received[(k, rnd)] = got
            up, loss = _upload(k, rnd), 0.5
            if fault == "nan_loss":
                loss = float("nan")
            elif fault == "nan_element":
                up["l.lora_A"][1, 2] = float("nan")
            elif fault == "incomplete":
                del up["l.lora_B"]
            out[k] = ClientUpdate(Payload(up), loss, None, got)
        return out

    def deliver(self, rnd, downloads):
        return {k: Payload(dict(d.state)).nbytes if d.counted and d.state else 0 for k, d in downloads.items()}


def _server(min_clients=1, rounds=3):
    return Server(FedAvgLoRA(rank=4), Federation(1, 4, client_weights=SIZES), [{}], rounds, min_clients=min_clients,
                  spec=SPEC)


def _mean(clients, rnd):
    """Σ n_k U_k / Σ n_k over ``clients``' round-``rnd`` uploads, in float64 (the test's own arithmetic)."""
    total = sum(SIZES[k] for k in clients)
    return {n: sum(SIZES[k] * _upload(k, rnd)[n].double() for k in clients) / total for n in ("l.lora_A", "l.lora_B")}


def test_a_failing_client_is_charged_the_download_it_received_and_never_averaged():
    """Round 2: client 1's loss is NaN, client 2's upload has one NaN element, client 3's lacks lora_B, client 0
    is fine. Each of the four received the whole server state (A and B after round 1): its bytes_down is that
    payload's size, failed or not; the state after round 2 is client 0's upload alone; the failures are named."""
    clients = _Clients({(1, 1): "nan_loss", (2, 1): "nan_element", (3, 1): "incomplete"})
    server = _server()
    r1 = server.run_round(clients)
    assert r1["bytes_down"] == {"0": 0, "1": 0, "2": 0, "3": 0}  # the initial adapter is everyone's already
    state1 = {n: v.clone() for n, v in server.states[0].items()}
    full = Payload(state1).nbytes
    assert full == Payload({"l.lora_A": torch.zeros(4, 8), "l.lora_B": torch.zeros(6, 4)}).nbytes > 0
    r2 = server.run_round(clients)
    assert r2["failures"] == {
        "1": {"kind": "nonfinite_loss", "why": "non-finite training loss nan"},
        "2": {"kind": "rejected", "why": "upload rejected: 'l.lora_A': non-finite values"},
        "3": {"kind": "rejected", "why": "upload rejected: it lacks l.lora_B (the round's other uploads carry it)"}}
    assert r2["bytes_down"] == {str(k): full for k in range(4)}
    assert r2["bytes_up"] == {"0": Payload(_upload(0, 1)).nbytes} and list(r2["train_loss"]) == ["0"]
    for n, v in _mean([0], 1).items():
        torch.testing.assert_close(server.states[0][n].double(), v)
    # the failed clients are not synchronised: round 3 sends them the state again (and charges it); the last round
    # adds everyone's final synchronisation
    assert [server.synced(k) for k in range(4)] == [0, -1, -1, -1]
    r3 = server.run_round(clients)
    assert r3["bytes_down"] == {str(k): 2 * full for k in range(4)}
    for n, v in _mean([0, 1, 2, 3], 2).items():
        torch.testing.assert_close(server.states[0][n].double(), v)


def test_min_clients_counts_the_uploads_left_after_incomplete_ones_are_dropped():
    """min_clients 2: round 1 has two uploads that pass the checks (clients 0 and 3) but client 3's lacks a
    tensor, so one is left — the round fails, naming every client lost; with a third complete upload (client 1)
    the round stands on the two complete ones, weights renormalised over them."""
    faults = {(1, 0): "raise", (2, 0): "nan_loss", (3, 0): "incomplete"}
    with pytest.raises(RoundFailed) as e:
        _server(min_clients=2).run_round(_Clients(faults))
    assert str(e.value) == ("round 1: 1 accepted upload(s), federation.min_clients is 2 (client 1: boom, client 2: "
                            "non-finite training loss nan, client 3: upload rejected: it lacks l.lora_B (the round's "
                            "other uploads carry it))")
    server = _server(min_clients=2)
    rec = server.run_round(_Clients({(2, 0): "nan_loss", (3, 0): "incomplete"}))
    assert sorted(rec["failures"]) == ["2", "3"] and sorted(rec["train_loss"]) == ["0", "1"]
    for n, v in _mean([0, 1], 0).items():
        torch.testing.assert_close(server.states[0][n].double(), v)

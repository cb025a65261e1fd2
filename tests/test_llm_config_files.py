"""A config file that is not a valid table (issue 18): `fedlora run CONFIG` and the synthetic commands'
`--config FILE` say in one line on stderr which file and what is wrong in it — the parser's problem and
where (line, column), not only its context — exit with status 2, print no traceback and create no folder.
YAML and JSON keys given twice are refused like TOML's (both parsers would keep the last one silently:
a second `train:` section would drop the first one's settings)."""
import pytest

from fedlora.cli import main
from fedlora.io import read_table_file

BAD = {
    "yaml indentation": ("c.yaml", "model:\n  name: x\n max_length: 3\n",
                         "line 3, column 2: expected <block end>, but found '<block mapping start>' "
                         "(while parsing a block mapping from line 1, column 1)"),
    "yaml unclosed": ("c.yaml", "method: {name: fedavg\ntrain: {rounds: 2}\n",
                      "line 2, column 6: expected ',' or '}', but got ':' (while parsing a flow mapping from line 1, "
                      "column 9)"),
    "yaml tab": ("c.yaml", "train:\n\trounds: 2\n", "line 2, column 1: found character '\\t' that cannot start any token"),
    "yaml duplicate key": ("c.yaml", "train:\n  rounds: 2\ntrain:\n  rounds: 3\n",
                           "line 3, column 1: found duplicate key 'train'"),
    "yaml nested duplicate": ("c.yml", "train:\n  rounds: 2\n  rounds: 3\n", "line 3, column 3: found duplicate key 'rounds'"),
    "yaml python tag": ("c.yaml", "model: !!python/object:os.system {}\n",
                        "line 1, column 8: could not determine a constructor for the tag"),
    "yaml list": ("c.yaml", "- a\n- b\n", "must hold a table"),
    "toml no value": ("c.toml", "[train]\nrounds = \n", "Invalid value (at line 2, column 10)"),
    "toml duplicate table": ("c.toml", "[train]\nrounds = 2\n[train]\nrounds = 3\n", "twice (at line 3, column 7)"),
    "json trailing comma": ("c.json", '{"train": {"rounds": 2},}', "line 1 column 25"),
    "json duplicate key": ("c.json", '{"train": {"rounds": 2}, "train": {}}', "duplicate key 'train'"),
    "not utf-8": ("c.yaml", b"\xff\xfe\x00train: {}", "not UTF-8 text (byte 0xff at offset 0)"),
}

@pytest.fixture
def no_work(monkeypatch):
    """Every experiment fails loudly if it starts (a file read as the wrong table must not start one)."""
    import fedlora.synthetic.compare
    import fedlora.synthetic.rank_recovery

    pytest.importorskip("transformers")
    import fedlora.llm.runtime

    def boom(*a, **k):
        raise AssertionError("the experiment started")

    for mod, fn in ((fedlora.synthetic.rank_recovery, "run_rank_recovery"), (fedlora.synthetic.compare, "run_compare"),
                    (fedlora.llm.runtime.FederatedRun, "prepare"), (fedlora.llm.runtime.FederatedRun, "check_data")):
        monkeypatch.setattr(mod, fn, boom)


COMMANDS = {"run": (["run"], "config"), "rank-recovery": (["synthetic", "rank-recovery", "--config"], "--config"),
            "compare": (["synthetic", "compare", "--config"], "--config")}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_config_file_is_one_line_naming_the_file_and_the_problem(case, command, tmp_path, monkeypatch,
                                                                             capsys, no_work):
    name, content, says = BAD[case]
    work = tmp_path / "work"
    work.mkdir()
    cfg = work / name
    cfg.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(work)  # where a default output folder would go
    argv, flag = COMMANDS[command]
    assert main([*argv, str(cfg), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    verb = "cannot read" if case == "not utf-8" else ("must hold" if case == "yaml list" else "cannot parse")
    prefix = (f"fedlora: error: {flag}: {str(cfg)!r} must hold a table" if case == "yaml list"
              else f"fedlora: error: {flag}: {verb} {str(cfg)!r}: ")
    assert captured.err.startswith(prefix) and captured.err.count("\n") == 1, captured.err
    assert says in captured.err and "Traceback" not in captured.err, captured.err
    assert captured.out == ""
    assert not (tmp_path / "out").exists() and [p.name for p in work.iterdir()] == [name]  # no folder made


def test_yaml_merge_keys_may_still_be_overridden_and_a_bom_is_fine(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("base: &b {rounds: 2, batch_size: 4}\ntrain:\n  <<: *b\n  rounds: 3\n")
    assert read_table_file(cfg)["train"] == {"rounds": 3, "batch_size": 4}
    cfg.write_bytes(b"\xef\xbb\xbf" + b'{"train": {"rounds": 2}}')
    (tmp_path / "c.json").write_bytes(cfg.read_bytes())
    assert read_table_file(tmp_path / "c.json") == {"train": {"rounds": 2}}

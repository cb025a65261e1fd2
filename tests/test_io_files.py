"""fedlora.io: the atomic writer's file mode (issue 18 §4) and the results-folder claim of every command
that writes one (issue 18 §1: run folders must not mix experiments)."""
import os
import stat
from pathlib import Path

import pytest

from fedlora.errors import ConfigError
from fedlora.io import RESUME_LATER, claim_output_dir, write_bytes_atomic, write_json_atomic

WRITES = ("config.json", "rounds.jsonl", "adapters")


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600), (0o027, 0o640)],
                         ids=lambda m: f"{m:04o}")
def test_atomic_writes_get_the_umasks_mode_like_any_file_the_user_creates(tmp_path, umask, mask, mode):
    umask(mask)
    write_bytes_atomic(tmp_path / "a.bin", b"x")
    write_json_atomic(tmp_path / "b.json", {"a": 1})
    with open(tmp_path / "c.txt", "w") as f:  # what open() gives, as rounds.jsonl is written
        f.write("x")
    for name in ("a.bin", "b.json", "c.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    write_bytes_atomic(tmp_path / "a.bin", b"y")  # replacing a file: the umask's mode again, content new
    assert stat.S_IMODE((tmp_path / "a.bin").stat().st_mode) == mode and (tmp_path / "a.bin").read_bytes() == b"y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.json", "c.txt"]  # no temp file left


def test_the_umask_is_read_without_proc_too(monkeypatch, umask):
    """Where /proc/self/status does not exist (macOS), the umask is read by setting and restoring it."""
    import fedlora.io

    def no_proc(*a, **k):
        raise FileNotFoundError("/proc/self/status")

    umask(0o027)
    assert fedlora.io._umask() == 0o027
    monkeypatch.setattr(fedlora.io, "open", no_proc, raising=False)
    assert fedlora.io._umask() == 0o027 and fedlora.io._umask() == 0o027  # and left as it was
    assert os.umask(0o027) == 0o027


# ---------------------------------------------------------------------------------------------
# claim_output_dir

def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _old_run(folder: Path) -> None:
    (folder / "adapters").mkdir(parents=True)
    (folder / "adapters" / "client_4.safetensors").write_bytes(b"stale")
    (folder / "config.json").write_text("{}")
    (folder / ".rounds.jsonl.k3j2.tmp").write_text("left by a killed writer")


def test_a_new_folder_is_created_and_removed_again_with_the_parents_the_claim_created(tmp_path):
    (tmp_path / "runs").mkdir()
    out = tmp_path / "runs" / "a" / "b"
    d = claim_output_dir(out, writes=WRITES)
    assert d.path == out and out.is_dir() and list(out.iterdir()) == []
    assert d.created == tmp_path / "runs" / "a"  # the topmost folder the claim made
    d.remove_if_empty()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == []  # runs/ existed: kept
    assert (tmp_path / "runs").is_dir()


def test_an_existing_empty_folder_is_fine_and_never_removed(tmp_path):
    d = claim_output_dir(tmp_path, writes=WRITES)
    assert d.created is None
    (tmp_path / "config.json").write_text("{}")
    d.discard()  # what the command wrote goes, the folder it did not create stays
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []
    d.remove_if_empty()
    assert tmp_path.is_dir()


def test_discard_removes_only_what_the_command_writes(tmp_path):
    out = tmp_path / "o"
    d = claim_output_dir(out, writes=WRITES)
    _old_run(out)
    (out / "mine.txt").write_text("a file someone put there meanwhile")
    d.discard()
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # the folder stays while it holds a foreign file
    (out / "mine.txt").unlink()
    d.discard()
    assert not out.exists()


def test_a_folder_that_is_not_empty_is_refused_in_one_line_naming_it_and_the_ways_out(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    before = _tree(out)
    with pytest.raises(ConfigError) as e:
        claim_output_dir(out, "--out", writes=WRITES)
    msg = str(e.value)
    assert msg.startswith("--out: ") and "\n" not in msg and repr(str(out)) in msg
    assert "not empty" in msg and "--overwrite" in msg and "another folder" in msg and "config.json" in msg
    assert _tree(out) == before
    with pytest.raises(ConfigError, match=r"^output_dir: .*give overwrite=True to clear it"):
        claim_output_dir(out, "output_dir", writes=WRITES, overwrite_flag="overwrite=True")
    assert _tree(out) == before


def test_overwrite_clears_a_folder_of_the_commands_own_results(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    d = claim_output_dir(out, writes=WRITES, overwrite=True)
    assert d.path == out and d.created is None and list(out.iterdir()) == []


@pytest.mark.parametrize("foreign", ["notes.txt", "compare.json", ".git", "config.json.bak"])
def test_overwrite_never_clears_a_folder_holding_anything_else(tmp_path, foreign):
    out = tmp_path / "run"
    _old_run(out)
    (out / foreign).write_text("keep me")
    before = _tree(out)
    with pytest.raises(ConfigError) as e:
        claim_output_dir(out, writes=WRITES, overwrite=True)
    assert foreign in str(e.value) and "\n" not in str(e.value) and "--overwrite" in str(e.value)
    assert _tree(out) == before  # not one file removed


def test_overwrite_never_clears_the_home_folder(tmp_path, monkeypatch):
    home = tmp_path / "home"
    _old_run(home)  # even one that holds only run files
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    before = _tree(home)
    with pytest.raises(ConfigError, match="never clears .*home folder"):
        claim_output_dir(home, writes=WRITES, overwrite=True)
    assert _tree(home) == before


def test_resume_is_refused_in_one_line_until_runs_write_checkpoints(tmp_path):
    for out in (tmp_path / "new", tmp_path):
        with pytest.raises(ConfigError) as e:
            claim_output_dir(out, writes=WRITES, resume=True)
        assert str(e.value) == RESUME_LATER and "--overwrite" in RESUME_LATER and "issue" not in RESUME_LATER
    assert not (tmp_path / "new").exists()


def test_json_writes_refuse_nan_and_write_infinity_only_when_asked(tmp_path):
    """summary.json may hold ε = ∞ (σ = 0): ``infinity=True`` writes it as rounds.jsonl does; NaN stays refused."""
    import json
    import math

    with pytest.raises(ValueError, match="not JSON compliant"):
        write_json_atomic(tmp_path / "a.json", {"eps": math.inf})
    write_json_atomic(tmp_path / "a.json", {"eps": math.inf, "x": [1.0, -math.inf]}, infinity=True)
    assert json.loads((tmp_path / "a.json").read_text()) == {"eps": math.inf, "x": [1.0, -math.inf]}
    for bad in ({"m": {"loss": math.nan}}, [1.0, [math.nan]], math.nan):
        with pytest.raises(ValueError, match="nan"):
            write_json_atomic(tmp_path / "b.json", bad, infinity=True)
    assert not (tmp_path / "b.json").exists()

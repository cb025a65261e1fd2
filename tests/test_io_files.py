"""fedlora.io: the atomic writer's file mode (issue 18 §4)."""
import os
import stat

import pytest

from fedlora.io import write_bytes_atomic, write_json_atomic


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

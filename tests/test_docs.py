"""Citations lead somewhere a clone has (issue 18 §5).

* No tracked file outside ``docs/`` cites the outside specification or the outside paper files: a
  section of the spec, its path, the papers' folder, or a paper's file name (in full, or elided as
  the docstrings used to write it). Papers are cited by the README's keys; the design by
  ``docs/design.md §N``.
* Every ``docs/design.md §N`` (``§N.M``, ``§N–M``, ``§N, §M``) cited anywhere names a section that
  exists in docs/design.md.

The patterns (and the planted examples below) are assembled from pieces so that this file does not
match itself.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"

_SPEC = "SP" + "EC"
_ELLIPSIS = "\u2026"
#: what must not be cited outside docs/: name → pattern
FORBIDDEN = {
    "a section of the outside specification": re.compile(r"\b" + _SPEC + r"\s*§"),
    "the outside specification's file": re.compile(r"\b" + _SPEC + r"\.md\b|shared/" + _SPEC),
    "the outside papers' folder": re.compile(r"shared/" + "papers"),
    "a paper's file name": re.compile(r"\b00[0-4]_[0-9a-f]{16}\.txt"),
    "a paper's elided file name": re.compile(r"\b00[0-4]_" + _ELLIPSIS),
}

#: folders of a working tree that are not the project's files (used without git)
_NOT_TRACKED = {".git", ".venv", "runs", "__pycache__", ".hypothesis", ".benchmarks", ".pytest_cache", "build"}
_TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".json", ".jsonl", ".sh", ".gz", ""}


def _tracked_files() -> list[Path]:
    """The repository's files: ``git ls-files`` in a checkout, else every file of the tree outside
    the folders .gitignore names."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True,
                             timeout=60).stdout.decode()
        files = [ROOT / n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in ROOT.rglob("*")
                 if not any(part in _NOT_TRACKED or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]
    return [p for p in files if p.is_file() and not p.is_symlink()]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:  # binary (PNG, safetensors, gz …)
        return None
    return data.decode("utf-8", errors="replace")


def forbidden_citations(text: str) -> list[tuple[int, str, str]]:
    """(line, what, the line) for every forbidden citation in ``text``."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        for what, pat in FORBIDDEN.items():
            if pat.search(line):
                found.append((i, what, line.strip()))
    return found


_NUM = r"(\d+(?:\.\d+)?)"
_FIRST = re.compile(r"docs/design\.md\s*§" + _NUM + r"(?:\s*[–-]\s*§?" + _NUM + r")?")
_MORE = re.compile(r"\s*(?:,|and)\s*§" + _NUM + r"(?:\s*[–-]\s*§?" + _NUM + r")?")


def _expand(a: str, b: str | None) -> list[str]:
    if b is None:
        return [a]
    if "." in a or "." in b:  # a range of subsections: its ends must exist
        return [a, b]
    return [str(n) for n in range(int(a), int(b) + 1)]


def design_citations(text: str) -> list[tuple[int, str]]:
    """(line, section) for every section of docs/design.md that ``text`` cites."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in _FIRST.finditer(line):
            secs = _expand(m.group(1), m.group(2))
            pos = m.end()
            while (more := _MORE.match(line, pos)) is not None:
                secs += _expand(more.group(1), more.group(2))
                pos = more.end()
            out += [(i, s) for s in secs]
    return out


def design_sections() -> set[str]:
    """The numbered sections (``## N. …``) and subsections (``### N.M …``) of docs/design.md."""
    text = DESIGN.read_text(encoding="utf-8")
    secs = set(re.findall(r"^##\s+(\d+)\.\s", text, flags=re.M))
    secs |= set(re.findall(r"^###\s+(\d+\.\d+)\s", text, flags=re.M))
    return secs


FILES = _tracked_files()


def test_the_files_are_found_and_the_design_exists():
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"README.md", "fedlora/methods/base.py", "docs/design.md"} <= names
    assert {str(n) for n in range(2, 10)} <= design_sections()  # §2–§9, as the code cites them


def test_no_file_outside_docs_cites_the_outside_spec_or_paper_files():
    bad = []
    for p in FILES:
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("docs/") or p.suffix not in _TEXT:
            continue
        text = _text(p)
        if text is not None:
            bad += [f"{rel}:{i}: {what}: {line[:160]}" for i, what, line in forbidden_citations(text)]
    assert not bad, "citations a clone cannot follow (cite papers by the README's keys, the design as " \
                    "docs/design.md §N):\n" + "\n".join(bad)


def test_every_cited_section_of_the_design_exists():
    have = design_sections()
    cited, bad = 0, []
    for p in FILES:
        if p.suffix not in _TEXT:
            continue
        text = _text(p)
        if text is None:
            continue
        for i, sec in design_citations(text):
            cited += 1
            if sec not in have:
                bad.append(f"{p.relative_to(ROOT).as_posix()}:{i}: §{sec}")
    assert cited >= 50, f"only {cited} citations of docs/design.md found: is the reader broken?"
    assert not bad, f"sections cited but not in docs/design.md (it has {sorted(have)}):\n" + "\n".join(bad)


# --- the readers themselves catch what they must (planted citations) -------------------------------
@pytest.mark.parametrize("line,what", [
    (f"the mean ({_SPEC} §4)", "a section of the outside specification"),
    (f"see ../" + f"shared/{_SPEC}.md §8", "the outside specification's file"),
    ("Papers: ../" + "shared/" + "papers/ (INDEX.md)", "the outside papers' folder"),
    ("as in 000_c6c65d73352e5f2c" + ".txt §5", "a paper's file name"),
    ("PF2LoRA (004_789ff67d7c59950b" + ".txt, Table 3)", "a paper's file name"),
    ("(001_" + _ELLIPSIS + " Algorithm 1)", "a paper's elided file name"),
])
def test_each_forbidden_form_is_caught(line, what):
    assert [w for _, w, _ in forbidden_citations(line)] == [what]


def test_lookalikes_are_not_citations():
    assert forbidden_citations(f"{_SPEC}IAL_TOKENS; a spec string; 005_" + "c6c65d73352e5f2c.txt; x000_1") == []


def test_the_section_reader_reads_every_form():
    d = "docs/" + "design.md"  # not written out: this file's own citations must all exist
    text = (f"a ({d} §4.5) b {d} §2, §4 c {d} §3–4 d\n"
            f"{d} §8 \"slots and passes\" and {d} §4 (methods) and §6 (testbed)\n"
            f"{d} §12")
    assert design_citations(text) == [(1, "4.5"), (1, "2"), (1, "4"), (1, "3"), (1, "4"),
                                      (2, "8"), (2, "4"), (3, "12")]
    assert "12" not in design_sections() and "4.5" in design_sections()

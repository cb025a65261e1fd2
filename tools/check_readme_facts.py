"""Did every fact of an older README survive the move to the docs site? (issue 16; run by hand)

    python tools/check_readme_facts.py [COMMIT]        # default faed6b1, the last README before the site

Reads that commit's README.md with git and checks, against README.md and every page under docs/:

* every non-empty line of the old README is present, verbatim, on some page (links compared by target
  file, since the pages link relative to themselves; headings at any level); a line that is not must have an
  edited counterpart — the most similar line of the pages, at least 60 % alike, holding every number and every
  `code` span of the old line (a cross-reference such as "the table below" made a link) — and both are printed;
  a line without one is lost;
* every command line (```bash blocks and inline `fedlora …`, `python …`, `make …`, `.venv/bin/…` spans), every
  figure (![…](path)) and every number with a decimal point or unit is present somewhere.

Exit 0 when nothing is lost. It needs the git history, so it is a tool, not a test: the durable checks are in
tests/test_readme.py (every example of the README and of the docs runs) and tests/test_docs_site.py (the strict
build: every link, figure and anchor resolves; every figure has its command on its page).
"""
from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _norm(line: str) -> str:
    line = re.sub(r"\]\((?:\.\./)*(?:docs/)?", "](", line)  # a link's target, wherever the page lies
    return re.sub(r"^#+ ", "# ", line.strip())  # a heading's level changes with its page


def _unlink(line: str) -> str:
    """A line with its links' targets left out (for comparing the words)."""
    return re.sub(r"\]\([^)]*\)", "]", line)


def _pages() -> list[str]:
    return [(ROOT / "README.md").read_text(encoding="utf-8")] + [
        p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    commit = argv[0] if argv else "faed6b1"
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:README.md"], capture_output=True, text=True,
                         check=True).stdout
    pages = _pages()
    have_lines = {_norm(ln) for text in pages for ln in text.splitlines()}
    everything = "\n".join(_norm(ln) for text in pages for ln in text.splitlines())
    lines = [ln for ln in old.splitlines() if ln.strip()]
    missing = [ln for ln in lines if _norm(ln) not in have_lines]
    candidates = sorted(have_lines)
    edited, lost_lines = [], []
    for ln in missing:
        old_text = _unlink(_norm(ln))
        best = max(candidates, key=lambda c: difflib.SequenceMatcher(None, old_text, _unlink(c)).quick_ratio())
        ratio = difflib.SequenceMatcher(None, old_text, _unlink(best)).ratio()
        kept = re.findall(r"`[^`]+`|\d+(?:\.\d+)?", ln)
        if ratio >= 0.6 and all(k in best for k in kept):
            edited.append((ln, best, ratio))
        else:
            lost_lines.append(ln)
    commands = [ln.split(" #")[0].strip() for b in re.findall(r"```bash\n(.*?)```", old, flags=re.S)
                for ln in b.splitlines() if ln.strip() and not ln.startswith("#")]
    commands += re.findall(r"`((?:fedlora|python|make|\.venv/bin/\S+) [^`]*)`", old)
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", old)
    numbers = set(re.findall(r"\d+(?:[.,]\d+)+(?:\s?(?:%|s|MB|MiB|B|min|×))?|\d+\s?(?:%|MB|MiB|min)\b|×\d+(?:\.\d+)?", old))
    lost = {
        "lines": lost_lines,
        "commands": [c for c in commands if c not in everything],
        "figures": [f for f in figures if f not in everything],
        "numbers": sorted(n for n in numbers if n not in everything),
    }
    print(f"{commit}:README.md: {len(lines)} non-empty lines, {len(set(commands))} commands, {len(figures)} figures, "
          f"{len(numbers)} numbers")
    print(f"  lines edited (a cross-reference made a link; every number and code span kept): {len(edited)}")
    for ln, best, ratio in edited:
        print(f"    - {ln.strip()}\n    + {best}  ({ratio:.0%} alike)")
    for what, items in lost.items():
        print(f"  {what} lost: {len(items)}")
        for item in items:
            print(f"    {item}")
    return 1 if any(lost.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

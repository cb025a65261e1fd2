"""Writes docs/reference/config.md, the field reference of `fedlora run`'s config, from the config's
dataclasses (``fedlora.llm.config``): every section, every field with its type and default, each
section's docstring and each field's ``#:`` comment. tests/test_cli_words.py checks that the page is
what this script writes, so a field added, renamed or re-defaulted without the page fails the tests.

    .venv/bin/python tools/config_reference.py          # rewrite the page
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "config.md"

INTRO = """\
<!-- Written by tools/config_reference.py from fedlora.llm.config; edit the dataclasses, then rerun it. -->
# Config fields

Every field of a `fedlora run` config, as the config's dataclasses (`fedlora.llm.config`) define it. A
config is a YAML, TOML or JSON file (or a bundled one's name: `fedlora run --list-configs`) with the
sections below; a field left out takes its default. Any field can be set on the command line:
`--set section.field=value` (e.g. `--set train.rounds=5 --set method.name=rolora`), and
`fedlora run CONFIG --dry-run` prints the config as resolved. A bad value is refused in one line naming
the field and what it allows; an unknown field gets a "did you mean".
"""


def _md(text: str) -> str:
    """A docstring's reST inline code (``x``) as Markdown's (`x`)."""
    return text.replace("``", "`")


def _field_notes(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment (the lines just above its annotation), joined."""
    notes: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#:"):
            pending.append(s[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", s)
        if m and pending:
            notes[m.group(1)] = " ".join(pending)
        pending = []
    return notes


def _doc(cls: type, names: set[str]) -> str:
    """The class docstring as Markdown: a line ``field: …`` (at the docstring's margin) starts a bullet."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: list[str] = []
    for line in doc.splitlines():
        m = re.match(r"(\w+): ", line)
        if m and m.group(1) in names:
            out.append(f"- **{m.group(1)}**: {line[m.end():]}")
        elif line.startswith("    ") and out and out[-1].startswith("- "):
            out[-1] += " " + line.strip()
        elif line.strip() == "":
            out.append("")
        elif out and out[-1].startswith("- "):  # a paragraph after a list
            out += ["", line]
        else:
            out.append(line)
    return _md("\n".join(out)).strip()


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if not isinstance(value, str) else f"`{value}`"


def _table(prefix: str, fields: list[dataclasses.Field], notes: dict[str, str]) -> list[str]:
    rows = ["| field | type | default | note |", "|---|---|---|---|"]
    for f in fields:
        typ = str(f.type).replace(" | ", " or ")
        note = _md(notes.get(f.name, "")).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {typ} | {_default(f)} | {note} |")
    return rows


def render() -> str:
    from fedlora.llm.config import RunConfig

    top = [f for f in dataclasses.fields(RunConfig) if not dataclasses.is_dataclass(f.default_factory)
           if f.default_factory is dataclasses.MISSING or not isinstance(f.default_factory, type)]
    sections = [f for f in dataclasses.fields(RunConfig) if f not in top]
    lines = [INTRO, "## Top level", ""]
    lines += _table("", top, _field_notes(RunConfig))
    for sec in sections:
        cls = sec.default_factory  # type: ignore[misc]
        fields = dataclasses.fields(cls)
        subs = [f for f in fields if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)]
        lines += ["", f"## {sec.name}", "", _doc(cls, {f.name for f in fields}), ""]
        lines += _table(f"{sec.name}.", list(fields), _field_notes(cls))
        for sub in subs:  # a section inside a section (privacy.secagg): its own table
            scls = sub.default_factory  # type: ignore[misc]
            sfields = dataclasses.fields(scls)
            lines += ["", f"## {sec.name}.{sub.name}", "", _doc(scls, {f.name for f in sfields}), ""]
            lines += _table(f"{sec.name}.{sub.name}.", list(sfields), _field_notes(scls))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Build the bundled ``debian-describe`` data-to-text set from Debian package records.

Each sample is one binary package's record, its structured fields linearised as the prompt —
``package : alsa-topology-conf | section : libs | priority : optional | depends : …`` — and its maintainers'
short description as the target (``ALSA topology configuration files``): real English written by people for
exactly these records, the shape of E2E's meaning representation → text (docs/tutorials/generation.md,
"The offline demo"). Run (reproducible from the same records file)::

    python -m fedlora.llm.datasets.build_debian_describe --records /var/lib/dpkg/status --out llm/datasets/debian_describe

``--records`` is any file of Debian control stanzas: a dpkg ``status`` file, or an apt ``Packages`` list
(decompressed). The bundled copy was built from the ``/var/lib/dpkg/status`` of a Debian 12 "bookworm" image
(the SHA-256 of that file is in the README the builder writes).

Pipeline (every step deterministic):

1. Stanzas with ``Package`` and ``Description``; a dpkg status file's packages that are not installed are
   skipped; one stanza per package name (the first).
2. Dropped: transitional / dummy packages (phrases in the description) and short descriptions of fewer than
   ``--min-words`` words.
3. The prompt: ``package``, ``section`` (the area prefix ``contrib/`` / ``non-free/`` dropped), ``priority``,
   ``architecture`` and at most ``--max-depends`` dependency names (alternatives and version constraints dropped,
   in the record's order), ``key : value`` joined by `` | ``; the target: the short description as written.
4. A train/test split by a keyed SHA-256 of the package name (``--test-share``, default 0.2).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

SKIP = re.compile(r"\b(transitional|dummy) package\b", re.I)


def stanzas(text: str) -> list[dict[str, str]]:
    """Debian control stanzas → field dicts (continuation lines joined to their field)."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key is not None:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        if fields:
            out.append(fields)
    return out


def depends(value: str, most: int) -> list[str]:
    names = []
    for part in value.split(","):
        name = re.split(r"[\s(|:]", part.strip(), maxsplit=1)[0]
        if name and name not in names:
            names.append(name)
    return names[:most]


def record(f: dict[str, str], max_depends: int) -> str:
    section = f.get("Section", "").split("/")[-1]
    items = [("package", f["Package"]), ("section", section), ("priority", f.get("Priority", "")),
             ("architecture", f.get("Architecture", ""))]
    deps = depends(f.get("Depends", "") + ("," + f["Pre-Depends"] if f.get("Pre-Depends") else ""), max_depends)
    if deps:
        items.append(("depends", ", ".join(deps)))
    return " | ".join(f"{k} : {v}" for k, v in items if v)


def build(text: str, *, min_words: int = 2, max_depends: int = 4, test_share: float = 0.2,
          key: str = "debian-describe") -> tuple[list[dict], list[dict], dict]:
    seen, rows, dropped = set(), [], {"not installed": 0, "duplicate": 0, "transitional/dummy": 0, "short": 0}
    for f in stanzas(text):
        if "Package" not in f or "Description" not in f:
            continue
        if "Status" in f and not f["Status"].endswith(" installed"):
            dropped["not installed"] += 1
            continue
        if f["Package"] in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(f["Package"])
        short = f["Description"].split("\n", 1)[0].strip()
        if SKIP.search(f["Description"]):
            dropped["transitional/dummy"] += 1
            continue
        if len(short.split()) < min_words:
            dropped["short"] += 1
            continue
        rows.append({"record": record(f, max_depends), "description": short,
                     "section": f.get("Section", "").split("/")[-1] or "unknown", "package": f["Package"]})
    rows.sort(key=lambda r: r["package"])

    def is_test(name: str) -> bool:
        h = hashlib.sha256(f"{key}:{name}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < test_share

    test = [r for r in rows if is_test(r["package"])]
    train = [r for r in rows if not is_test(r["package"])]
    return train, test, dropped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", default="/var/lib/dpkg/status", help="a dpkg status file or an apt Packages list")
    p.add_argument("--out", required=True)
    p.add_argument("--min-words", type=int, default=2)
    p.add_argument("--max-depends", type=int, default=4)
    p.add_argument("--test-share", type=float, default=0.2)
    a = p.parse_args(argv)
    raw = Path(a.records).read_bytes()
    train, test, dropped = build(raw.decode("utf-8"), min_words=a.min_words, max_depends=a.max_depends,
                                 test_share=a.test_share)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os_release = Path("/etc/os-release").read_text().splitlines() if Path("/etc/os-release").exists() else []
    pretty = next((ln.split("=", 1)[1].strip('"') for ln in os_release if ln.startswith("PRETTY_NAME=")), "unknown")
    (out / "README.md").write_text(
        "# debian-describe (bundled)\n\n"
        "Data-to-text: a Debian package's record (package, section, priority, architecture, first dependencies) → "
        "its maintainers' short description. Built by `python -m fedlora.llm.datasets.build_debian_describe "
        f"--records {a.records} --out {a.out}` (llm/datasets/build_debian_describe.py says how).\n\n"
        f"- records: `{a.records}` of {pretty}, SHA-256 {hashlib.sha256(raw).hexdigest()}\n"
        f"- kept: {len(train)} train, {len(test)} test; dropped: "
        + ", ".join(f"{k} {v}" for k, v in dropped.items()) + "\n"
        "- licence: package metadata of Debian (the descriptions are the packages' maintainers' text, distributed "
        "with the archive under its packages' licences)\n")
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

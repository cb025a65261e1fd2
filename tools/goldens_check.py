"""Are two checkouts' results the same to the last bit? (issue 26's acceptance; run by hand)

    .venv/bin/python tools/goldens_check.py capture --fedlora /path/to/other/.venv/bin/fedlora --out DIR_A
    .venv/bin/python tools/goldens_check.py capture --fedlora .venv/bin/fedlora --out DIR_B
    .venv/bin/python tools/goldens_check.py compare DIR_A DIR_B

``capture`` runs, one after the other with ``HF_HUB_OFFLINE=1``, with the given installed ``fedlora``
script (so the same tool can drive another checkout's venv), each run into its own folder under DIR
(the working directory is DIR and every ``--out`` is relative, so the paths a run records are the same
for both checkouts):

* ``llm/<method>``: ``fedlora run tiny-smoke --set method.name=<method> --out llm/<method> --no-progress``
  for each of the 13 registered methods (centralized, fedavg, fedsa, ffa, flexlora, flora, h2tune, hetlora,
  local, lora-a2, perfedavg, pf2lora, rolora; the names are asked of that checkout's
  ``fedlora.methods.available_methods()``). tiny-smoke samples clients already
  (``federation.sample_fraction: 0.5``, 3 clients, 2 rounds), and every method runs on it (H²Tune with
  one model family, as on any single-model config), so none is left out;
* ``synthetic/rank-recovery``: the synthetic main job, ``fedlora synthetic rank-recovery --preset tuned
  --ground-truth shared-private --seeds 5 --no-plot``;
* ``synthetic/bilevel-convergence``: ``fedlora synthetic bilevel-convergence --steps 2000 --no-plot``;
* ``synthetic/compare`` and ``synthetic/compare-sampled``: ``fedlora synthetic compare --seeds 1 --rounds 5
  --heterogeneity 0,1 --n-test 100 --no-plot`` (every method, both tasks), the second with
  ``--sample-fraction 0.5 --methods`` every method but centralized (compare refuses to sample clients
  with centralized in the list: pooled training has no clients);
* ``synthetic/tune`` only with ``--tune`` (2 min on the shared 2-core machine): ``fedlora synthetic tune
  --seeds 1 --n-samples 300 --n-train 200``.

``--only NAME,…`` (re)captures just those runs into an existing capture (e.g. to rerun one that failed).

Not captured: ``fedlora synthetic flower`` and ``fedlora run --runtime flower`` (Flower's runtimes check
themselves against the embedded run, which is captured). DIR/capture.json records each command, its exit
status and the tail of its stderr; a failed command is captured as failed and the next one runs.

``compare`` walks both captures and compares, per run, every ``*.json`` and ``*.jsonl`` file (rounds.jsonl,
summary.json, config.json, run.json, metrics.json, compare.json, tune.json, and the checkpoints'
manifest.json and rounds.jsonl): the same keys, list lengths and types, equal strings, booleans and
nulls, and every number equal to the last bit (``struct.pack('<d')`` of the parsed float, so -0.0 ≠ 0.0
and NaN = NaN only with the same bits; an int is never equal to a float). Every ``*.safetensors`` file
(adapters/, checkpoints/: LoRA factors, optimizer state, RNG state) is compared tensor by tensor — names,
dtypes, shapes and the raw bytes, i.e. bit for bit (stricter than ``torch.equal``, which calls
-0.0 and 0.0 equal) — and its metadata as JSON. Other files (rounds.png, compare.md) are not compared,
but both captures must hold the same file names.

Ignored, and nothing else (each is printed with how often it was skipped):

* wall-clock timings, by key name anywhere: ``wall_s`` (rounds.jsonl, summary.json, compare.json),
  ``wall_s_parts`` (summary.json, checkpoints' manifest.json ``meta``), ``wall_s_grid`` (compare.json
  ``results``), ``timing`` (rank-recovery's ``{"oracles_s"}``, compare's ``{"total_s"}``) and ``runtime_s``
  (bilevel-convergence's ``{"loop", "total"}``). Any other key whose name says it is a time (``wall``,
  ``timing``, ``seconds``, ``elapsed`` or ending in ``_s``) is NOT ignored but named in the output, so a new
  timing field shows up rather than hides a difference; ``federation.timeout_s`` (a config value) is one;
* provenance in config.json's ``resolved.manifest``: ``command`` (the script's path), ``git``, ``platform``,
  ``python`` and ``versions``; its ``data_files`` are compared with each path cut to its last three parts
  (the checkouts lie in different folders; the data's sha256 must match);
* in a checkpoint's manifest.json, the entry ``files["rounds.jsonl"]`` (sha256 and size of the checkpoint's
  rounds.jsonl, which holds ``wall_s``; that rounds.jsonl itself is compared with ``wall_s`` ignored).

One line per run (``same`` or ``DIFF`` with the first differing file, line and key path, and how many
values differ; ``--all``: every difference), then the ignored keys; exit 1 if any run differs, is missing
on one side, or failed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TIMING_KEYS = ("wall_s", "wall_s_parts", "wall_s_grid", "timing", "runtime_s")
PROVENANCE_KEYS = ("command", "git", "platform", "python", "versions")
TIME_LIKE = re.compile(r"wall|timing|seconds|elapsed|_s$")

SYNTHETIC = {
    "synthetic/rank-recovery": ["synthetic", "rank-recovery", "--preset", "tuned", "--ground-truth",
                                "shared-private", "--seeds", "5", "--no-plot"],
    "synthetic/bilevel-convergence": ["synthetic", "bilevel-convergence", "--steps", "2000", "--no-plot"],
    "synthetic/compare": ["synthetic", "compare", "--seeds", "1", "--rounds", "5", "--heterogeneity", "0,1",
                          "--n-test", "100", "--no-plot"],
    "synthetic/compare-sampled": ["synthetic", "compare", "--seeds", "1", "--rounds", "5", "--heterogeneity",
                                  "0,1", "--n-test", "100", "--sample-fraction", "0.5", "--no-plot"],
}
TUNE = {"synthetic/tune": ["synthetic", "tune", "--seeds", "1", "--n-samples", "300", "--n-train", "200"]}


# ----------------------------------------------------------------------------------------------- capture
def _methods(fedlora: Path) -> list[str]:
    """The registered method names of the checkout whose venv holds ``fedlora``."""
    python = fedlora.parent / "python"
    # -I: not the working directory's fedlora (a checkout's root would shadow the venv's editable install)
    out = subprocess.run([str(python), "-I", "-c", "from fedlora.methods import available_methods as a; "
                          "print(' '.join(a()))"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def _checkout_commit(fedlora: Path) -> str | None:
    """The checkout that ``fedlora``'s venv imports and its git commit (provenance for capture.json)."""
    python = fedlora.parent / "python"
    out = subprocess.run([str(python), "-I", "-c", "import fedlora, os; print(os.path.dirname(fedlora.__file__))"],
                         capture_output=True, text=True)
    if out.returncode:
        return None
    pkg = out.stdout.strip()
    git = subprocess.run(["git", "-C", pkg, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", pkg, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    if dirty.stdout.strip():  # name the uncommitted state: the sha256 of its diff against HEAD
        diff = subprocess.run(["git", "-C", pkg, "diff", "HEAD"], capture_output=True).stdout
        dirty_note = f" + uncommitted changes (git diff HEAD sha256 {hashlib.sha256(diff).hexdigest()[:12]})"
    else:
        dirty_note = ""
    commit = git.stdout.strip() + dirty_note if git.returncode == 0 else "no git"
    return f"{Path(pkg).parent} at {commit}"


def capture(fedlora: Path, out: Path, tune: bool = False, only: list[str] | None = None) -> int:
    fedlora = fedlora.absolute()
    if not fedlora.is_file():
        sys.exit(f"goldens_check: --fedlora {fedlora}: no such script (give a venv's bin/fedlora)")
    runs = {f"llm/{m}": ["run", "tiny-smoke", "--set", f"method.name={m}", "--no-progress"]
            for m in _methods(fedlora)}
    runs |= SYNTHETIC | (TUNE if tune else {})
    # compare refuses sampling with centralized (pooled training has no clients to sample)
    runs["synthetic/compare-sampled"] = [*runs["synthetic/compare-sampled"], "--methods",
                                         ",".join(m for m in _methods(fedlora) if m != "centralized")]
    if only:
        unknown = [o for o in only if o not in runs]
        if unknown:
            sys.exit(f"goldens_check: --only {','.join(unknown)}: not a run; runs: {', '.join(runs)}")
        runs = {k: v for k, v in runs.items() if k in only}
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # the script's own venv decides which checkout runs
    record_path = out / "capture.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"runs": {}}
    record |= {"fedlora": str(fedlora), "checkout": _checkout_commit(fedlora)}
    failed = 0
    for name, args in runs.items():
        cmd = [str(fedlora), *args, "--out", name]
        if (out / name).exists():
            cmd.append("--overwrite")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        failed += proc.returncode != 0
        record["runs"][name] = {"command": ["fedlora", *cmd[1:]], "returncode": proc.returncode,
                                "stderr_tail": proc.stderr[-2000:]}
        print(f"{'ok    ' if proc.returncode == 0 else 'FAILED'} {name} ({dt:.1f} s)"
              + ("" if proc.returncode == 0 else f": {proc.stderr.strip().splitlines()[-1:]}"), flush=True)
        record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"captured {len(runs)} runs with {fedlora} ({record['checkout']}) into {out}; {failed} failed")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------- compare
class Diff(Exception):
    pass


class Comparison:
    def __init__(self) -> None:
        self.first: str | None = None
        self.diffs: list[str] = []
        self.n_diff = 0
        self.n_numbers = 0
        self.ignored: Counter[str] = Counter()
        self.time_like: Counter[str] = Counter()

    def differ(self, where: str, what: str) -> None:
        self.n_diff += 1
        if self.first is None:
            self.first = f"{where}: {what}"
        if len(self.diffs) < 1000:
            self.diffs.append(f"{where}: {what}")

    # JSON values ------------------------------------------------------------------------------------
    def value(self, a, b, where: str, path: str) -> None:
        if type(a) is not type(b):
            return self.differ(where, f"{path or '$'}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})")
        if isinstance(a, dict):
            for k in sorted(set(a) | set(b)):
                sub = f"{path}.{k}" if re.fullmatch(r"\w+", k) else f"{path}[{json.dumps(k)}]"
                if k in TIMING_KEYS:
                    self.ignored[_generic(sub)] += 1
                    continue
                if TIME_LIKE.search(k):
                    self.time_like[_generic(sub)] += 1
                if k not in a or k not in b:
                    self.differ(where, f"{sub}: only in {'B' if k not in a else 'A'}")
                    continue
                self.value(a[k], b[k], where, sub)
        elif isinstance(a, list):
            if len(a) != len(b):
                return self.differ(where, f"{path or '$'}: length {len(a)} vs {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                self.value(x, y, where, f"{path}[{i}]")
        elif isinstance(a, float):
            self.n_numbers += 1
            if struct.pack("<d", a) != struct.pack("<d", b):
                rel = abs(a - b) / max(abs(a), abs(b)) if math.isfinite(a) and math.isfinite(b) and (a or b) else None
                self.differ(where, f"{path}: {a!r} vs {b!r}" + (f" (relative {rel:.2g})" if rel else ""))
        else:
            self.n_numbers += isinstance(a, int) and not isinstance(a, bool)
            if a != b:
                self.differ(where, f"{path or '$'}: {a!r} vs {b!r}")

    def json_doc(self, a, b, where: str, name: str) -> None:
        if name == "config.json" and isinstance(a, dict) and isinstance(b, dict):
            a, b = _without_provenance(a, self, "A"), _without_provenance(b, self, "B")
        if name == "manifest.json" and isinstance(a, dict) and isinstance(b, dict):
            a, b = _without_rounds_entry(a), _without_rounds_entry(b)
            self.ignored['.files["rounds.jsonl"] (checkpoint manifest.json)'] += 1
        self.value(a, b, where, "")

    # files --------------------------------------------------------------------------------------------
    def file(self, fa: Path, fb: Path, rel: str) -> None:
        if fa.suffix == ".json":
            self.json_doc(json.loads(fa.read_text()), json.loads(fb.read_text()), rel, fa.name)
        elif fa.suffix == ".jsonl":
            la, lb = fa.read_text().splitlines(), fb.read_text().splitlines()
            if len(la) != len(lb):
                self.differ(rel, f"{len(la)} lines vs {len(lb)}")
            for i, (x, y) in enumerate(zip(la, lb), 1):
                self.json_doc(json.loads(x), json.loads(y), f"{rel}:{i}", fa.name)
        elif fa.suffix == ".safetensors":
            self.safetensors(fa, fb, rel)

    def safetensors(self, fa: Path, fb: Path, rel: str) -> None:
        (ha, da), (hb, db) = _read_safetensors(fa), _read_safetensors(fb)
        ma, mb = ha.pop("__metadata__", {}), hb.pop("__metadata__", {})
        for k in sorted(set(ma) | set(mb)):
            x, y = _maybe_json(ma.get(k)), _maybe_json(mb.get(k))
            self.json_doc(x, y, f"{rel} metadata", k)
        for k in sorted(set(ha) | set(hb)):
            if k not in ha or k not in hb:
                self.differ(rel, f"tensor {k}: only in {'B' if k not in ha else 'A'}")
                continue
            ta, tb = ha[k], hb[k]
            if (ta["dtype"], ta["shape"]) != (tb["dtype"], tb["shape"]):
                self.differ(rel, f"tensor {k}: {ta['dtype']}{ta['shape']} vs {tb['dtype']}{tb['shape']}")
                continue
            ba = da[ta["data_offsets"][0]:ta["data_offsets"][1]]
            bb = db[tb["data_offsets"][0]:tb["data_offsets"][1]]
            self.n_numbers += math.prod(ta["shape"])
            if ba != bb:
                self.differ(rel, f"tensor {k}: {_first_element_diff(ta['dtype'], ba, bb)}")


def _generic(path: str) -> str:
    """A key path with its list indices and client ids as [] (for counting what was ignored)."""
    return re.sub(r"\[(\d+|\"\d+\")\]", "[]", path)


def _without_provenance(doc: dict, cmp: Comparison, side: str) -> dict:
    doc = json.loads(json.dumps(doc))
    manifest = doc.get("resolved", {}).get("manifest")
    if isinstance(manifest, dict):
        for k in PROVENANCE_KEYS:
            if k in manifest:
                del manifest[k]
                if side == "A":
                    cmp.ignored[f".resolved.manifest.{k} (config.json)"] += 1
        if isinstance(manifest.get("data_files"), dict):
            manifest["data_files"] = {"/".join(Path(p).parts[-3:]): h for p, h in manifest["data_files"].items()}
    return doc


def _without_rounds_entry(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    if isinstance(doc.get("files"), dict):
        doc["files"].pop("rounds.jsonl", None)
    return doc


def _maybe_json(s):
    try:
        return json.loads(s)
    except (TypeError, ValueError):
        return s


def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


_FORMATS = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i", "I16": "h", "I8": "b", "U8": "B",
            "BOOL": "?"}


def _first_element_diff(dtype: str, a: bytes, b: bytes) -> str:
    n_bytes_diff = sum(x != y for x, y in zip(a, b))
    fmt = _FORMATS.get(dtype)
    if fmt is None:
        return f"{n_bytes_diff} of {len(a)} bytes differ"
    size = struct.calcsize(fmt)
    xs, ys = struct.unpack(f"<{len(a) // size}{fmt}", a), struct.unpack(f"<{len(b) // size}{fmt}", b)
    idx = [i for i, (x, y) in enumerate(zip(xs, ys)) if struct.pack(fmt, x) != struct.pack(fmt, y)]
    return f"{len(idx)} of {len(xs)} elements differ, first at flat index {idx[0]}: {xs[idx[0]]!r} vs {ys[idx[0]]!r}"


def _runs(root: Path) -> list[str]:
    """The run folders of a capture (from its capture.json, else the folders two levels down)."""
    rec = root / "capture.json"
    if rec.exists():
        return list(json.loads(rec.read_text())["runs"])
    return sorted(str(p.relative_to(root)) for p in root.glob("*/*") if p.is_dir())


def compare(a: Path, b: Path, show_all: bool = False) -> int:
    for d in (a, b):
        if not d.is_dir():
            sys.exit(f"goldens_check: {d}: no such capture folder (make one with 'capture')")
    rec = {d: json.loads((d / "capture.json").read_text()) if (d / "capture.json").exists() else {"runs": {}}
           for d in (a, b)}
    print(f"A = {a} ({rec[a].get('checkout')})\nB = {b} ({rec[b].get('checkout')})")
    names = list(dict.fromkeys(_runs(a) + _runs(b)))
    bad = 0
    total = Comparison()
    for name in names:
        ra, rb = a / name, b / name
        codes = [rec[d]["runs"].get(name, {}).get("returncode", 0) for d in (a, b)]
        if any(codes):
            print(f"DIFF  {name}: the command failed (exit status A {codes[0]}, B {codes[1]}; see capture.json)")
            bad += 1
            continue
        if not ra.is_dir() or not rb.is_dir():
            print(f"DIFF  {name}: only in {'A' if ra.is_dir() else 'B'}")
            bad += 1
            continue
        cmp = Comparison()
        fa = {str(p.relative_to(ra)) for p in ra.rglob("*") if p.is_file()}
        fb = {str(p.relative_to(rb)) for p in rb.rglob("*") if p.is_file()}
        for only, side in ((fa - fb, "A"), (fb - fa, "B")):
            for f in sorted(only):
                cmp.differ(f"{name}/{f}", f"only in {side}")
        checked = 0
        for f in sorted(fa & fb):
            if Path(f).suffix in (".json", ".jsonl", ".safetensors"):
                cmp.file(ra / f, rb / f, f"{name}/{f}")
                checked += 1
        if cmp.n_diff:
            bad += 1
            print(f"DIFF  {name}: {cmp.n_diff} value(s) differ; first: {cmp.first}")
            for line in cmp.diffs[1:] if show_all else ():
                print(f"      {line}")
        else:
            print(f"same  {name}: {checked} files, {cmp.n_numbers} numbers bit-equal")
        total.ignored.update(cmp.ignored)
        total.time_like.update(cmp.time_like)
    print("ignored (times skipped): " + ", ".join(f"{k} ×{n}" for k, n in sorted(total.ignored.items())))
    if total.time_like:
        print("compared although the name looks like a time: "
              + ", ".join(f"{k} ×{n}" for k, n in sorted(total.time_like.items())))
    print(f"{len(names) - bad} of {len(names)} runs the same to the last bit" + (f"; {bad} differ" if bad else ""))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="run every golden run with one checkout's fedlora into DIR")
    c.add_argument("--fedlora", type=Path, required=True, help="a venv's bin/fedlora (the checkout to capture)")
    c.add_argument("--out", type=Path, required=True, help="capture folder (created; runs in it are redone)")
    c.add_argument("--tune", action="store_true", help="also capture synthetic tune (about 2 min)")
    c.add_argument("--only", help="comma-separated run names to (re)capture, e.g. llm/fedavg,synthetic/compare")
    d = sub.add_parser("compare", help="compare two captures bit for bit; exit 1 on any difference")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    d.add_argument("--all", action="store_true", help="list every difference (up to 1000 a run), not the first")
    args = p.parse_args(argv)
    if args.cmd == "capture":
        return capture(args.fedlora, args.out, args.tune, args.only.split(",") if args.only else None)
    return compare(args.a, args.b, args.all)


if __name__ == "__main__":
    sys.exit(main())

"""Build the bundled ``debian-sections`` text-classification set from Debian archive metadata.

Samples are real English text: the description of a Debian package (short + long description),
labelled with the archive ``Section`` its maintainers assigned (games, sound, graphics, mail).
Run (reproducible; needs the apt lists of Debian 12 "bookworm" main with the English
descriptions, Translation-en, which Docker images usually disable)::

    mkdir -p /tmp/dsec/lists/partial /tmp/dsec/cache/archives/partial
    echo 'deb http://deb.debian.org/debian bookworm main' > /tmp/dsec/sources.list
    apt-get update -o Dir::State::Lists=/tmp/dsec/lists -o Dir::Cache=/tmp/dsec/cache \\
        -o Dir::Etc::SourceList=/tmp/dsec/sources.list -o Dir::Etc::SourceParts=/nonexistent \\
        -o Acquire::Languages=en
    python -m fedlora.llm.datasets.build_debian_sections --lists-dir /tmp/dsec/lists \\
        --out llm/datasets/debian_sections

(the private ``Dir::State::Lists`` leaves the system's apt state alone).  Or pass already
decompressed files with ``--packages FILE --translations FILE``.

Pipeline (every step deterministic; counts go to the README the builder writes):

1. Binary packages of the chosen sections (the ``contrib/`` / ``non-free/`` area prefix dropped).
2. Drop ``-dbg/-dbgsym/-doc/-dev/-data/-common/-l10n/-i18n`` binaries (they repeat the main
   package's description) and transitional / dummy / metapackages (phrases in the description).
3. One binary per *source* package (the one named like the source, else the shortest name), so
   the many binaries of one source never give near-copies.
4. Text = short description + long description (Translation-en, matched by Description-md5),
   the " ." paragraph markers removed, whitespace normalised; the package's and source's own names
   removed; the section word itself removed (:data:`LEAK_WORDS`: "game/games", "sound/sounds",
   "graphic/graphics/graphical", "mail/mails/e-mail/email") — other topical words (audio, image,
   player, SMTP, ...) stay, so the task is learnable but not a keyword lookup.
5. Descriptions shorter than ``--min-words`` are dropped.  Near-duplicates across all kept
   sources: word-5-gram Jaccard ≥ ``--dup-threshold`` (default 0.3, on the final texts) puts two
   descriptions in one cluster (union-find); one per cluster is kept (the smallest source name).
6. At most ``--max-per-class`` samples per class (chosen by a keyed SHA-256 of the source name),
   then a stratified 80/20 train/test split by source (same hashing), so no source package is in
   both splits and test descriptions are not near-copies of training ones.
"""
from __future__ import annotations

import argparse
import bz2
import datetime as _dt
import gzip
import hashlib
import json
import lzma
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SECTIONS = ("games", "sound", "graphics", "mail")

# Word forms of the section names removed from the text (case-insensitive, whole words).
LEAK_WORDS: dict[str, str] = {
    "games": r"gam(?:e|es)",
    "sound": r"sounds?",
    "graphics": r"graphic(?:s|al)?",
    "mail": r"(?:e-?)?mails?",
}
_LEAK_RE = re.compile(r"\b(?:" + "|".join(LEAK_WORDS.values()) + r")\b", re.IGNORECASE)

EXCLUDED_SUFFIXES = ("-dbg", "-dbgsym", "-doc", "-dev", "-data", "-common", "-l10n", "-i18n")
# Searched in the whole description: packages that only pull in or replace others.
_EXCLUDED_DESC = re.compile(
    r"\btransition(?:al)?\s+(?:dummy\s+)?package|\bdummy\s+package|\bmeta-?\s?package"
    r"|\bvirtual\s+package|\bempty\s+package",
    re.IGNORECASE,
)
_WORD = re.compile(r"[a-z0-9]+")

BUILD_COMMAND = "python -m fedlora.llm.datasets.build_debian_sections --lists-dir LISTS --out llm/datasets/debian_sections"


class BuildError(RuntimeError):
    """Input missing or unusable; the message says what to do."""


# ----------------------------------------------------------------------------- reading apt lists
def read_text(path: Path) -> str:
    """Contents of an apt list file, decompressed (.lz4 via apt-helper, .gz/.xz/.bz2, plain)."""
    name = path.name
    if name.endswith(".gz"):
        return gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
    if name.endswith(".xz"):
        return lzma.decompress(path.read_bytes()).decode("utf-8", "replace")
    if name.endswith(".bz2"):
        return bz2.decompress(path.read_bytes()).decode("utf-8", "replace")
    if name.endswith(".lz4"):
        helper = "/usr/lib/apt/apt-helper"
        if not Path(helper).exists():
            raise BuildError(f"{path} is lz4-compressed and {helper} (apt) is not available to read it")
        out = subprocess.run([helper, "cat-file", str(path)], check=True, capture_output=True)
        return out.stdout.decode("utf-8", "replace")
    return path.read_text(encoding="utf-8", errors="replace")


def parse_deb822(text: str) -> Iterator[dict[str, str]]:
    """Stanzas of a Packages / Translation file as dicts; continuation lines kept with their '\\n'."""
    rec: dict[str, str] = {}
    last = None
    for line in text.split("\n"):
        if not line.strip():
            if rec:
                yield rec
            rec, last = {}, None
        elif line[0] in " \t":
            if last is not None:
                rec[last] += "\n" + line
        else:
            key, _, value = line.partition(":")
            rec[key] = value.strip()
            last = key
    if rec:
        yield rec


def find_lists(lists_dir: Path, suite: str, arch: str) -> tuple[Path, Path, Path | None]:
    """(Packages, Translation-en, InRelease or None) of ``suite``/main in an apt lists folder."""
    def one(pattern: str, what: str) -> Path | None:
        hits = sorted(p for p in lists_dir.glob(pattern) if not p.name.endswith(".diff"))
        if len(hits) > 1:
            raise BuildError(f"several {what} files match {pattern} in {lists_dir}: {[h.name for h in hits]}")
        return hits[0] if hits else None

    pk = one(f"*_dists_{suite}_main_binary-{arch}_Packages*", "Packages")
    tr = one(f"*_dists_{suite}_main_i18n_Translation-en*", "Translation-en")
    rel = one(f"*_dists_{suite}_InRelease", "InRelease")
    if pk is None or tr is None:
        raise BuildError(
            f"{lists_dir} lacks the {suite}/main "
            f"{'Packages' if pk is None else 'Translation-en'} list; fetch both into a private folder "
            "with `apt-get update -o Dir::State::Lists=DIR -o Acquire::Languages=en ...` "
            "(see this module's docstring) and pass --lists-dir DIR"
        )
    return pk, tr, rel


# ----------------------------------------------------------------------------- text
def long_description(desc: str) -> str:
    """Body of a Debian Description field (lines after the first), " ." markers removed."""
    lines = desc.split("\n")[1:]
    kept = [ln.strip() for ln in lines if ln.strip() != "."]
    return " ".join(" ".join(kept).split())


def _name_re(names: Iterable[str]) -> re.Pattern[str] | None:
    alts = sorted({n for n in names if len(n) >= 2}, key=len, reverse=True)
    if not alts:
        return None
    return re.compile(r"(?<![\w-])(?:" + "|".join(re.escape(a) for a in alts) + r")(?![\w-])", re.IGNORECASE)


def make_text(short: str, body: str, names: Iterable[str], *, mask_names: bool = True,
              mask_section_words: bool = True) -> str:
    """Short + long description, own names and section words removed, whitespace normalised."""
    short = short.strip()
    if short and short[-1] not in ".!?:":
        short += "."
    text = f"{short} {body}".strip()
    name_re = _name_re(names) if mask_names else None
    if name_re is not None:
        text = name_re.sub(" ", text)
    if mask_section_words:
        text = _LEAK_RE.sub(" ", text)
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s+([,.;:!?)])", r"\1", text)  # no space before punctuation left by a removal
    text = re.sub(r"\(\s*\)", "", text)
    return re.sub(r"\s+", " ", text).strip()


def shingles(text: str, k: int = 5) -> set[str]:
    words = _WORD.findall(text.lower())
    if len(words) < k:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + k]) for i in range(len(words) - k + 1)}


def near_duplicate_clusters(texts: list[str], threshold: float) -> list[int]:
    """Cluster id per text: union-find over pairs with word-5-gram Jaccard ≥ threshold."""
    import scipy.sparse as sp

    vocab: dict[str, int] = {}
    rows, cols = [], []
    for i, t in enumerate(texts):
        for s in shingles(t):
            rows.append(i)
            cols.append(vocab.setdefault(s, len(vocab)))
    n = len(texts)
    x = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(n, max(len(vocab), 1)))
    sizes = np.asarray(x.sum(axis=1)).ravel()
    inter = (x @ x.T).tocoo()
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, j, v in zip(inter.row, inter.col, inter.data):
        if i < j and v / (sizes[i] + sizes[j] - v) >= threshold:
            ri, rj = find(int(i)), find(int(j))
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
    return [find(i) for i in range(n)]


def _rank(key: str, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()


# ----------------------------------------------------------------------------- build
@dataclass
class Sample:
    text: str
    label: str
    source: str
    package: str


def build(
    packages_text: str,
    translations_text: str,
    *,
    sections: tuple[str, ...] = SECTIONS,
    max_per_class: int = 500,
    test_fraction: float = 0.2,
    dup_threshold: float = 0.3,
    min_words: int = 12,
    mask_names: bool = True,
    mask_section_words: bool = True,
    salt: str = "debian-sections-v1",
) -> tuple[list[Sample], list[Sample], dict]:
    """(train, test, stats) from the raw Packages and Translation-en texts."""
    long_by_md5: dict[str, str] = {}
    for r in parse_deb822(translations_text):
        if "Description-md5" in r and "Description-en" in r:
            long_by_md5[r["Description-md5"]] = r["Description-en"]

    stats: dict = {"binaries": Counter(), "excluded_name": Counter(), "excluded_meta": Counter(),
                   "no_long_description": Counter()}
    by_source: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    seen: set[str] = set()
    for r in parse_deb822(packages_text):
        sec = r.get("Section", "").split("/")[-1]
        if sec not in sections or r["Package"] in seen:
            continue
        seen.add(r["Package"])
        stats["binaries"][sec] += 1
        name = r["Package"]
        if name.endswith(EXCLUDED_SUFFIXES):
            stats["excluded_name"][sec] += 1
            continue
        body = long_by_md5.get(r.get("Description-md5", ""), r.get("Description", ""))
        if _EXCLUDED_DESC.search(body):
            stats["excluded_meta"][sec] += 1
            continue
        if not long_description(body):
            stats["no_long_description"][sec] += 1
            continue
        r["_desc"] = body
        src = r.get("Source", name).split()[0]
        by_source[(sec, src)].append(r)

    cand: list[Sample] = []
    too_short: Counter = Counter()
    for (sec, src), recs in sorted(by_source.items()):
        rec = min(recs, key=lambda r: (r["Package"] != src, len(r["Package"]), r["Package"]))
        short = rec["_desc"].split("\n")[0]
        body = long_description(rec["_desc"])
        text = make_text(short, body, [rec["Package"], src], mask_names=mask_names,
                         mask_section_words=mask_section_words)
        if len(_WORD.findall(text.lower())) < min_words:
            too_short[sec] += 1
            continue
        cand.append(Sample(text=text, label=sec, source=src, package=rec["Package"]))
    stats["sources"] = Counter(s.label for s in cand)
    stats["too_short"] = too_short

    cluster = near_duplicate_clusters([s.text for s in cand], dup_threshold)
    keep: dict[int, int] = {}
    for i, c in enumerate(cluster):  # cand is sorted by (section, source): keep the smallest source
        if c not in keep or cand[i].source < cand[keep[c]].source:
            keep[c] = i
    kept = [cand[i] for i in sorted(keep.values())]
    stats["near_duplicates_removed"] = Counter(s.label for s in cand) - Counter(s.label for s in kept)

    train: list[Sample] = []
    test: list[Sample] = []
    stats["over_cap"] = Counter()
    for sec in sections:
        group = sorted((s for s in kept if s.label == sec), key=lambda s: _rank(s.source, salt))
        stats["over_cap"][sec] = max(0, len(group) - max_per_class)
        group = group[:max_per_class]
        n_test = int(round(test_fraction * len(group)))
        test += group[:n_test]
        train += group[n_test:]
    train.sort(key=lambda s: (s.label, s.source))
    test.sort(key=lambda s: (s.label, s.source))
    stats["train"] = Counter(s.label for s in train)
    stats["test"] = Counter(s.label for s in test)
    # Closest train description for every test one (word-5-gram Jaccard): reported, and checked.
    stats["max_test_train_jaccard"] = _max_cross_jaccard([s.text for s in test], [s.text for s in train])
    return train, test, stats


def _max_cross_jaccard(a: list[str], b: list[str]) -> float:
    sa = [shingles(t) for t in a]
    sb = [shingles(t) for t in b]
    index: dict[str, list[int]] = defaultdict(list)
    for j, s in enumerate(sb):
        for g in s:
            index[g].append(j)
    best = 0.0
    for s in sa:
        inter: Counter = Counter()
        for g in s:
            inter.update(index.get(g, ()))
        for j, v in inter.items():
            best = max(best, v / (len(s) + len(sb[j]) - v))
    return best


# ----------------------------------------------------------------------------- sanity baselines
def tfidf_baseline(train: list[Sample], test: list[Sample]) -> tuple[float, float] | None:
    """(accuracy, macro-F1) of TF-IDF (word 1-2-grams) + logistic regression; None without sklearn.

    A learnability check for the README, not a model fedlora uses.
    """
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import accuracy_score, f1_score
    except ImportError:
        return None
    vec = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), min_df=2)
    x_tr = vec.fit_transform([s.text for s in train])
    clf = LogisticRegression(max_iter=2000, C=10.0).fit(x_tr, [s.label for s in train])
    pred = clf.predict(vec.transform([s.text for s in test]))
    y = [s.label for s in test]
    return float(accuracy_score(y, pred)), float(f1_score(y, pred, average="macro"))


def keyword_rule_accuracy(test: list[Sample]) -> float:
    """Accuracy of "predict the section whose name occurs most often" (ties / none → first section)."""
    pats = {sec: re.compile(r"\b(?:" + pat + r")\b", re.IGNORECASE) for sec, pat in LEAK_WORDS.items()}
    hits = 0
    for s in test:
        counts = {sec: len(p.findall(s.text)) for sec, p in pats.items()}
        hits += max(counts, key=counts.get) == s.label  # max keeps the first on ties
    return hits / len(test)


# ----------------------------------------------------------------------------- output
def write_jsonl(samples: list[Sample], path: Path, compress: bool) -> Path:
    lines = "".join(
        json.dumps({"text": s.text, "label": s.label, "source": s.source, "package": s.package},
                   ensure_ascii=False) + "\n"
        for s in samples
    ).encode("utf-8")
    if compress:
        path = path.with_name(path.name + ".gz")
        with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as g:
            g.write(lines)  # mtime=0, no name: byte-identical output for identical input
    else:
        path.write_bytes(lines)
    return path


def _fmt_baseline(b: tuple[float, float] | None) -> str:
    return "not run (scikit-learn missing)" if b is None else f"accuracy {b[0]:.1%}, macro-F1 {b[1]:.3f}"


def write_readme(out: Path, stats: dict, release: dict[str, str], args: argparse.Namespace,
                 files: list[Path], date: str, checks: dict) -> None:
    secs = list(SECTIONS)

    def row(name: str, c: Counter) -> str:
        return f"| {name} | " + " | ".join(str(c.get(s, 0)) for s in secs) + f" | {sum(c.values())} |"

    n_tr, n_te = sum(stats["train"].values()), sum(stats["test"].values())
    words = checks["mean_words"]
    lines = [
        "# debian-sections",
        "",
        "A small English text-classification set built offline for fedlora's tests and demos: the",
        "description of a Debian package, labelled with the archive **Section** its maintainers",
        f"assigned. Four classes with distinct topics: {', '.join(secs)}. {n_tr} train / {n_te} test",
        f"samples, {words:.0f} words per text on average; fields `text`, `label` (section name), `source`",
        "(Debian source package; no source package is in both splits) and `package` (the binary package",
        "whose description was used).",
        "",
        "Registered as the task `debian-sections` in `fedlora.llm.tasks` (accuracy, macro-F1); loads without",
        "network. Why these four sections: each has a distinct topic (play, audio, images, e-mail) and",
        "enough distinct source packages after de-duplication (mail, the smallest, has "
        f"{stats['train']['mail'] + stats['test']['mail']}); sections whose topics overlap (video and",
        "sound, science and math, net and mail) were left out on purpose.",
        "",
        "## Provenance and license",
        "",
        f"Debian {release.get('Version', '?')} \"{release.get('Codename', 'bookworm')}\" main, amd64 "
        f"(`Packages` + `Translation-en` lists; InRelease date {release.get('Date', '?')}), fetched by apt",
        "from deb.debian.org. The texts are Debian package descriptions: part of the Debian archive",
        "metadata, written by the packages' maintainers and upstream authors and distributed with the",
        "archive (Debian main is DFSG-free software). They are used here as a small research/test",
        "corpus; see https://www.debian.org/legal/ for the archive's terms.",
        "",
        "## How it was built",
        "",
        f"Built on {date} with",
        "",
        "```",
        "mkdir -p /tmp/dsec/lists/partial /tmp/dsec/cache/archives/partial",
        "echo 'deb http://deb.debian.org/debian bookworm main' > /tmp/dsec/sources.list",
        "apt-get update -o Dir::State::Lists=/tmp/dsec/lists -o Dir::Cache=/tmp/dsec/cache \\",
        "    -o Dir::Etc::SourceList=/tmp/dsec/sources.list -o Dir::Etc::SourceParts=/nonexistent \\",
        "    -o Acquire::Languages=en",
        "python -m fedlora.llm.datasets.build_debian_sections --lists-dir /tmp/dsec/lists --out llm/datasets/debian_sections",
        "```",
        "",
        "(the private lists folder leaves the system's apt state alone; a later bookworm point release may",
        "change a few descriptions). Steps, in `build_debian_sections.py`:",
        "",
        "1. binary packages of the four sections; `-dbg/-dbgsym/-doc/-dev/-data/-common/-l10n/-i18n`",
        "   binaries and transitional / dummy / metapackages dropped;",
        "2. one binary per source package (the one named like the source, else the shortest name);",
        "3. text = short description + long description, Debian's \" .\" paragraph markers removed,",
        "   whitespace normalised;",
        "4. **label leaks removed**: the package's and source's own names, and the section word itself",
        "   (`game`/`games`, `sound`/`sounds`, `graphic`/`graphics`/`graphical`,",
        "   `mail`/`mails`/`e-mail`/`email`; case-insensitive whole words, deleted, which leaves some",
        "   sentences without a noun). Other topical words (audio, image, player, SMTP, IMAP, ...) stay;",
        f"5. near-duplicates removed: descriptions whose word-5-gram Jaccard similarity is ≥ {args.dup_threshold}",
        "   are clustered and one per cluster is kept (forks and sibling packages of different sources",
        f"   often share a description); texts under {args.min_words} words dropped;",
        f"6. at most {args.max_per_class} per class (keyed SHA-256 of the source name), then a",
        f"   stratified {1 - args.test_fraction:.0%}/{args.test_fraction:.0%} train/test split by source package.",
        "",
        "## Counts",
        "",
        "| step | " + " | ".join(secs) + " | total |",
        "|---|" + "---|" * (len(secs) + 1),
        row("binary packages in the section", stats["binaries"]),
        row("dropped: -dbg/-doc/-dev/-data/... binaries", stats["excluded_name"]),
        row("dropped: transitional/dummy/meta", stats["excluded_meta"]),
        row("source packages", stats["sources"] + stats["too_short"]),
        row("dropped: under min words", stats["too_short"]),
        row("dropped: near-duplicate", stats["near_duplicates_removed"]),
        row("dropped: over the per-class cap", stats["over_cap"]),
        row("**train**", stats["train"]),
        row("**test**", stats["test"]),
        "",
        "Largest word-5-gram Jaccard similarity between a test text and any train text: "
        f"{stats['max_test_train_jaccard']:.3f}.",
        "",
        "## Is it learnable, and not trivial? (measured by the build)",
        "",
        "TF-IDF (word 1-2-grams, sublinear tf, min_df 2) + logistic regression (C = 10), trained on",
        "train, scored on test:",
        "",
        f"- this set: {_fmt_baseline(checks['baseline'])};",
        f"- the same build with the section words kept (`--keep-section-words`): {_fmt_baseline(checks['baseline_unmasked'])};",
        f"- majority class: accuracy {checks['majority']:.1%};",
        f"- keyword rule (\"the section whose name occurs most\") on the unmasked texts: "
        f"{checks['keyword_unmasked']:.1%}; on this set: {checks['keyword']:.1%}.",
        "",
        "Files: " + ", ".join(f"`{p.name}` ({p.stat().st_size / 1e3:.0f} kB)" for p in files) + ".",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _release_info(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    info: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key in ("Version", "Codename", "Date", "Suite") and key not in info:
            info[key] = value.strip()
        if line.startswith(("MD5Sum:", "SHA256:")):
            break
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedlora.llm.datasets.build_debian_sections",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (train/test jsonl + README.md)")
    ap.add_argument("--lists-dir", type=Path, default=Path("/var/lib/apt/lists"))
    ap.add_argument("--suite", default="bookworm")
    ap.add_argument("--arch", default="amd64")
    ap.add_argument("--packages", type=Path, help="a Packages file (instead of --lists-dir)")
    ap.add_argument("--translations", type=Path, help="a Translation-en file (instead of --lists-dir)")
    ap.add_argument("--max-per-class", type=int, default=500)
    ap.add_argument("--test-fraction", type=float, default=0.2)
    ap.add_argument("--dup-threshold", type=float, default=0.3)
    ap.add_argument("--min-words", type=int, default=12)
    ap.add_argument("--keep-names", action="store_true", help="keep the packages' own names in the text")
    ap.add_argument("--keep-section-words", action="store_true", help="keep the section words in the text")
    ap.add_argument("--gzip-above", type=float, default=1.5e6, help="gzip the jsonl files when they total more bytes")
    ap.add_argument("--date", default=_dt.date.today().isoformat(), help="build date written to the README")
    args = ap.parse_args(argv)
    opts = dict(max_per_class=args.max_per_class, test_fraction=args.test_fraction,
                dup_threshold=args.dup_threshold, min_words=args.min_words, mask_names=not args.keep_names)
    try:
        release_path = None
        if args.packages or args.translations:
            if not (args.packages and args.translations):
                raise BuildError("--packages and --translations go together")
            pk, tr = args.packages, args.translations
        else:
            pk, tr, release_path = find_lists(args.lists_dir, args.suite, args.arch)
        packages_text, translations_text = read_text(pk), read_text(tr)
        train, test, stats = build(packages_text, translations_text,
                                   mask_section_words=not args.keep_section_words, **opts)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"build_debian_sections: {e}", file=sys.stderr)
        return 2
    if not train or not test:
        print("build_debian_sections: no samples; are these the bookworm main lists?", file=sys.stderr)
        return 2
    if stats["max_test_train_jaccard"] >= args.dup_threshold:
        print(f"build_debian_sections: a test text is a near-copy of a train text "
              f"(Jaccard {stats['max_test_train_jaccard']:.3f})", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in ("train.jsonl", "test.jsonl", "train.jsonl.gz", "test.jsonl.gz"):
        (out / old).unlink(missing_ok=True)
    raw = sum(len(json.dumps({"text": s.text, "label": s.label, "source": s.source,
                              "package": s.package}).encode()) + 1 for s in train + test)
    compress = raw > args.gzip_above
    files = [write_jsonl(train, out / "train.jsonl", compress), write_jsonl(test, out / "test.jsonl", compress)]

    tr_u, te_u, _ = build(packages_text, translations_text, mask_section_words=False, **opts)
    labels = [s.label for s in test]
    checks = {
        "baseline": tfidf_baseline(train, test),
        "baseline_unmasked": tfidf_baseline(tr_u, te_u),
        "majority": max(Counter(labels).values()) / len(labels),
        "keyword": keyword_rule_accuracy(test),
        "keyword_unmasked": keyword_rule_accuracy(te_u),
        "mean_words": float(np.mean([len(s.text.split()) for s in train + test])),
    }
    write_readme(out, stats, _release_info(release_path), args, files, args.date, checks)
    print(f"wrote {', '.join(str(f) for f in files)}: train {dict(stats['train'])}, test {dict(stats['test'])}; "
          f"max test-train Jaccard {stats['max_test_train_jaccard']:.3f}; "
          f"TF-IDF+LR baseline {_fmt_baseline(checks['baseline'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writes the example files of examples/ from the bundled sets (README.md here says what each is):

    .venv/bin/python examples/build_examples.py
"""
import collections
import csv
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "llm" / "datasets"
OUT = Path(__file__).resolve().parent


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def packages_csv() -> None:
    """Classification: the first 50 rows of each label of debian-sections' training set."""
    taken: collections.Counter = collections.Counter()
    with open(OUT / "packages.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["package", "description", "section"])
        for r in _jsonl(DATA / "debian_sections" / "train.jsonl"):
            if taken[r["label"]] < 50:
                taken[r["label"]] += 1
                w.writerow([r["package"], r["text"], r["label"]])


def describe_csv() -> None:
    """Generation: the first 200 rows of debian-describe's training set, record → short description."""
    with open(OUT / "describe.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["record", "description"])
        for r in _jsonl(DATA / "debian_describe" / "train.jsonl")[:200]:
            w.writerow([r["record"], r["description"]])


def packages_qa_jsonl() -> None:
    """Extractive QA in SQuAD's format: three questions on each of the first 100 records of debian-describe's
    training set (its section, its dependencies, its architecture), each answer a span of the record; the
    title (the topic partitions sort by) is the package's section."""
    asks = (("section", "Which section is {} in?"), ("depends", "What does {} depend on?"),
            ("architecture", "Which architecture is {} built for?"))
    lines = []
    for r in _jsonl(DATA / "debian_describe" / "train.jsonl")[:100]:
        ctx = r["record"]
        fields = dict(kv.split(" : ", 1) for kv in ctx.split(" | "))
        for i, (key, question) in enumerate(asks):
            if key not in fields:
                continue
            start = ctx.index(f"{key} : {fields[key]}") + len(key) + 3
            assert ctx[start:start + len(fields[key])] == fields[key]
            lines.append(json.dumps({"id": f"{fields['package']}-{i}", "title": fields["section"], "context": ctx,
                                     "question": question.format(fields["package"]),
                                     "answers": {"text": [fields[key]], "answer_start": [start]}}))
    (OUT / "packages-qa.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    packages_csv()
    describe_csv()
    packages_qa_jsonl()
    print(f"wrote {OUT}/packages.csv, describe.csv, packages-qa.jsonl")

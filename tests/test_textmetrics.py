"""Text metrics (issue 15 item 3): the library-backed ones equal the libraries' published values, the
hand-written ones (CIDEr-D, SQuAD EM/F1) hold on hand-computed cases."""
from __future__ import annotations

import math

import pytest

from fedlora.errors import ConfigError
from fedlora.llm import textmetrics as T

# sacrebleu's README example (mjpost/sacrebleu, "Using SacreBLEU from Python"): two reference streams
README_SYS = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
README_REFS = [["The dog bit the man.", "The dog had bit the man."],
               ["It was not unexpected.", "No one was surprised."],
               ["The man bit him first.", "The man had bitten the dog."]]


def test_bleu_and_chrf_equal_sacrebleus_published_values():
    """README: ``BLEU = 48.53 82.4/50.0/45.5/37.5 (BP = 0.943 …)`` and ``chrF2 = 59.73``; ours are per item
    reference lists, on the papers' [0, 1] scale."""
    assert round(T.bleu(README_SYS, README_REFS) * 100, 2) == 48.53
    assert round(T.chrf(README_SYS, README_REFS) * 100, 2) == 59.73


@pytest.mark.parametrize("hyp, ref, want", [("aaaa bbbb cccc dddd", "aaaa bbbb cccc dddd", 0.0),
                                            ("dddd eeee ffff", "aaaa bbbb cccc", 1.0),
                                            ("d e f g h a b c", "a b c d e f g h", 1 / 8)])
def test_ter_equals_sacrebleus_test_cases(hyp, ref, want):
    """sacrebleu's test/test_ter.py: a perfect match, no overlap, one shift of 8 words."""
    assert T.ter([hyp], [[ref]]) == pytest.approx(want, abs=1e-3)


def test_items_with_fewer_references_score_as_with_their_own_only():
    """An item with one reference beside items with two scores as if it had only its own (a repeated reference
    changes no clipped count, so BLEU equals sacrebleu's with the item's reference repeated) — and differs from
    giving it the other item's reference."""
    import sacrebleu

    hyps = ["the cat sat on the mat", "a dog ran far away"]
    refs = [["the cat sat on a mat", "a cat sat on the mat"], ["a dog ran away"]]
    want = sacrebleu.corpus_bleu(hyps, [["the cat sat on a mat", "a dog ran away"],
                                        ["a cat sat on the mat", "a dog ran away"]]).score / 100
    assert T.bleu(hyps, refs) == pytest.approx(want, abs=1e-12)


def test_ter_of_items_with_different_numbers_of_references():
    """Corpus TER is Σ edits / Σ (mean reference length) over items, each item over its OWN references: from
    sacrebleu's TER of every item alone. Padding an item's references by repeating one would change its mean
    length (27.27 here instead of 29.27)."""
    import sacrebleu

    hyps = ["a dog", "x y z"]
    refs = [["a dog barks", "a big brown dog barks loudly"], ["x y z w", "x y", "x"]]
    lens = [sum(len(r.split()) for r in rs) / len(rs) for rs in refs]
    edits = [sacrebleu.corpus_ter([h], [[r] for r in rs]).score / 100 * n for h, rs, n in zip(hyps, refs, lens)]
    assert T.ter(hyps, refs) == pytest.approx(sum(edits) / sum(lens), abs=1e-12)
    assert T.ter(hyps, refs) == pytest.approx(2 / (4.5 + 7 / 3), abs=1e-12)


def test_rouge_l_is_the_best_reference_mean_of_rouge_score():
    from rouge_score import rouge_scorer

    sc = rouge_scorer.RougeScorer(["rougeL"])
    hyps = ["the quick brown fox", "hello there world"]
    refs = [["a quick brown dog", "the quick brown fox jumps"], ["hello world"]]
    per = [max(sc.score(r, h)["rougeL"].fmeasure for r in rs) for h, rs in zip(hyps, refs)]
    assert T.rouge_l(hyps, refs) == pytest.approx(sum(per) / 2, abs=1e-12)
    assert per[0] == pytest.approx(2 * 1.0 * 0.8 / 1.8)  # the second reference: LCS 4 of 4 and of 5 words


def test_nist_is_nltks_corpus_nist_with_n_5():
    from nltk.translate.nist_score import corpus_nist

    hyps = ["the cat sat on the mat today", "there is a dog in the garden"]
    refs = [["the cat sat on the mat", "a cat was on the mat today"], ["a dog is in the garden"]]
    want = corpus_nist([[r.split() for r in rs] for rs in refs], [h.split() for h in hyps], n=5)
    assert T.nist(hyps, refs) == pytest.approx(want, abs=1e-12)


def test_nist_of_short_or_empty_outputs():
    """Hypotheses of at most 2 words: orders 3–5 have no system n-grams and add nothing (nltk's n = 2); all
    empty: 0 (nltk itself divides by zero there)."""
    from nltk.translate.nist_score import corpus_nist

    refs = [["the cat sat on the mat"], ["a dog ran"]]
    assert T.nist(["the cat", "dog"], refs) == pytest.approx(
        corpus_nist([[r.split() for r in rs] for rs in refs], [["the", "cat"], ["dog"]], n=2), abs=1e-12)
    assert T.nist(["", ""], refs) == 0.0


def test_meteor_is_reported_not_computed_without_wordnet_and_the_others_still_are():
    scores, why = T.generation_metrics(README_SYS, README_REFS)
    reason = T.meteor_unavailable()
    if reason is None:  # WordNet installed: computed like the rest
        assert "meteor" in scores and not why
    else:
        assert why == {"meteor": reason} and "WordNet" in reason and "meteor" not in scores
    assert set(scores) >= {"bleu", "chrf", "ter", "rouge_l", "nist", "cider"}


def test_cider_hand_computed():
    """Two items, one reference each, each hypothesis equal to its reference and sharing no n-gram with the
    other item: every n-gram has df = 1, idf = log 2, the cosine is 1 for n = 1..4 and the length penalty 1 —
    CIDEr-D = 10 × mean over n of 1 = 10. A hypothesis sharing no n-gram with its reference scores 0; an
    n-gram in every item's references has idf 0 and counts nothing."""
    refs = [["red apple pie here"], ["blue sky over town"]]
    assert T.cider(["red apple pie here", "blue sky over town"], refs) == pytest.approx(10.0)
    assert T.cider(["green grass", "blue sky over town"], refs) == pytest.approx(5.0)  # item 0 scores 0
    # "the" in both references: idf 0; unigram vectors of item 0: hyp {the: 0, cat: log 2} vs ref {the: 0,
    # cat: log 2, sat: log 2}: cosine 1/√2; no bigram of the hyp in its ref
    s = T.cider(["the cat", "the dog"], [["the cat sat"], ["the dog ran"]])
    # per item: n=1 cosine (log2)²/(log2·√2·log2) = 1/√2; n=2 "the cat" in ref: hyp {(the,cat): log2},
    # ref {(the,cat): log2, (cat,sat): log2}: 1/√2; n=3,4: the hyp has none (norm 0: 0). Lengths (bigram
    # counts) 1 vs 2: penalty exp(−1/72).
    want = 10 * (2 / math.sqrt(2)) / 4 * math.exp(-1 / 72)
    assert s == pytest.approx(want, rel=1e-12)


def test_cider_d_clips_a_repeated_n_gram_at_its_reference_count():
    """CIDEr-D's clipping (coco-caption's ``min(vec_hyp, vec_ref) · vec_ref``): "cat cat cat" against "cat sat"
    counts "cat" once, not three times. Every n-gram has df 1 of 2 items, idf log 2 (written l):
    item 0, n=1: hyp {cat: 3l}, ref {cat: l, sat: l}: min(3l, l)·l / (3l · √2 l) = 1/(3√2) (unclipped: 1/√2);
    n=2: (cat, cat) not in the ref: 0; lengths (bigram counts) 2 vs 1: penalty exp(−1/72).
    item 1, "dog" vs "dog ran": n=1 cosine 1/√2, no bigram; lengths 0 vs 1: exp(−1/72)."""
    s = T.cider(["cat cat cat", "dog"], [["cat sat"], ["dog ran"]])
    item0 = 10 * (1 / (3 * math.sqrt(2))) / 4 * math.exp(-1 / 72)
    item1 = 10 * (1 / math.sqrt(2)) / 4 * math.exp(-1 / 72)
    assert s == pytest.approx((item0 + item1) / 2, rel=1e-12)
    unclipped = (10 * (1 / math.sqrt(2)) / 4 * math.exp(-1 / 72) + item1) / 2
    assert abs(s - unclipped) > 0.1  # the case tells clipped from unclipped


def test_squad_normalisation_and_scores_hand_made():
    assert T.squad_normalize("The  Eiffel-Tower!") == "eiffeltower"
    assert T.squad_normalize("an apple, a pear") == "apple pear"
    golds = [["the Eiffel Tower", "Eiffel Tower in Paris"], ["1889"], ["red fox"], []]
    preds = ["Eiffel Tower.", "in 1889", "fox", ""]
    m = T.squad_metrics(preds, golds)
    # EM: 1 (articles/punct), 0, 0, 1 (no answer, empty prediction) → 50; F1: 1, 2·(1/2·1)/(1.5)=2/3, 2/3, 1
    assert m["exact"] == pytest.approx(50.0)
    assert m["f1"] == pytest.approx(100 * (1 + 2 / 3 + 2 / 3 + 1) / 4)
    assert m["NoAns_exact"] == 100.0 and m["HasAns_exact"] == pytest.approx(100 / 3)
    assert T.squad_metrics(["something"], [[]])["exact"] == 0.0  # answering an unanswerable question
    assert "HasAns_exact" not in T.squad_metrics(["x"], [["x"]])  # v1.1: no split


def test_squad_scores_take_the_best_gold_answer_wherever_it_is_listed():
    """Per question the max over ALL its gold answers, the best one not first: "tower" matches the second gold
    exactly (EM 1; the first, "eiffel", scores 0); "big red tower" scores F1 against "tower" 2·(1/3·1)/(4/3) = 1/2,
    against "big red house" 2/3 (p = r = 2/3) and against "a tower" 1/2 — the best is the middle one."""
    m = T.squad_metrics(["tower", "big red tower"], [["eiffel", "the tower", "big tower"],
                                                     ["tower", "big red house", "a tower"]])
    assert m["exact"] == pytest.approx(50.0)  # question 1: no gold equals it
    assert m["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)


@pytest.mark.parametrize("call, match", [
    (lambda: T.bleu(["a"], []), "1 hypotheses but 0 reference lists"),
    (lambda: T.bleu(["a"], [[]]), "item 0 has no reference"),
    (lambda: T.generation_metrics(["a"], [["a"]], ["bleu", "bertscore"]), r"unknown metric\(s\) 'bertscore';"),
    (lambda: T.squad_metrics(["a", "b"], [["a"]]), "2 predictions but 1 gold answer lists")])
def test_bad_input_is_one_line(call, match):
    with pytest.raises(ConfigError, match=match):
        call()

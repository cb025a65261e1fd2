"""Text-generation and extractive-QA metrics, pure functions of strings.

Scales follow the papers' tables (PF2LoRA Tables 3, 14, 15 report E2E's official script's numbers):
BLEU, chrF, TER, METEOR and ROUGE-L in [0, 1]; NIST and CIDEr on their own scales; SQuAD EM/F1 in [0, 100]
(the official script's).

=========  ==============================================================  ==========================
metric     implementation                                                  checked by
=========  ==============================================================  ==========================
bleu       sacrebleu ``corpus_bleu`` (13a tokens, several references) /100  sacrebleu's own test values
chrf       sacrebleu ``corpus_chrf`` /100                                  sacrebleu's own test values
ter        sacrebleu ``corpus_ter`` /100 (lower is better)                 sacrebleu's own test values
rouge_l    Google's rouge-score ``rougeL`` F1, best reference per item,     rouge-score itself
           mean over items (as E2E's script: the best reference)
nist       nltk ``corpus_nist`` (n = 5, E2E's setting), whitespace tokens   nltk itself
meteor     nltk ``meteor_score`` (needs WordNet, a download: where it is    nltk itself
           not installed, reported as not computed with the reason)
cider      hand-written: coco-caption's CIDEr-D as E2E's script runs it     hand-computed cases
           (n ≤ 4, σ = 6, ×10, idf over the corpus' references), on
           lowercased whitespace tokens (the script's PTB tokenizer is Java)
exact, f1  hand-written: SQuAD v1.1/v2.0's official normalisation and       hand-made cases
           scoring (max over gold answers; v2.0: an unanswerable question
           is right only with the empty answer)
=========  ==============================================================  ==========================
"""
from __future__ import annotations

import collections
import math
import re
import string
from typing import Iterable, Sequence

from fedlora.errors import ConfigError, quoted

__all__ = ["GENERATION_METRICS", "generation_metrics", "bleu", "chrf", "ter", "rouge_l", "nist", "meteor", "cider",
           "squad_normalize", "squad_exact", "squad_f1", "squad_metrics"]

GENERATION_METRICS = ("bleu", "chrf", "ter", "rouge_l", "nist", "meteor", "cider")


def _check(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> list[list[str]]:
    if len(hyps) != len(refs):
        raise ConfigError(f"text metrics: {len(hyps)} hypotheses but {len(refs)} reference lists")
    out = []
    for i, r in enumerate(refs):
        r = [r] if isinstance(r, str) else list(r)
        if not r:
            raise ConfigError(f"text metrics: item {i} has no reference")
        out.append(r)
    return out


def _ref_streams(refs: list[list[str]]) -> list[list[str | None]]:
    """sacrebleu's layout: one stream per reference position; an item with fewer references has None in the
    streams past its last (sacrebleu's way to give items different numbers of references). Repeating a
    reference instead would leave BLEU and chrF unchanged but not TER, whose length is the references' mean."""
    m = max(len(r) for r in refs)
    return [[r[j] if j < len(r) else None for r in refs] for j in range(m)]


def bleu(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (Papineni et al., ACL 2002) by sacrebleu, in [0, 1]."""
    import sacrebleu

    return sacrebleu.corpus_bleu(list(hyps), _ref_streams(_check(hyps, refs))).score / 100.0


def chrf(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Corpus chrF (Popović, WMT 2015) by sacrebleu, in [0, 1]."""
    import sacrebleu

    return sacrebleu.corpus_chrf(list(hyps), _ref_streams(_check(hyps, refs))).score / 100.0


def ter(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Corpus TER (Snover et al., AMTA 2006) by sacrebleu, as a fraction (lower is better)."""
    import sacrebleu

    return sacrebleu.corpus_ter(list(hyps), _ref_streams(_check(hyps, refs))).score / 100.0


def rouge_l(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """ROUGE-L F1 (Lin, 2004) by rouge-score: per item the best over its references, mean over items."""
    from rouge_score import rouge_scorer

    refs = _check(hyps, refs)
    sc = rouge_scorer.RougeScorer(["rougeL"])
    if not hyps:
        return 0.0
    return sum(max(sc.score(r, h)["rougeL"].fmeasure for r in rs) for h, rs in zip(hyps, refs)) / len(hyps)


def nist(hyps: Sequence[str], refs: Sequence[Sequence[str]], n: int = 5) -> float:
    """Corpus NIST (Doddington, HLT 2002) by nltk, n-grams up to ``n`` (5 in E2E's script); orders longer
    than the longest hypothesis contribute nothing (as in mteval), 0 when every hypothesis is empty."""
    from nltk.translate.nist_score import corpus_nist

    refs = _check(hyps, refs)
    words = [h.split() for h in hyps]
    # nltk divides by the hypotheses' count of k-grams for every k ≤ n; where there are none (short outputs,
    # an untrained model) that k adds nothing to the sum — as mteval's NIST skips an n-gram order with no
    # system n-grams — so the score is nltk's up to the longest order present (0 for empty outputs)
    n = min(n, max((len(w) for w in words), default=0))
    if n == 0:
        return 0.0
    return float(corpus_nist([[r.split() for r in rs] for rs in refs], words, n=n))


def meteor_unavailable() -> str | None:
    """Why METEOR cannot be computed here (nltk's needs the WordNet corpus, a download), or None."""
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except LookupError:
        return "needs nltk's WordNet corpus, which is not installed (python -m nltk.downloader wordnet)"
    except Exception as e:  # pragma: no cover - a broken nltk data folder
        return f"nltk's WordNet cannot be read: {str(e).splitlines()[0][:120]}"
    return None


def meteor(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean METEOR (Banerjee & Lavie, 2005) by nltk over items, several references each."""
    from nltk.translate.meteor_score import meteor_score

    why = meteor_unavailable()
    if why:
        raise ConfigError(f"meteor {why}")
    refs = _check(hyps, refs)
    if not hyps:
        return 0.0
    return sum(meteor_score([r.split() for r in rs], h.split()) for h, rs in zip(hyps, refs)) / len(hyps)


def _ngrams(words: list[str], n: int) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            c[tuple(words[i:i + k])] += 1
    return c


#: a CIDEr-D below this is reported as 0: only the length penalty of a far too long hypothesis gets there
CIDER_FLOOR = 1e-9


def cider(hyps: Sequence[str], refs: Sequence[Sequence[str]], n: int = 4, sigma: float = 6.0) -> float:
    """CIDEr-D (Vedantam et al., CVPR 2015) as coco-caption's ``Cider`` scorer computes it, the one E2E's
    official script calls: tf-idf vectors of 1..n-grams with document frequencies over the items' reference
    sets (idf = log(#items) − log(max(1, df))), per n the clipped cosine (min(hyp, ref) · ref / ‖hyp‖‖ref‖)
    times exp(−δ²/2σ²) of the length difference, mean over n, mean over references, × 10, mean over items.
    The length is coco-caption's: its count of bigrams (a quirk of the reference code, kept). A score below
    ``CIDER_FLOOR`` (1e-9: a hypothesis far longer than its references) is 0."""
    refs = _check(hyps, refs)
    if not hyps:
        return 0.0
    tok = lambda s: s.lower().split()  # noqa: E731
    crefs = [[_ngrams(tok(r), n) for r in rs] for rs in refs]
    ctest = [_ngrams(tok(h), n) for h in hyps]
    df: collections.Counter = collections.Counter()
    for rs in crefs:
        for g in set(g for r in rs for g in r):
            df[g] += 1
    log_n = math.log(float(len(crefs)))

    def vec(cnts):
        v = [dict() for _ in range(n)]
        norm = [0.0] * n
        length = 0
        for g, tf in cnts.items():
            k = len(g) - 1
            v[k][g] = float(tf) * (log_n - math.log(max(1.0, df[g])))
            norm[k] += v[k][g] ** 2
            if k == 1:
                length += tf
        return v, [math.sqrt(x) for x in norm], length

    total = 0.0
    for t, rs in zip(ctest, crefs):
        vh, nh, lh = vec(t)
        score = [0.0] * n
        for r in rs:
            vr, nr, lr = vec(r)
            for k in range(n):
                val = sum(min(x, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, x in vh[k].items())
                if nh[k] != 0 and nr[k] != 0:
                    val /= nh[k] * nr[k]
                score[k] += val * math.exp(-((lh - lr) ** 2) / (2 * sigma ** 2))
        total += sum(score) / n / len(rs) * 10.0
    # a hypothesis that shares n-grams with its references but is far longer (a degenerate repetition) keeps
    # exp(−δ²/2σ²) ≈ 1e-20 of them: a zero at any precision a table prints, stored as 0 (not 1e-18)
    return total / len(hyps) if total / len(hyps) >= CIDER_FLOOR else 0.0


_GENERATION = {"bleu": bleu, "chrf": chrf, "ter": ter, "rouge_l": rouge_l, "nist": nist, "meteor": meteor,
               "cider": cider}


def generation_metrics(hyps: Sequence[str], refs: Sequence[Sequence[str]], names: Iterable[str] | None = None
                       ) -> tuple[dict[str, float], dict[str, str]]:
    """``names`` (default ``GENERATION_METRICS``) of generated texts ``hyps`` against each item's references:
    ``(scores, not_computed)`` — a metric that needs what is not installed here (METEOR's WordNet) is left
    out of ``scores`` and named in ``not_computed`` with the reason; the others are computed."""
    names = list(GENERATION_METRICS if names is None else names)
    unknown = [m for m in names if m not in _GENERATION]
    if unknown:
        raise ConfigError(f"text metrics: unknown metric(s) {quoted(unknown)}; allowed: {', '.join(GENERATION_METRICS)}")
    refs = _check(hyps, refs)
    scores, why = {}, {}
    for m in names:
        if m == "meteor" and meteor_unavailable():
            why[m] = meteor_unavailable()
            continue
        scores[m] = float(_GENERATION[m](hyps, refs))
    return scores, why


# ------------------------------------------------------------------------------------------ SQuAD
def squad_normalize(s: str) -> str:
    """The official SQuAD v1.1/v2.0 answer normalisation: lower case, punctuation removed, the articles
    a/an/the removed, whitespace collapsed."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def squad_exact(pred: str, gold: str) -> float:
    return float(squad_normalize(pred) == squad_normalize(gold))


def squad_f1(pred: str, gold: str) -> float:
    """Token F1 of the normalised answers (v2.0: an empty answer scores 1 against an empty one, else 0)."""
    p, g = squad_normalize(pred).split(), squad_normalize(gold).split()
    if not p or not g:
        return float(p == g)
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(preds: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """SQuAD's ``exact`` and ``f1`` in [0, 100]: per question the max over its gold answers; a question
    with no gold answer (v2.0, unanswerable) has the empty string as its one gold, so only an empty
    prediction scores. With unanswerable questions present, also ``HasAns_*`` / ``NoAns_*`` as the
    official v2.0 script reports them."""
    if len(preds) != len(golds):
        raise ConfigError(f"squad metrics: {len(preds)} predictions but {len(golds)} gold answer lists")
    ex, f1, has = [], [], []
    for p, g in zip(preds, golds):
        g = [a for a in g if squad_normalize(a)] or [""]
        has.append(g != [""])
        ex.append(max(squad_exact(p, a) for a in g))
        f1.append(max(squad_f1(p, a) for a in g))
    mean = lambda xs: 100.0 * sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    out = {"exact": mean(ex), "f1": mean(f1)}
    if not all(has):
        for tag, want in (("HasAns", True), ("NoAns", False)):
            out[f"{tag}_exact"] = mean([e for e, h in zip(ex, has) if h == want])
            out[f"{tag}_f1"] = mean([x for x, h in zip(f1, has) if h == want])
    return out

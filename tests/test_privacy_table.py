"""The docs' table of every method × {client-level DP, sample-level DP, SecAgg+} says what the code refuses
(docs/concepts/privacy.md, "Which methods"): a row per registered method, "yes" exactly where the method's
refusal is None, else the refusal's own line."""
import re
from pathlib import Path

from fedlora.methods import available_methods, get_method
from fedlora.secagg import secagg_refusal

PAGE = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "privacy.md"


def _rows():
    text = PAGE.read_text()
    start = text.index("## Which methods: client DP, sample DP, SecAgg+")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("| method") and not line.startswith("|---"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_table_has_every_method_and_says_what_the_code_refuses():
    rows = _rows()
    assert sorted(rows) == sorted(available_methods())
    for m, cells in rows.items():
        cls = get_method(m)
        for cell, why, note in zip(cells, (cls.client_dp_refusal, cls.sample_dp_refusal, secagg_refusal(m)),
                                   (None, cls.sample_dp_note, None)):
            said = "yes" + (f" ({note})" if note else "") if why is None else f"no: {why}"
            assert cell == said, (m, cell, why)

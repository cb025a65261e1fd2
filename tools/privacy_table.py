"""Rewrite the table "Which methods: client DP, sample DP, SecAgg+" of docs/concepts/privacy.md from the code's
refusals (``Method.client_dp_refusal``, ``Method.sample_dp_refusal``, ``fedlora.secagg.secagg_refusal``);
tests/test_privacy_table.py fails when the page and the code disagree.

    python tools/privacy_table.py
"""
from pathlib import Path

from fedlora.methods import available_methods, get_method
from fedlora.secagg import secagg_refusal

PAGE = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "privacy.md"
HEADER = "| method | client-level DP | sample-level DP | SecAgg+ (`privacy.secagg`, on Flower) |"


def _cell(why, note=None):
    text = "yes" + (f" ({note})" if note else "") if why is None else "no: " + why
    return text.replace("|", "\\|")


def table() -> str:
    rows = [HEADER, "|---|---|---|---|"]
    for m in available_methods():
        cls = get_method(m)
        rows.append(f"| {m} | {_cell(cls.client_dp_refusal)} | {_cell(cls.sample_dp_refusal, cls.sample_dp_note)} | "
                    f"{_cell(secagg_refusal(m))} |")
    return "\n".join(rows)


def main() -> None:
    text = PAGE.read_text()
    start = text.index(HEADER)
    end = text.index("\n\n", start)
    PAGE.write_text(text[:start] + table() + text[end:])
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()

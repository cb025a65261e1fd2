"""What a runtime tells a method goes through one declared call (``Method.use_runtime(RuntimeFacts)``); what a
runtime knows of a method is read from its class (``personalised``); the testbed keeps payloads through a
declared hook, not by replacing ``method.upload``."""
import pathlib
import re

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.methods import RuntimeFacts, available_methods, build, get_method
from fedlora.simulator import Federation, StackedExecutor
from fedlora.server import Download

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_head_mode_is_a_fact_checked_against_the_method():
    m = build("fedavg", {})
    assert m.head_mode == "shared"  # default_head until told otherwise
    m.use_runtime(RuntimeFacts(head_mode="personal"))
    assert m.head_mode == "personal"
    m.use_runtime(RuntimeFacts())  # None leaves it
    assert m.head_mode == "personal"
    with pytest.raises(ConfigError, match=r"^lora-a2: head must be one of frozen, got 'shared'$"):
        build("lora-a2", {}).use_runtime(RuntimeFacts(head_mode="shared"))
    with pytest.raises(TypeError, match="RuntimeFacts"):
        m.use_runtime({"head_mode": "shared"})


def test_h2tune_takes_the_outputs_and_the_depth_unless_its_constructor_set_them():
    def fn(params, batch):
        return batch

    def own(params, batch):
        return batch

    m = build("h2tune", {})
    m.use_runtime(RuntimeFacts(output_fn=fn, global_layers=6))
    assert m.output_fn is fn and m.global_layers == 6
    m.use_runtime(RuntimeFacts(output_fn=own))  # a runtime's may be replaced by the next runtime's
    assert m.output_fn is own
    mine = build("h2tune", {"output_fn": own})
    mine.use_runtime(RuntimeFacts(output_fn=fn))
    assert mine.output_fn is own
    with pytest.raises(ConfigError, match="global_layers"):
        m.use_runtime(RuntimeFacts(global_layers=0))


def test_flora_shares_the_base_where_the_runtime_says_so_and_others_ignore_it():
    f = build("flora", {})
    assert f.shared_base is False
    f.use_runtime(RuntimeFacts(shared_base=True))
    assert f.shared_base is True
    f.use_runtime(RuntimeFacts(shared_base=False))
    assert f.shared_base is False
    other = build("fedavg", {})
    other.use_runtime(RuntimeFacts(shared_base=True, output_fn=lambda p, b: b, global_layers=3))
    assert not {"shared_base", "output_fn", "global_layers"} & set(vars(other))


def test_personalised_is_read_from_the_class():
    personal = {n for n in available_methods() if get_method(n).personalised}
    assert personal == {"pf2lora", "fedsa", "h2tune", "perfedavg", "local", "feddpa"}
    # a method without a global model can only be evaluated on each client's own model
    assert all(get_method(n).personalised for n in available_methods() if not get_method(n).has_global_model)


def test_stacked_executor_reports_every_payload_it_moves():
    from fedlora.adapter import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(3, 2, rank=2, stack=4, dtype=torch.float64)
    fed = Federation(2, 2)
    m = build("fedavg", {"lr": 0.1, "rank": 2})
    m.setup(layer, fed.replica_clients)
    X = torch.randn(4, 5, 3, dtype=torch.float64)

    def objective(params, x):
        return (layer.forward_with(params, x) ** 2).mean(dim=(-2, -1))

    seen = []
    ex = StackedExecutor(m, fed, objective, lambda: X, 1, on_payload=lambda d, i, p: seen.append((d, i, p)))
    ups = ex.train(0, [0, 3], {})
    assert [(d, i) for d, i, _ in seen] == [("up", 0), ("up", 3)]
    assert all(seen[j][2] is ups[i].upload for j, i in enumerate((0, 3)))
    state = m.aggregate([ups[0].upload], torch.ones(1, dtype=torch.float64))
    ex.deliver(0, {1: Download(state)})
    assert [(d, i) for d, i, _ in seen[2:]] == [("down", 1)]
    assert "upload" not in vars(m) and "download" not in vars(m)


def _sources(*folders):
    for folder in folders:
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not rel.startswith("fedlora/methods/"):
                yield rel, p.read_text()


def test_no_runtime_probes_or_writes_into_a_method():
    """The testbed and the library outside ``fedlora/methods`` never test a method for an attribute, write
    into one, replace its functions or call its private ones (``llm/`` is checked once it is converted)."""
    bad = re.compile(r"\b(hasattr|getattr)\((self\.|run\.)?method\b|\bmethod\.\w+(, *[\w.]+)* *= *[^=]|"
                     r"\bmethod\._[a-z]|method-assign")
    found = [f"{path}: {m.group(0)}" for path, text in _sources("fedlora", "synthetic") for m in bad.finditer(text)]
    assert not found, found

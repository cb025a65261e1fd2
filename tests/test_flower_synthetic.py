"""The synthetic testbed on Flower (issue 14): one federation of `synthetic compare`'s testbed, 3 clients with
client sampling on, gives the embedded run's round records — participants, bytes up and down per client and
round, every client's training loss after every round — on Flower's simulation engine and on a real
loopback deployment (a SuperLink and three SuperNodes as separate processes, TLS), for FedAvg-LoRA, RoLoRA,
LoRA-A², PF2LoRA and H²Tune. Each node holds the whole federation but reports its own client: HetLoRA's
per-client ranks (uploads of different sizes) and a run of several configs sharing the same nodes show that
each node trains, keeps and reports the right client's state; every client's final state record (adapter,
optimizer moments, method state such as ranks, masks and draws) as its node keeps it equals the embedded
replica's."""
import json
import time

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")

from _flower_inprocess import OneProcessGrid, run_as_serverapp  # noqa: E402
from _flower_warm import assert_forked_per_message  # noqa: E402
from fedlora.cli import main  # noqa: E402
from fedlora import flower_deploy as fd  # noqa: E402
from fedlora.flower import simulate  # noqa: E402
from fedlora.synthetic.flower import APP, flower_spec, run_embedded, serve, serve_with_records  # noqa: E402

METHODS = ["fedavg", "rolora", "lora-a2", "pf2lora", "h2tune"]


def _spec(method, task="regression", rounds=3):
    return flower_spec(method, 0.05, task=task, clients=3, rounds=rounds, local_steps=2, sample_fraction=0.5,
                       dim=8, classes=4, n_test=40, n_train=[30, 40, 50], seed_offset=7)


def assert_same_history(emb, flw, what):
    """Integers (participants, bytes) equal; losses to 1e-12 relative (the clients ran in other processes)."""
    assert len(emb) == len(flw), what
    for e, f in zip(emb, flw):
        for key in ("round", "step", "participants", "bytes_up", "bytes_down"):
            assert e[key] == f[key], (what, e["round"], key, e[key], f[key])
        assert f["train_loss"] == pytest.approx(e["train_loss"], rel=1e-12, abs=0), (what, e["round"])


def assert_same_records(emb, flw, what):
    """Every client's final state record: the same entries, bit for bit (the same float64 ops ran). One
    exception, which is the same state: optimizer state a client never created. A process holding every
    client (embedded, a Ray actor) stacks an optimizer's state over its replicas once ANY of them trained the
    parameter, so a client that never trained it carries zero moments and step 0; a process holding one
    client (a deployment's message) has no entry — which ``load_replica_state`` reads as exactly that fresh
    state. Such an entry must be all zeros where it is present."""
    assert sorted(emb) == sorted(flw) == [0, 1, 2], what
    for k in emb:
        one_sided = set(emb[k]) ^ set(flw[k])
        for n in sorted(one_sided):
            t = emb[k][n] if n in emb[k] else flw[k][n]
            assert n.startswith("optim:") and not t.any(), (what, k, n, "in one record only, and not fresh")
        for n in set(emb[k]) & set(flw[k]):
            t = emb[k][n]
            assert flw[k][n].dtype == t.dtype and torch.equal(flw[k][n], t), (what, k, n)


@pytest.mark.long
def test_simulation_gives_the_embedded_records_for_every_config_on_shared_nodes():
    """One simulation (3 SuperNodes) runs every config in turn on the same nodes: the five methods with
    sampling on, H²Tune on the classification task (its eq. 7 output KL) and HetLoRA (per-client ranks);
    round records and every client's final state record equal the embedded run's."""
    specs = {m: _spec(m) for m in METHODS}
    specs["h2tune-classification"] = _spec("h2tune", task="classification")
    specs["hetlora"] = _spec("hetlora")
    emb = {name: run_embedded(spec, records=True) for name, spec in specs.items()}
    assert any(not all(r["participants"]) for r in emb["fedavg"][0])  # sampling was on
    flw = simulate(lambda grid: {name: serve_with_records(grid, spec, timeout=120) for name, spec in specs.items()}, 3)
    for name in specs:
        assert_same_history(emb[name][0], flw[name][0], name)
        assert_same_records(emb[name][1], flw[name][1], name)
    # HetLoRA's clients upload at their own ranks: had a node trained another replica than its partition,
    # every client's upload would have one size
    sizes = {b for r in flw["hetlora"][0] for b in r["bytes_up"] if b}
    assert len(sizes) > 1, sizes
    # and each node's record carries its own client's settings (equal to the embedded replica's, above):
    # HetLoRA's ranks, LoRA-A²'s masks and H²Tune's ω differ from client to client
    for name, key in (("hetlora", "extra:ranks"), ("lora-a2", "extra:mask:"), ("h2tune", "extra:omega")):
        got = [flw[name][1][k][key] for k in range(3)]
        assert not any(torch.equal(got[a], got[b]) for a, b in ((0, 1), (0, 2), (1, 2))), (name, got)


def _one_process_records(specs, grids=None, **grid):
    g = OneProcessGrid(3, **grid)
    if grids is not None:
        grids.append(g)
    return run_as_serverapp(lambda gr: {name: serve_with_records(gr, spec, timeout=120) for name, spec in specs.items()}, g)


def test_a_deployment_in_one_process_gives_the_embedded_records_for_every_config():
    """As the shared-nodes simulation above, over a grid that hands every message to a fresh ClientApp as a
    deployment does (tests/_flower_inprocess.py: the node rebuilt, its state only what Flower serialised):
    what a method kept outside ``context.state`` would be lost, as on a real deployment."""
    specs = {m: _spec(m) for m in METHODS}
    specs["h2tune-classification"] = _spec("h2tune", task="classification")
    specs["hetlora"] = _spec("hetlora")
    grids = []
    flw = _one_process_records(specs, grids)
    for name, spec in specs.items():
        emb = run_embedded(spec, records=True)
        assert_same_history(emb[0], flw[name][0], name)
        assert_same_records(emb[1], flw[name][1], name)
    # per config and node: hello, a train per round its client was drawn for, a deliver per round — which is
    # also the round's evaluation (and, the last one, brings the final records back): no message of their own
    assert grids[0].messages == {k: sum(1 + len(h) + sum(k in r["participants"] for r in h) for h, _ in flw.values())
                                 for k in range(3)}
    # RoLoRA trains one factor per round, so there a client that sat out a factor's rounds has none of its
    # optimizer state in a deployment and zeros of it embedded: the same fresh state (assert_same_records)
    assert any("optim:opt:lora_B:exp_avg" not in flw["rolora"][1][k] for k in range(3))


def test_the_one_process_deployment_catches_a_client_state_kept_outside_the_nodes_state(monkeypatch):
    """A ClientApp that does not restore its record from ``context.state`` (it relies on the run its process
    cached) passes when the process persists — Ray's simulation — and fails as on a deployment."""
    from fedlora import flower

    spec = {"fedavg": _spec("fedavg")}
    emb = run_embedded(spec["fedavg"], records=True)
    monkeypatch.setattr(flower, "_load_state", lambda run, k, context: None)
    kept = _one_process_records(spec, fresh=False)["fedavg"]  # a persistent process: the bug is hidden
    assert_same_history(emb[0], kept[0], "persistent")
    lost = _one_process_records(spec)["fedavg"]
    with pytest.raises(AssertionError):
        assert_same_history(emb[0], lost[0], "fresh")


@pytest.mark.long
def test_a_loopback_deployment_gives_the_embedded_records(tmp_path):
    """A SuperLink and three SuperNodes on 127.0.0.1 with TLS, without SuperNode authentication (separate
    processes, stopped at the end); a spec is submitted with `flwr run` and its ServerApp writes history.json.
    One method, one round (its train, deliver and evaluate messages each restore what the one before kept in
    the node's state, in another process): every method's client state through Flower's serialisation,
    message by message, over several rounds, is
    test_a_deployment_in_one_process_gives_the_embedded_records_for_every_config."""
    work = tmp_path / "deployment"
    t0 = time.monotonic()
    with fd.LocalDeployment(work, 3, app=APP) as dep:
        for m in ["lora-a2"]:
            spec = _spec(m, rounds=1)
            out = tmp_path / m
            run_id = dep.submit(spec, out=out)
            state = dep.wait(run_id, out, 600)
            assert state["status"] == "complete"
            assert_same_history(run_embedded(spec), json.loads((out / "history.json").read_text()), m)
        # while its ServerApp ran, the wait asked the SuperLink nothing (each `flwr ls` is a Python process)
        assert dep.status_checks == 0, dep.status_checks
    started = json.loads((work / "commands.json").read_text())
    assert "--ssl-certfile" in started["superlink"] and all("--root-certificates" in started[f"supernode{k}"]
                                                            for k in range(3))
    assert "--enable-supernode-auth" not in started["superlink"]
    # each node's messages were forked from its warm SuperExec (fedlora.flower_warm), one child per message
    # the SuperNode received, each from an empty run cache
    assert all(started[f"supernode{k}"][1:3] == ["-m", "fedlora.flower_warm"] for k in range(3))
    received = {k: (work / f"supernode{k}.log").read_text().count("Receiving: ") for k in range(3)}
    assert_forked_per_message(work, 3, received)
    print(f"a synthetic run on a deployment: {time.monotonic() - t0:.0f} s")


@pytest.mark.long
def test_the_command_runs_one_method_on_flower_and_checks_it_against_the_embedded_run(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["synthetic", "flower", "--method", "lora-a2", "--lr", "0.05", "--clients", "3", "--rounds", "2",
            "--sample-fraction", "0.5", "--dim", "8", "--n-test", "40", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "embedded run: participants and bytes equal, training losses within 0" in printed
    history = json.loads((out / "history.json").read_text())
    spec = flower_spec("lora-a2", 0.05, clients=3, rounds=2, sample_fraction=0.5, dim=8, n_test=40)
    assert_same_history(run_embedded(spec), history, "cli")
    assert json.loads((out / "run.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("extra,says", [
    (["--task", "ranking"], "--task: must be regression or classification, got 'ranking'"),
    (["--method", "flora", "--deployment"], "--runtime flower: flora is not supported on Flower"),
    (["--clients", "0"], "--clients"),
])
def test_bad_input_is_one_line(extra, says, tmp_path, capsys):
    argv = ["synthetic", "flower", "--method", "fedavg", "--lr", "0.1", "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()

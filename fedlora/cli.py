"""The ``fedlora`` command line: a thin dispatcher that finds its subcommands in the layers above it.

    fedlora synthetic rank-recovery [--preset paper|tuned] [--ground-truth …] [--seeds N] [--out DIR]
    fedlora synthetic bilevel-convergence [--steps T] [--seed S] [--out DIR]
    fedlora synthetic tune [--seeds N] [--out DIR]
    fedlora synthetic compare [--methods a,b] [--heterogeneity 0,0.5,1] [--task both] [--seeds N] [--out DIR]
    fedlora run CONFIG [--set key=value …] [--out DIR] [--dry-run] [--list-configs]
    fedlora export RUN_DIR --client K --out DIR [--format peft|merged]
    fedlora plot RUN_DIR [RUN_DIR …] [--out DIR] [--labels A,B] [--metric M]
    fedlora compare CONFIG --methods a,b --lr-grid 1e-3,5e-3 [--seeds N] [--set key=value …] [--out DIR]
    fedlora aggregate --method M CLIENT_DIR… (--weights W1,W2 | --weights-from FILE) --out DIR
    fedlora --version         the installed version and, in a git checkout, the commit

``fedlora`` (or ``fedlora synthetic``, ``fedlora flower``) without a command prints its usage and exits 2.

The core imports nothing from the layers built on it (``fedlora.synthetic``, ``fedlora.llm``): each layer owns
its commands (``synthetic/cli.py``, ``llm/cli.py``), and this module discovers them through the
entry-point group ``fedlora.commands`` (pyproject.toml). An entry point is named after the command it
adds and names a ``register(subparsers)`` callable, which adds that command with
``subparsers.add_parser(NAME, …)`` and gives every runnable (sub)command a handler with
``set_defaults(handler=fn)``, ``fn(args) -> int`` (the exit status); a command that leaves nothing to clean
up once it returns may add ``exit_fast=True``: run as the ``fedlora`` script, the process then ends without
the interpreter's teardown (``main``). Any installed package can add a
command the same way. Without the package's metadata (an install older than the entry points, or an
environment whose metadata cannot be read) the built-in commands come from ``BUILTIN_COMMANDS``.

A plugin that fails to load costs only its own command: the others work, ``fedlora --help`` marks it
unavailable, and running it prints one line naming the plugin and why (exit status 2).

Bad input exits with status 2 and one line ``fedlora: error: --flag: what is allowed`` — no traceback:
handlers raise ``ConfigError``. Every command checks its output folder with ``check_output_dir`` before
any work (new commands too); a command that writes a results folder claims it with ``claim_output_dir``
(a non-empty folder is refused unless ``--overwrite``; ``--resume`` is refused until checkpoints exist).

SIGINT and SIGTERM raise ``fedlora.errors.Interrupted`` (a ``KeyboardInterrupt``) in the command, which
cleans up (``fedlora run`` marks its folder incomplete or removes it) and exits with one line
``fedlora: interrupted by SIGINT; …`` and status 130 (SIGINT) or 143 (SIGTERM) — no traceback. A
signal the parent process ignores (a background job's SIGINT) stays ignored.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from importlib import metadata
from typing import Iterator, Sequence

from .errors import ConfigError, Interrupted, RoundFailed
from .io import check_output_dir, claim_output_dir, read_table_file, write_json_atomic  # noqa: F401  (the commands' helpers)

#: the entry-point group a package declares its ``fedlora`` subcommands in
COMMANDS_GROUP = "fedlora.commands"

#: the built-in commands, in the order ``fedlora --help`` lists them: name → ``module:register``.
#: Must equal pyproject.toml's ``[project.entry-points."fedlora.commands"]`` (tests/test_cli_layering.py).
BUILTIN_COMMANDS: dict[str, str] = {
    "synthetic": "fedlora.synthetic.cli:register",
    "run": "fedlora.llm.cli:register_run",
    "export": "fedlora.llm.cli:register_export",
    "plot": "fedlora.llm.cli:register_plot",
    "compare": "fedlora.llm.cli:register_compare",
    "flower": "fedlora.llm.cli:register_flower",
    "aggregate": "fedlora.aggregate_cli:register",
}

#: the exit status of bad input (``ConfigError``) and of an unavailable command
EXIT_USAGE = 2

_DIST = "fedlora"


#: what argparse takes for a negative number (a value, not an option): -1, -.5, -1e-3, -1e-3,5e-3
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?(,.*)?$")


class _Parser(argparse.ArgumentParser):
    """The parser class of every (sub)command: its errors are one line, no usage dump.
    ``unavailable``: command name → why it cannot run (its plugin failed to load)."""

    unavailable: dict[str, str]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a negative number is a value, in any notation and as a list's first item (`--lr-grid -1e-3,5e-3`):
        # the command then says what it allows, instead of argparse's "expected one argument"
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str) -> None:
        missing = _missing_command(self, message)
        if missing is not None:  # `fedlora` or `fedlora synthetic` alone: the usage, not argparse's dest name
            self.print_help()
            raise ConfigError(f"`{self.prog}` needs a command: {', '.join(missing.choices)} "
                              f"(`{self.prog} COMMAND --help` says what each one takes)")
        m = re.match(r"argument (\S+): invalid choice: (.+?) \(choose from ", message)
        for action in self._actions if m else ():
            if isinstance(action, argparse._SubParsersAction) and argparse._get_action_name(action) == m.group(1):
                raise ConfigError(f"`{self.prog}` has no command {m.group(2)}; its commands: "
                                  f"{', '.join(action.choices)} (`{self.prog} --help` says what each one does)")
        raise ConfigError(message)


def _missing_command(parser: argparse.ArgumentParser, message: str) -> argparse._SubParsersAction | None:
    """The required subcommand ``message`` (argparse's "the following arguments are required: …") says is
    missing, if it names one of ``parser``'s; else None."""
    prefix = "the following arguments are required: "
    if not message.startswith(prefix):
        return None
    names = [n.strip() for n in message[len(prefix):].split(",")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argparse._get_action_name(action) in names:
            return action
    return None


def version_text() -> str:
    """``fedlora --version``: the installed package's version (its metadata; ``__version__`` without one)
    and, in a git checkout, the commit it runs from (``+ changes`` when the work tree differs from it)."""
    import os
    import subprocess

    from . import __version__

    try:
        version = metadata.version(_DIST)
    except metadata.PackageNotFoundError:
        version = __version__
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = dict(cwd=here, capture_output=True, text=True, timeout=5, check=True)
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = dirty = ""
    return f"fedlora {version}" + (f" (commit {commit}{' + changes' if dirty else ''})" if commit else "")


class _Version(argparse.Action):
    """``--version``: computed when asked (a git call), not each time the parser is built."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit(0)


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return name.lower().replace("_", "-") if name else None


def command_entry_points() -> list[metadata.EntryPoint]:
    """The ``fedlora.commands`` entry points, in help order: the core's own (the built-ins, in
    ``BUILTIN_COMMANDS`` order) and then every other package's, by name. Without the core's own in
    the metadata (not installed, or installed before the group existed) the built-ins come from
    ``BUILTIN_COMMANDS``. A name that is already taken — a built-in, or a second package's — is skipped."""
    eps = list(metadata.entry_points(group=COMMANDS_GROUP))
    own = [ep for ep in eps if _dist_name(ep) == _DIST]
    if not own:
        own = [metadata.EntryPoint(name, value, COMMANDS_GROUP) for name, value in BUILTIN_COMMANDS.items()]
    order = list(BUILTIN_COMMANDS)
    own.sort(key=lambda ep: (order.index(ep.name) if ep.name in order else len(order), ep.name))
    chosen: dict[str, metadata.EntryPoint] = {}
    for ep in own + sorted((ep for ep in eps if _dist_name(ep) != _DIST), key=lambda ep: ep.name):
        chosen.setdefault(ep.name, ep)
    return list(chosen.values())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _add_command(sub: argparse._SubParsersAction, ep: metadata.EntryPoint) -> str | None:
    """Load ``ep`` and let it add its command; on failure, the one-line reason (and nothing raised)."""
    dist = _dist_name(ep)
    plugin = f"plugin {ep.value!r}" + (f" (package {dist})" if dist else "")
    try:
        register = ep.load()
    except Exception as e:
        return f"command {ep.name!r} is unavailable: its {plugin} failed to load: {_first_line(e)}"
    try:
        register(sub)
    except Exception as e:
        return f"command {ep.name!r} is unavailable: its {plugin} failed to register it: {_first_line(e)}"
    if ep.name not in sub.choices:
        return f"command {ep.name!r} is unavailable: its {plugin} did not add a command of that name"
    return None


def _build_parser(command: str | None = None) -> _Parser:
    """The ``fedlora`` parser with every discovered command; with ``command`` (the first argument) naming
    one, with that one only: running a command loads no other plugin (``fedlora synthetic …`` does not
    import the LLM layer, and a broken plugin costs nothing to the commands it does not provide)."""
    p = _Parser(prog="fedlora", description="Federated LoRA fine-tuning research toolkit.")
    p.add_argument("--version", action=_Version, help="print the version (and the git commit of a checkout) and exit")
    sub = p.add_subparsers(dest="group", required=True, parser_class=_Parser)
    p.unavailable = {}
    eps = command_entry_points()
    if any(ep.name == command for ep in eps):
        eps = [ep for ep in eps if ep.name == command]
    for ep in eps:
        why = _add_command(sub, ep)
        if why is None:
            continue
        p.unavailable[ep.name] = why
        if ep.name not in sub.choices:  # listed in --help as unavailable; main() says why when it is run
            note = f"unavailable: its plugin failed to load (`fedlora {ep.name}` says why)"
            sub.add_parser(ep.name, add_help=False, help=note.replace("%", "%%"))
    return p


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While the command runs, SIGINT and SIGTERM raise ``Interrupted`` in the main thread (SIGTERM's
    default would end the process with no cleanup at all). Once one has arrived, further ones are
    ignored, so the clean-up it triggers runs to its end. The previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame) -> None:
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    old = {s: signal.getsignal(s) for s in _SIGNALS}
    for s, h in old.items():
        if h is not signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _exit_now(code: int) -> None:
    """End the process with ``code`` now, its output flushed, without the interpreter's teardown (freeing
    every module's objects: ≈ 0.7 s once torch has run) — unless a thread other than this one runs (it
    would be cut off): then return and let the process end as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.active_count() == 1:
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default: the process's own, ``sys.argv[1:]``); its exit status.

    Called without ``argv`` — the ``fedlora`` script, ``python -m fedlora`` — a command whose handler's
    parser has ``set_defaults(exit_fast=True)`` (it leaves no process, thread, temporary file or atexit work
    behind once it returns) ends the process itself once it succeeds (``_exit_now``)."""
    script = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    with _signals_raise():
        try:
            parser = _build_parser(argv[0] if argv else None)
            if argv and argv[0] in parser.unavailable:
                raise ConfigError(parser.unavailable[argv[0]])
            args = parser.parse_args(argv)
            code = args.handler(args)
            if script and code == 0 and getattr(args, "exit_fast", False):
                _exit_now(code)
            return code
        except ConfigError as e:
            print(f"fedlora: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except RoundFailed as e:  # too few clients delivered: the run stopped, its last checkpoint kept
            notes = "; ".join(str(n) for n in getattr(e, "__notes__", ()))
            print(f"fedlora: error: {e}" + (f"; {notes}" if notes else ""), file=sys.stderr)
            return 1
        except BrokenPipeError:  # `fedlora … | head`: the reader has gone; nothing more to say, no traceback
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # (Python flushes stdout again at exit)
            return 128 + signal.SIGPIPE
        except KeyboardInterrupt as e:  # SIGINT/SIGTERM (Interrupted) or a plain Ctrl-C: one line
            signum = getattr(e, "signum", signal.SIGINT)
            notes = "; ".join(str(n) for n in getattr(e, "__notes__", ()))
            print(f"fedlora: interrupted by {signal.Signals(signum).name}" + (f"; {notes}" if notes else ""),
                  file=sys.stderr)
            return 128 + int(signum)


if __name__ == "__main__":
    sys.exit(main())

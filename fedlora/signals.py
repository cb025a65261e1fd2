"""SIGINT/SIGTERM during a run's rounds (docs/how-to/resume.md): the first lets the round finish and be
checkpointed, a second stops at once.

``deferred_signals`` is what a round loop enters: in the main thread it installs the handler itself. Flower's
simulation engine runs the ServerApp — and so the round loop — in a thread of its own while the main thread waits
on the engine, and a signal is delivered to the main thread only: ``fedlora.flower.simulate`` holds the engine
inside ``relay_signals``, whose handler in the main thread records the signal for the round loop, which
``deferred_signals`` in the other thread then reads (without it, Ctrl-C interrupted the engine under the loop: the
round's checkpoint never came and the process hung).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

from .errors import Interrupted

__all__ = ["deferred_signals", "relay_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: the main thread's relay while another thread runs the rounds (``relay_signals``): the signals received so
#: far and why the round is finished (what the line printed says)
_relay: dict | None = None


def _install(state: dict) -> dict:
    """The handler of ``state`` (``pending``: the signals so far; ``what``: the line's reason; ``loops``: with a
    relay, how many round loops take its signals now) for SIGINT and SIGTERM, except where the process ignores
    one (a background job's SIGINT); returns the old handlers. A relay with no round loop taking its signals (the
    engine starting, the testbed's Flower runs) is not in the way: the signal does what it did without it."""
    old: dict = {}

    def handler(signum: int, frame) -> None:
        if state.get("loops") == 0 and not state["pending"]:
            before = old.get(signum)
            if callable(before):
                return before(signum, frame)
            raise Interrupted(signum)  # the default action: stop now
        if state["pending"]:
            for s_ in _SIGNALS:
                signal.signal(s_, signal.SIG_IGN)
            raise Interrupted(signum)
        state["pending"].append(signum)
        from tqdm.auto import tqdm

        # on its own line: tqdm.write clears a progress bar's line first and draws the bar again below
        tqdm.write(f"fedlora: {signal.Signals(signum).name}: finishing this round {state['what']} "
                   f"(send it again to stop now)", file=sys.stderr)
        sys.stderr.flush()

    old.update({s_: signal.getsignal(s_) for s_ in _SIGNALS})
    for s_, h in old.items():
        if h is not signal.SIG_IGN:
            signal.signal(s_, handler)
    return old


def _restore(old: dict) -> None:
    for s_, h in old.items():
        if signal.getsignal(s_) is not signal.SIG_IGN or h is signal.SIG_IGN:
            signal.signal(s_, h if h is not None else signal.SIG_DFL)


def _reason(no_checkpoint: str | None) -> str:
    return "to checkpoint it" if no_checkpoint is None else f"({no_checkpoint})"


@contextlib.contextmanager
def deferred_signals(no_checkpoint: str | None = None) -> Iterator[list[int]]:
    """During the rounds, the first SIGINT/SIGTERM lets the round finish and be checkpointed (the list yielded
    holds the signal; the loop raises ``Interrupted`` after it); a second stops at once. ``no_checkpoint``: the run
    keeps none (a SecAgg+ deployment), and the line printed says why instead. Outside the main thread: the
    signals ``relay_signals`` records in the main thread (a simulation's ServerApp), else none."""
    if threading.current_thread() is not threading.main_thread():
        if _relay is None:
            yield []
            return
        relay = _relay
        relay["what"] = _reason(no_checkpoint)
        relay["loops"] += 1
        try:
            yield relay["pending"]
        finally:
            relay["loops"] -= 1
            relay["what"] = _reason(None)
        return
    state = {"pending": [], "what": _reason(no_checkpoint)}
    old = _install(state)
    try:
        yield state["pending"]
    finally:
        _restore(old)


@contextlib.contextmanager
def relay_signals() -> Iterator[None]:
    """In the main thread, while another thread runs the rounds (Flower's simulation engine): the first
    SIGINT/SIGTERM is recorded for that thread's ``deferred_signals``, a second raises ``Interrupted`` here at once.
    While no round loop is inside ``deferred_signals`` a signal does what it did before (the handler there was)."""
    global _relay
    if threading.current_thread() is not threading.main_thread():  # no signal comes here: nothing to relay
        yield
        return
    state = {"pending": [], "what": _reason(None), "loops": 0}
    old = _install(state)
    _relay = state
    try:
        yield
    finally:
        _relay = None
        _restore(old)

"""SIGINT/SIGTERM during the rounds (``fedlora.signals``): the first finishes the round, a second stops at once —
also when the round loop runs in another thread than the one signals come to (Flower's simulation engine runs
the ServerApp in a thread; ``relay_signals`` hands the signal over). The real engine under SIGTERM:
tests/test_secagg_run.py."""
import os
import signal
import threading
import time

import pytest

from fedlora.errors import Interrupted
from fedlora.signals import deferred_signals, relay_signals


@pytest.fixture
def sigint_as_a_terminal_has_it():
    """SIGINT handled by Python and delivered (an earlier test may have left SIG_IGN or a blocked mask); both
    signals' handlers put back afterwards (a second signal leaves them ignored, as a stopping run wants)."""
    old_term = signal.getsignal(signal.SIGTERM)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGINT, old_handler)
        signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)


def _signal_self(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # Python runs the handler in the main thread at its next instruction


def _loop_in_a_thread(no_checkpoint=None):
    """A round loop in another thread: enters ``deferred_signals``, waits for ``go``, keeps what it saw."""
    seen, started, go = {}, threading.Event(), threading.Event()

    def loop():
        with deferred_signals(no_checkpoint) as pending:
            started.set()
            go.wait(10)
            seen["pending"] = list(pending)

    t = threading.Thread(target=loop)
    t.start()
    assert started.wait(10)
    return t, go, seen


def test_without_the_relay_a_signal_never_reaches_a_round_loop_in_another_thread(sigint_as_a_terminal_has_it):
    """What Flower's engine did before the relay: the loop's list stays empty and the main thread is interrupted."""
    t, go, seen = _loop_in_a_thread()
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGINT)
    go.set()
    t.join(10)
    assert seen["pending"] == []


def test_the_relay_hands_the_first_signal_to_the_round_loop_and_the_second_stops_at_once(sigint_as_a_terminal_has_it,
                                                                                        capsys):
    with relay_signals():
        t, go, seen = _loop_in_a_thread()
        _signal_self(signal.SIGTERM)
        go.set()
        t.join(10)
        assert seen["pending"] == [signal.SIGTERM]  # the loop finishes its round, checkpoints, raises Interrupted
        assert "fedlora: SIGTERM: finishing this round to checkpoint it (send it again to stop now)" in \
            capsys.readouterr().err
        with pytest.raises(Interrupted) as second:
            _signal_self(signal.SIGINT)
        assert second.value.signal_name == "SIGINT"
    # stopping: a third signal must not interrupt the clean-up (as in the main thread's own deferral)
    assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_the_relayed_line_says_why_a_run_without_checkpoints_stops_without_one(sigint_as_a_terminal_has_it, capsys):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with relay_signals():
        t, go, seen = _loop_in_a_thread("this run keeps none")
        _signal_self(signal.SIGINT)
        go.set()
        t.join(10)
    assert seen["pending"] == [signal.SIGINT]
    assert "fedlora: SIGINT: finishing this round (this run keeps none) (send it again to stop now)" in \
        capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # put back


def test_a_round_loop_in_the_main_thread_defers_the_first_signal_itself(sigint_as_a_terminal_has_it):
    with deferred_signals() as pending:
        _signal_self(signal.SIGINT)
        assert pending == [signal.SIGINT]
        with pytest.raises(Interrupted):
            _signal_self(signal.SIGINT)


def test_the_relay_without_a_round_loop_taking_signals_leaves_them_as_they_were(sigint_as_a_terminal_has_it):
    """Before a round loop enters ``deferred_signals`` (the engine starting) or in a Flower run without one (the
    testbed's): Ctrl-C interrupts at once, as without the relay — never recorded for a loop that is not there."""
    with relay_signals():
        with pytest.raises(KeyboardInterrupt) as stopped:
            _signal_self(signal.SIGINT)
        assert not isinstance(stopped.value, Interrupted)  # the handler that was there: Python's own
        t, go, seen = _loop_in_a_thread()  # a loop now takes them: the next one is deferred
        _signal_self(signal.SIGINT)
        go.set()
        t.join(10)
    assert seen["pending"] == [signal.SIGINT]

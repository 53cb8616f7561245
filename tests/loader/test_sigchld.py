"""savable_loader.loader.sigchld: worker-death signals handled only inside loader calls.

The handler is called directly (no real signals are sent); the module's ``_state`` is
replaced by a fresh copy in each test.
"""

from __future__ import annotations

import signal
import threading

import pytest

from savable_loader.loader import sigchld
from savable_loader.loader.sigchld import _handler, install, loader_call

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="no SIGCHLD on this platform"),
]

FRAME = object()


class Recorder:
    """A fake wrapped handler (torch's, in the loader) that records its calls."""

    def __init__(self, action=None) -> None:
        self.calls: list[tuple[int, object, dict]] = []
        self.action = action

    def __call__(self, signum: int, frame: object) -> None:
        self.calls.append((signum, frame, dict(sigchld._state)))
        if self.action is not None:
            self.action()


@pytest.fixture
def wrapped(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(sigchld, "_state", {"depth": 0, "pending": False, "wrapped": rec, "running": False})
    return rec


def test_signal_outside_a_loader_call_is_deferred(wrapped):
    _handler(signal.SIGCHLD, FRAME)
    assert wrapped.calls == []
    assert sigchld._state["pending"] is True
    _handler(signal.SIGCHLD, FRAME)  # two signals before the next call: still one pending
    assert wrapped.calls == [] and sigchld._state["pending"] is True


def test_pending_signal_is_delivered_at_the_start_of_the_next_loader_call(wrapped):
    _handler(signal.SIGCHLD, FRAME)
    body_saw = []
    with loader_call():
        body_saw.append(len(wrapped.calls))
    assert body_saw == [1]  # delivered before the body ran
    assert len(wrapped.calls) == 1
    signum, frame, state = wrapped.calls[0]
    assert signum == signal.SIGCHLD and frame is None
    assert state["depth"] == 1 and state["running"] is True and state["pending"] is False
    assert sigchld._state == {"depth": 0, "pending": False, "wrapped": wrapped, "running": False}
    with loader_call():  # delivered once only
        pass
    assert len(wrapped.calls) == 1


def test_signal_inside_a_loader_call_is_delivered_at_once(wrapped):
    with loader_call():
        _handler(signal.SIGCHLD, FRAME)
        assert len(wrapped.calls) == 1
        signum, frame, state = wrapped.calls[0]
        assert signum == signal.SIGCHLD and frame is FRAME
        assert state["running"] is True
        assert sigchld._state["pending"] is False
        with loader_call():  # nested calls count depth
            _handler(signal.SIGCHLD, FRAME)
        assert sigchld._state["depth"] == 1
        _handler(signal.SIGCHLD, FRAME)  # still inside the outer call
        assert len(wrapped.calls) == 3
    assert sigchld._state["depth"] == 0 and sigchld._state["running"] is False
    _handler(signal.SIGCHLD, FRAME)
    assert len(wrapped.calls) == 3 and sigchld._state["pending"] is True


def test_error_of_the_wrapped_handler_propagates_and_state_recovers(wrapped):
    def boom():
        raise RuntimeError("DataLoader worker (pid 1) exited unexpectedly")

    wrapped.action = boom
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        with loader_call():
            _handler(signal.SIGCHLD, FRAME)
    assert sigchld._state["depth"] == 0 and sigchld._state["running"] is False
    # the same error from a deferred signal surfaces at the start of the next call
    _handler(signal.SIGCHLD, FRAME)
    ran = []
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        with loader_call():
            ran.append(True)
    assert ran == [] and len(wrapped.calls) == 2
    assert sigchld._state == {"depth": 0, "pending": False, "wrapped": wrapped, "running": False}


def test_reentrancy_guard_breaks_a_handler_that_chains_back(wrapped):
    # a handler installed after ours wraps ours in turn: it chains back to us
    wrapped.action = lambda: _handler(signal.SIGCHLD, FRAME)
    with loader_call():
        _handler(signal.SIGCHLD, FRAME)
    assert len(wrapped.calls) == 1  # no infinite recursion, no second call
    assert sigchld._state["running"] is False and sigchld._state["pending"] is False
    # the same through a deferred delivery
    _handler(signal.SIGCHLD, FRAME)
    with loader_call():
        pass
    assert len(wrapped.calls) == 2 and sigchld._state["pending"] is False


@pytest.mark.parametrize("previous", [signal.SIG_DFL, signal.SIG_IGN, None])
def test_non_callable_wrapped_handler_is_ignored(previous, wrapped):
    sigchld._state["wrapped"] = previous
    with loader_call():
        _handler(signal.SIGCHLD, FRAME)
    _handler(signal.SIGCHLD, FRAME)
    with loader_call():
        pass
    assert sigchld._state["running"] is False and sigchld._state["pending"] is False


def test_loader_call_outside_the_main_thread_changes_nothing(wrapped):
    _handler(signal.SIGCHLD, FRAME)
    seen = []

    def other():
        with loader_call():
            seen.append(dict(sigchld._state))

    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert seen and seen[0]["depth"] == 0 and seen[0]["pending"] is True
    assert wrapped.calls == []  # the pending signal waits for the main thread's next call
    with loader_call():
        pass
    assert len(wrapped.calls) == 1


def test_install_wraps_the_current_handler_once(monkeypatch):
    monkeypatch.setattr(sigchld, "_state", {"depth": 0, "pending": False, "wrapped": None, "running": False})
    original = signal.getsignal(signal.SIGCHLD)
    rec = Recorder()
    try:
        signal.signal(signal.SIGCHLD, rec)
        install()
        assert signal.getsignal(signal.SIGCHLD) is _handler
        assert sigchld._state["wrapped"] is rec
        install()  # already ours: the wrapped handler must not become ours (a loop)
        assert sigchld._state["wrapped"] is rec
        with loader_call():
            _handler(signal.SIGCHLD, FRAME)
        assert [c[:2] for c in rec.calls] == [(signal.SIGCHLD, FRAME)]
        # from another thread: no change (signal handlers are the main thread's)
        signal.signal(signal.SIGCHLD, rec)
        t = threading.Thread(target=install)
        t.start()
        t.join(5)
        assert signal.getsignal(signal.SIGCHLD) is rec
    finally:
        signal.signal(signal.SIGCHLD, original)

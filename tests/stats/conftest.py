"""Fixtures of the stats tests: the clock's measured costs forgotten around each test,
and a clock the test moves (``fake``)."""

from __future__ import annotations

import pytest

from tests.stats.clock_helpers import FakeTime, clear_costs, use_fake


@pytest.fixture(autouse=True)
def _costs_measured_anew():
    """No test sees costs measured on another test's clock, nor leaves its own behind
    (for later tests in this process)."""
    clear_costs()
    yield
    clear_costs()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    return use_fake(monkeypatch, FakeTime())  # (its costs forgotten after the test: above)

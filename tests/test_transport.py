"""The client's transport settings: the reply spin, from an argument or the environment."""

from __future__ import annotations

import pytest

from kvpool.errors import InvalidRequest
from kvpool.transport import reply_spin


def test_the_reply_spin_comes_from_the_argument_else_the_environment(monkeypatch):
    monkeypatch.delenv("KVPOOL_REPLY_SPIN_US", raising=False)
    assert reply_spin(None) == 0.0
    monkeypatch.setenv("KVPOOL_REPLY_SPIN_US", "150")
    assert reply_spin(None) == pytest.approx(150e-6)
    assert reply_spin(0.0) == 0.0  # an argument wins over the environment


@pytest.mark.parametrize("env, arg", [("fast", None), ("-5", None), (None, -0.001), (None, 2.0)])
def test_a_reply_spin_that_makes_no_sense_is_refused(monkeypatch, env, arg):
    if env is None:
        monkeypatch.delenv("KVPOOL_REPLY_SPIN_US", raising=False)
    else:
        monkeypatch.setenv("KVPOOL_REPLY_SPIN_US", env)
    with pytest.raises(InvalidRequest, match=r"(?i)spin"):
        reply_spin(arg)

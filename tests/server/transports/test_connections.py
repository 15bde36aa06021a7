"""The connection bounds' own arithmetic and logging: caps sized under the fd limit, refusals logged in bulk."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvpool.server.transports.connections import RESERVED_FDS, RefusalLog, size_caps

WANTED = {"tcp": 1024, "unix": 1024, "fast": 4096}


def test_caps_that_fit_under_the_limit_are_kept():
    assert size_caps(WANTED, 20000) == WANTED


@pytest.mark.parametrize("limit", [400, 1024, 4096, 6000])
def test_caps_that_do_not_fit_shrink_in_proportion_and_leave_room(limit, caplog):
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        caps = size_caps(WANTED, limit)
    assert sum(caps.values()) <= limit - min(RESERVED_FDS, limit // 2)
    assert caps["tcp"] == caps["unix"] >= 1 and 4 * caps["tcp"] <= caps["fast"] <= 4 * caps["tcp"] + 3
    assert "ulimit -n" in caplog.text


def test_every_listener_keeps_one_connection_however_few_files():
    assert size_caps(WANTED, 8) == {"tcp": 1, "unix": 1, "fast": 2}
    assert size_caps(WANTED, 2) == {"tcp": 1, "unix": 1, "fast": 1}


def test_refusals_are_counted_each_and_logged_once_a_period(caplog):
    counted: list[str] = []

    async def burst() -> None:
        refusals = RefusalLog(counted.append, every_s=0.2)
        for _ in range(100):
            refusals.note("read_timeout_s", "slow things")
        refusals.note("max_http_connections", "crowds")
        await asyncio.sleep(0.05)  # the first of each kind is logged at once
        for _ in range(50):
            refusals.note("read_timeout_s", "slow things")
        await asyncio.sleep(0.4)

    with caplog.at_level(logging.WARNING, logger="kvpool"):
        asyncio.run(burst())
    assert counted.count("read_timeout_s") == 150 and counted.count("max_http_connections") == 1
    lines = [r.getMessage().removeprefix("refused or closed ") for r in caplog.records if r.name == "kvpool"]
    assert lines == ["100 slow things", "1 crowds", "50 slow things"]

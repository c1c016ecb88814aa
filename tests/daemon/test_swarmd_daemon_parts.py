"""Daemon pieces in one process: identity on disk, announce address, device choice, ordered close."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import pytest
import torch

from swarmd import daemon as d
from swarmd.config import Address, Config, NetworkSection, DaemonSection
from swarmd.exitcodes import EXIT_CONFIG


def test_identity_is_created_private_and_reused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = d.load_identity(state)
    assert (state.stat().st_mode & 0o777) == 0o700
    assert ((state / d.IDENTITY_FILE).stat().st_mode & 0o777) == 0o600
    assert d.load_identity(state).peer_id == first.peer_id


def test_corrupt_identity_is_a_startup_error_not_a_new_identity(tmp_path: Path) -> None:
    (tmp_path / d.IDENTITY_FILE).write_bytes(b"short")
    with pytest.raises(d.StartupError) as info:
        d.load_identity(tmp_path)
    assert info.value.status == EXIT_CONFIG and "32 raw bytes" in str(info.value)
    assert (tmp_path / d.IDENTITY_FILE).read_bytes() == b"short"


def test_announce_address() -> None:
    config = Config()
    loopback = dataclasses.replace(config, network=NetworkSection(listen=Address("127.0.0.1", 0)))
    assert d.announce_address(loopback, 4321) == Address("127.0.0.1", 4321)
    explicit = dataclasses.replace(config, network=NetworkSection(announce=Address("203.0.113.5", 9)))
    assert d.announce_address(explicit, 4321) == Address("203.0.113.5", 9)
    wildcard = d.announce_address(config, 4321)  # 0.0.0.0: some dialable address of this host
    assert wildcard.port == 4321 and wildcard.host not in ("0.0.0.0", "")


def test_device_choice() -> None:
    assert d.resolve_device("cpu") == "cpu"
    assert d.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(d.StartupError) as info:
        d.resolve_device("cuda:99")
    assert info.value.status == EXIT_CONFIG and "daemon.device" in str(info.value)


async def test_close_runs_in_reverse_and_abandons_a_hung_part(caplog) -> None:
    """Parts started a, hang, b: closing runs b, hang, a; `hang` is abandoned when the drain timeout
    is spent and `a` still gets its short grace, so the whole stop takes about the drain timeout."""
    config = dataclasses.replace(Config(), daemon=DaemonSection(drain_timeout_s=0.3))
    daemon = d.Daemon(config, reload=lambda: config, env={})
    closed: list[str] = []

    def part(name: str, seconds: float):
        async def close() -> None:
            await asyncio.sleep(seconds)
            closed.append(name)
        return name, close

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="swarmd.daemon"):
        await daemon._close([part("a", 0.01), part("hang", 60), part("b", 0.01)])
    took = time.monotonic() - started
    assert closed == ["b", "a"]
    assert "hang did not stop within the drain timeout" in caplog.text
    assert 0.3 <= took < 0.3 + d.CLOSE_GRACE_S

"""Gloo is pointed at the interface that holds the node's IP, not where the hostname resolves."""

from __future__ import annotations

import os

import pytest

from raydp.engine.gloo_interface import GLOO_IFNAME, interface_of, use_interface_of

pytestmark = pytest.mark.timeout(30)
UNHELD = "192.0.2.254"  # TEST-NET-1: no interface here holds it


def test_the_interface_holding_an_ip_is_found_by_that_ip() -> None:
    lo = interface_of("127.0.0.1")
    assert lo is not None and lo.startswith("lo")
    assert interface_of(UNHELD) is None


def test_gloo_is_told_the_interface_of_the_nodes_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    lo = interface_of("127.0.0.1")
    assert use_interface_of("127.0.0.1") == lo
    assert os.environ[GLOO_IFNAME] == lo


def test_an_ip_no_interface_holds_leaves_gloo_to_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    assert use_interface_of(UNHELD) is None
    assert GLOO_IFNAME not in os.environ


def test_the_users_own_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_IFNAME, "eth7")
    assert use_interface_of("127.0.0.1") == "eth7"
    assert os.environ[GLOO_IFNAME] == "eth7"

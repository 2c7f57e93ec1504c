"""Hosts with their own IPs on one machine, made of Linux network namespaces.

The test machine becomes a small network: a bridge in the root namespace holds
the *head host's* IP, and every other host is a network namespace joined to
the bridge by a veth pair, with its own IP on the same private subnet. Traffic
between hosts then really crosses an interface (TCP between different
addresses), and bringing a host's veth down partitions it.

Everything this module creates is named with :data:`PREFIX`, so that
:func:`teardown` can also remove what a killed earlier run left behind. Only
addresses on :data:`SUBNET` are ever configured; no host gets a default route.
Needs root and iproute2; :func:`unavailable` says why not when either is
missing.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "rdpmh"  # interface names are at most 15 characters: keep the prefix short
SUBNET = "10.213.7"  # a /24 that only these tests use
BRIDGE = f"{PREFIX}-br"
_TIMEOUT_S = 10


@dataclass(frozen=True)
class Host:
    """One namespace host: its namespace, its IP and the root-side end of its veth."""

    index: int
    namespace: str
    ip: str
    link: str  # root side of the veth pair: down means partitioned


@dataclass(frozen=True)
class Network:
    bridge_ip: str  # the head host: the root namespace, on the bridge
    hosts: tuple[Host, ...]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` in the root namespace; raise with its stderr when ``check`` and it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's 'ip' command is missing"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}-probe"
    ip("netns", "delete", probe, check=False)
    added = ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"'ip netns add' is not permitted here: {added.stderr.strip()}"
    ip("netns", "delete", probe, check=False)
    return None


def in_namespace(host: Host, argv: Sequence[str], private: Sequence[Path] = ()) -> list[str]:
    """``argv`` as a command that runs inside ``host``'s namespace, with the same pid (everything execs).

    Each directory in ``private`` (it must exist) gets a fresh tmpfs that only
    this command and its children see, as another machine's ``/tmp`` would be:
    ``ip netns exec`` runs in a mount namespace of its own whose mounts do not
    propagate back.
    """
    if not private:
        return ["ip", "netns", "exec", host.namespace, *argv]
    mounts = " && ".join(f"mount -t tmpfs -o mode=0700 tmpfs {shlex.quote(str(p))}" for p in private)
    return ["ip", "netns", "exec", host.namespace, "sh", "-c", f'{mounts} && exec "$@"', "sh", *argv]


def create(count: int) -> Network:
    """A bridge at ``SUBNET.1`` and ``count`` namespace hosts at ``SUBNET.11``, ``.12``...

    Stale objects of an earlier run are removed first; on any failure what was
    made is removed again.
    """
    teardown()
    bridge_ip = f"{SUBNET}.1"
    try:
        ip("link", "add", BRIDGE, "type", "bridge")
        ip("addr", "add", f"{bridge_ip}/24", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        hosts = tuple(_add_host(i) for i in range(1, count + 1))
    except BaseException:
        teardown()
        raise
    return Network(bridge_ip, hosts)


def _add_host(index: int) -> Host:
    host = Host(index, f"{PREFIX}-ns{index}", f"{SUBNET}.{10 + index}", f"{PREFIX}-v{index}")
    inner = f"{PREFIX}-p{index}"
    ip("netns", "add", host.namespace)
    ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
    ip("link", "set", inner, "netns", host.namespace)
    ip("link", "set", host.link, "master", BRIDGE)
    ip("link", "set", host.link, "up")
    ns = ("-n", host.namespace)
    ip(*ns, "link", "set", "lo", "up")
    ip(*ns, "addr", "add", f"{host.ip}/24", "dev", inner)
    ip(*ns, "link", "set", inner, "up")
    return host


def add_host(index: int) -> Host:
    """One more host at ``SUBNET.(10 + index)`` on the bridge :func:`create` made (e.g. replacing a cut-off one)."""
    return _add_host(index)


def partition(host: Host) -> None:
    """Cut ``host`` off: its veth goes down, so nothing reaches it or leaves it."""
    ip("link", "set", host.link, "down")


def heal(host: Host) -> None:
    ip("link", "set", host.link, "up")


def namespace_pids(host: Host) -> list[int]:
    """Every process inside ``host``'s namespace (all of them were started by the test)."""
    done = ip("netns", "pids", host.namespace, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def leftovers() -> list[str]:
    """Namespaces and links with :data:`PREFIX` that exist now."""
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()]
    return [n for n in names + links if n.startswith(f"{PREFIX}-")]


def teardown() -> None:
    """Remove every namespace and link named with :data:`PREFIX` (deleting a namespace deletes its veth).

    Processes still inside such a namespace are killed first (only these tests
    start processes there), since a namespace lives on while a process holds it.
    """
    for name in leftovers():
        if name.startswith(f"{PREFIX}-ns"):
            for pid in namespace_pids(Host(0, name, "", "")):
                _kill(pid)
    for name in leftovers():
        if ip("netns", "delete", name, check=False).returncode != 0:
            ip("link", "delete", name, check=False)
    for name in leftovers():  # a root-side veth whose peer's namespace went first is already gone
        ip("link", "delete", name, check=False)

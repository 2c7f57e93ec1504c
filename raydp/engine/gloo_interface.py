"""Which network interface gloo groups use: the one holding this node's own IP.

Left to itself, gloo binds to the address the machine's hostname resolves to,
and on many hosts that is a loopback address (``/etc/hosts`` often maps the
hostname to 127.0.0.1 or 127.0.1.1). Every rank then tells its peers to
connect to 127.0.0.1, which works while all ranks share one host and fails
("Connection refused, remote=[127.0.0.1]") as soon as a group spans hosts.
``GLOO_SOCKET_IFNAME`` names the interface instead; a user's own setting wins.
"""

from __future__ import annotations

import os

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(ip: str) -> str | None:
    """The name of the local interface that holds ``ip``, or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        # an IPv6 link-local address carries its scope: fe80::1%eth0
        if any(a.address.split("%", 1)[0] == ip for a in addresses):
            return str(name)
    return None


def use_interface_of(ip: str) -> str | None:
    """Make gloo groups formed later in this process bind to the interface holding ``ip``.

    Returns the interface gloo will use, or None when no local interface holds
    ``ip`` (gloo then falls back to the hostname, as before).
    """
    chosen = os.environ.get(GLOO_IFNAME)
    if chosen:
        return chosen
    name = interface_of(ip)
    if name is not None:
        os.environ[GLOO_IFNAME] = name
    return name

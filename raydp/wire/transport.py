"""ZeroMQ socket factory and address choice.

Every socket raydp opens comes from :func:`make_socket`, which sets linger, the
high-water marks and the maximum message size, so no socket can hang
``close()``, grow without bound or be made to allocate a huge message.

Cross-node traffic is CURVE-authenticated when the cluster has keys
(:mod:`raydp.wire.security`); inproc wake-up sockets never carry them.

Addresses: a binder listens on an IPC path inside a per-cluster 0700
directory (same-node peers) and, unless the transport is ``ipc``, on TCP at
the node's own IP (other nodes). A connector picks IPC when it runs on the
binder's node and TCP otherwise (:func:`pick_address`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import zmq

from raydp.config import RaydpConfig, TransportKind
from raydp.errors import ConfigError
from raydp.wire.security import CurveKeys, secure_client, secure_server

DEFAULT_LINGER_MS = 0


@dataclass(frozen=True)
class SocketOptions:
    """The limits every raydp socket carries, and the cluster's CURVE keys if it uses them."""

    high_water_mark: int = 100_000
    max_message_bytes: int = 64 << 20
    linger_ms: int = DEFAULT_LINGER_MS
    curve: CurveKeys | None = None


def socket_options(config: RaydpConfig, curve: CurveKeys | None = None) -> SocketOptions:
    """The socket limits ``config`` asks for, with the cluster's keys if it has them."""
    return SocketOptions(
        high_water_mark=config.high_water_mark, max_message_bytes=config.max_message_bytes, curve=curve
    )


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    opts: SocketOptions,
    *,
    identity: bytes | None = None,
    serves: bool = False,
) -> zmq.Socket[bytes]:
    """A socket of ``kind`` with linger, HWMs and MAXMSGSIZE set.

    With ``opts.curve`` it is CURVE-secured: as a server if it ``serves``
    (binds for other components), else as a member connecting to one.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, opts.high_water_mark)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Unroutable sends raise instead of vanishing, so a lost peer is noticed.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if opts.curve is not None:
        (secure_server if serves else secure_client)(sock, opts.curve)
    return sock


_NOBLOCK, _NOBLOCK_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)


def send_two(sock: zmq.Socket[bytes], first: bytes, second: bytes) -> None:
    """``[first, second]`` as one message, without blocking (``zmq.Again`` if the queue is full).

    What ``send_multipart`` does, less its per-frame flag arithmetic on enums:
    a few microseconds on every request and every output. A queue that takes
    the first frame takes the second: ZeroMQ refuses a message at its first
    frame or not at all.
    """
    sock.send(first, _NOBLOCK_MORE)
    sock.send(second, _NOBLOCK)


def node_ip() -> str:
    """This node's own IP (the one Ray uses), falling back to the hostname's."""
    ray = sys.modules.get("ray")  # never import Ray here: local processes do without it
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class IpcDir:
    """A private (0700) directory for one component's IPC socket files.

    It records the process that binds in it (``.owner``: pid and start
    time). A process killed outright (SIGKILL, its node's or its owner's
    death) cannot remove its directory, so every new one first sweeps the
    directories whose owner is gone (:func:`sweep_stale_ipc_dirs`).
    """

    def __init__(self, prefix: str) -> None:
        root = self.root()
        root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)
        sweep_stale_ipc_dirs()
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root))
        os.chmod(self.path, 0o700)
        _claim(self.path)

    @classmethod
    def reuse(cls, address: str) -> IpcDir:
        """The directory of ``address`` (an ``ipc://`` path in it), made again if it is gone.

        A successor binding its predecessor's addresses (a restarted
        coordinator) must use the same directory: peers reconnect to the path.
        """
        path = Path(address.removeprefix("ipc://")).parent
        if path.parent != cls.root():
            raise ConfigError(f"address={address!r}: not inside a raydp IPC directory under {cls.root()}")
        self = cls.__new__(cls)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        _claim(path)  # the predecessor is dead: a sweep must not take the directory from its successor
        self.path = path
        return self

    @staticmethod
    def root() -> Path:
        """The per-user parent of every raydp IPC directory on this node."""
        return Path(tempfile.gettempdir()) / f"raydp-{os.getuid()}"

    def address(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


_OWNER = ".owner"


def _pid_namespace() -> str:
    """This process's pid namespace: pids mean something only inside it (containers may share /tmp)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def _process_identity(pid: int) -> str | None:
    """``pid``, its start time (pids are reused) and our pid namespace, or None if no such process runs."""
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f} {_pid_namespace()}"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _claim(path: Path) -> None:
    (path / _OWNER).write_text(_process_identity(os.getpid()) or "")


def sweep_stale_ipc_dirs() -> list[Path]:
    """Remove this node's raydp IPC directories whose owning process is gone; return them.

    Only directories claimed in this pid namespace are judged: a process of another
    container sharing the directory cannot be seen from here, dead or alive.
    """
    removed = []
    root = IpcDir.root()
    ours = _pid_namespace()
    for path in root.glob("*") if root.is_dir() else ():
        try:
            owner = (path / _OWNER).read_text().split()
        except OSError:
            continue  # being made, or not ours to judge
        if len(owner) != 3 or not owner[0].isdigit() or owner[2] != ours or ours == "?":
            continue
        if _process_identity(int(owner[0])) != " ".join(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def ipc_prefix(cluster_name: str) -> str:
    """A per-launch prefix: two clusters of one name on a host never share directories."""
    return f"{cluster_name}-{secrets.token_hex(3)}"


def remove_cluster_ipc_dirs(prefix: str) -> None:
    """Remove this node's IPC directories of one launch (a killed process leaves its own)."""
    for role in ("-dp", "-coordinator", "-frontend"):
        for path in IpcDir.root().glob(f"{prefix}{role}*"):
            shutil.rmtree(path, ignore_errors=True)


def bind_endpoints(
    sock: zmq.Socket[bytes],
    name: str,
    *,
    transport: TransportKind,
    ipc_dir: IpcDir | None,
    ip: str | None = None,
) -> list[str]:
    """Bind ``sock`` on IPC and/or TCP as ``transport`` asks; return the addresses."""
    addresses: list[str] = []
    if transport in ("auto", "ipc"):
        if ipc_dir is None:
            raise ConfigError(f"transport={transport!r} needs an IPC directory")
        address = ipc_dir.address(f"{name}-{secrets.token_hex(4)}")
        sock.bind(address)
        addresses.append(address)
    if transport in ("auto", "tcp"):
        host = ip or node_ip()
        port = sock.bind_to_random_port(f"tcp://{host}")
        addresses.append(f"tcp://{host}:{port}")
    return addresses


def pick_address(addresses: list[str], *, same_node: bool) -> str:
    """IPC for a same-node peer when offered, else the first TCP address."""
    ipc = [a for a in addresses if a.startswith("ipc://")]
    tcp = [a for a in addresses if a.startswith("tcp://")]
    if same_node and ipc:
        return ipc[0]
    if tcp:
        return tcp[0]
    if ipc:
        return ipc[0]
    raise ConfigError(f"addresses={addresses!r}: need at least one ipc:// or tcp:// address")


def bind_inputs(
    ctx: zmq.Context[zmq.Socket[bytes]], opts: SocketOptions, transport: TransportKind, ipc_dir: IpcDir | None
) -> tuple[list[zmq.Socket[bytes]], list[str]]:
    """An engine's input ROUTER(s) and their addresses.

    The data path is the one place CURVE costs throughput, and same-node
    clients do not need it (the 0700 directory admits only this user): with
    CURVE on both transports, IPC gets a plain ROUTER and TCP a secured one.
    Connectors pick their options with :func:`input_options`.
    """
    if opts.curve is None or transport != "auto":
        sock = make_socket(ctx, zmq.ROUTER, opts, serves=True)
        return [sock], bind_endpoints(sock, "input", transport=transport, ipc_dir=ipc_dir)
    local = make_socket(ctx, zmq.ROUTER, replace(opts, curve=None))
    remote = make_socket(ctx, zmq.ROUTER, opts, serves=True)
    addresses = bind_endpoints(local, "input", transport="ipc", ipc_dir=ipc_dir)
    addresses += bind_endpoints(remote, "input", transport="tcp", ipc_dir=ipc_dir)
    return [local, remote], addresses


def input_options(opts: SocketOptions, address: str) -> SocketOptions:
    """The options for a socket connecting to an engine input at ``address`` (see :func:`bind_inputs`)."""
    return replace(opts, curve=None) if address.startswith("ipc://") else opts

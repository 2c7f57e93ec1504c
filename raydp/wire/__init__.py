"""The wire: everything that crosses a socket, and how sockets are made.

The bottom layer above :mod:`raydp.config` and :mod:`raydp.errors`: it imports
nothing else of raydp, and never Ray.

Modules:

- ``codec``: the messages' base struct, the shared encoder, typed decoders, bounds on a peer's integers;
- ``protocol``: the data path's and the handshake's messages;
- ``control``: the coordinator's messages;
- ``sampling``: :class:`Sampling`, how a request wants its tokens chosen;
- ``transport``: socket creation, addresses and IPC directories;
- ``security``: CURVE keys and the ZAP gatekeeper;
- ``polling``: waiting on several sockets' ``ZMQ_FD``s and doorbell pipes with one ``poll()``;
- ``dropped``: logging malformed input once per message, by sender, rate limited;
- ``endpoints``: where a running cluster's sockets are;
- ``adapters``: LoRA adapters' names and what a rank reports of those it holds (``AdapterState``);
- ``blocks``: prefix-cache blocks named by chained digests of their tokens, and an engine's ``CacheEvents``;
- ``records``: control-plane records a coordinator keeps and reports (``ClusterInfo``, ``CoordinatorStatus``, ...);
- ``handshake``: the startup handshake between a front-end and its engines.
"""

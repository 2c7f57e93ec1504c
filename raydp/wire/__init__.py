"""The wire: everything that crosses a socket, and how sockets are made.

Owns the message types and their typed msgspec codecs (``protocol``), socket
creation, addresses and IPC directories (``transport``), CURVE keys and the
ZAP gatekeeper (``security``), where a running cluster's sockets are
(``endpoints``), and the startup handshake between a front-end and its
engines (``handshake``). The bottom layer above :mod:`raydp.config` and
:mod:`raydp.errors`: it imports nothing else of raydp, and never Ray.
"""

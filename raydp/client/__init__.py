"""Front-ends: send requests to the ranks and demultiplex their outputs.

Usable from a driver, a notebook, a Ray Job or an API server process. Imports
the wire layer, never Ray, the engine, the coordinator or a backend.

Modules:

- ``client``: the thread-based :class:`Client`, its public API and validation;
- ``sockets``: its ZMQ sockets, used by whichever thread holds its lock;
- ``turns``: how its threads, the IO thread included, take turns on the sockets;
- ``router``: the request table (choose a rank, deliver, fail over, migrate streams, follow scale changes);
- ``sending``: putting requests on their ranks' sockets (numbering, size checks, booking);
- ``feed``: the coordinator's snapshots as this client hears them (decoded, timed);
- ``requests``: request handles, futures and streams;
- ``balancer``: which rank gets the next request;
- ``prefix``: the prefix policy's rank order for a prompt prefix;
- ``adapters``: this client's picture of which ranks hold which LoRA adapters;
- ``pools``: P/D pools: which pool a request's next send goes to;
- ``cache_index``: this client's copy of the ranks' cache pictures (the longest cached prefix of a prompt);
- ``membership``: which ranks exist, died or came back, from the coordinator's snapshots;
- ``calls``: utility calls waiting for their engine's answer;
- ``aio``: :class:`AsyncClient`, the asyncio front-end for API servers.
"""

from raydp.client.aio import AsyncClient
from raydp.client.client import Client

__all__ = ["AsyncClient", "Client"]

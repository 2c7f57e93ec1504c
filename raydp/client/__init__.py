"""Front-ends: send requests to the ranks and demultiplex their outputs.

Owns the thread-based :class:`Client` (``client``), its sockets (``sockets``),
how its threads take turns on them, its IO thread included (``turns``), the
request table (``router``), request handles (``requests``), the load-balancing choice
(``balancer``, with the prefix policy's rank order in ``prefix``), which ranks exist
(``membership``), utility calls in flight (``calls``) and the asyncio
:class:`AsyncClient` (``aio``). Usable from a
driver, a notebook, a Ray Job or an API server process. Imports the wire
layer, never Ray, the engine, the coordinator or a backend.
"""

from raydp.client.aio import AsyncClient
from raydp.client.client import Client

__all__ = ["AsyncClient", "Client"]

"""One DP rank's engine runtime: the engine core protocol and the loop that drives it.

Imports the wire layer, never Ray, the coordinator, the client, a backend or
the engines in :mod:`raydp.models`, which it loads by path
(``raydp.models.echo:EchoEngine`` and ``raydp.models.tiny_lm:TinyLMEngine`` are
the paths to pass as ``engine=``).

Modules:

- ``core``: the :class:`EngineCore` protocol users implement, its ``EngineContext``, and loading
  engine classes by path;
- ``executor``: what an engine sees of its device workers, and what a worker implements;
- ``host``: one rank in any process (build the engine, handshake, run the loop);
- ``loop``: the per-rank step loop;
- ``watchdog``: the loop on a thread of its own, watched for a turn that outlives ``step_timeout_s``;
- ``sockets``: its sockets and how it waits on them;
- ``adapter_report``: sending the LoRA adapters an engine holds to the coordinator;
- ``cache_report``: sending an engine's prefix-cache events to the coordinator;
- ``outbox``: its non-blocking sends to clients;
- ``waves``: lockstep wave bookkeeping;
- ``lockstep``: a rank's waves, all-reduce, holds and regroups;
- ``collective``: the gloo DP group and its rendezvous;
- ``gloo_interface``: which network interface gloo binds to.
"""

from raydp.engine.core import EngineContext, EngineCore

__all__ = ["EngineContext", "EngineCore"]

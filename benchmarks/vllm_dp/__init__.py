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

Systems (``--system``): ``raydp``; ``vllm`` (its own ``--data-parallel-size 2``,
mp); ``vllm-ray`` (the same with ``--data-parallel-backend ray``, the seeds'
system, which does not start on CPU: its turn reports vLLM's own error);
``serve-llm`` (Ray Serve LLM's ``build_dp_openai_app``, :mod:`.serve_llm`).

Load: vLLM's own load generator, ``vllm bench serve`` unchanged
(:mod:`.bench_serve`), on two workloads (``--dataset``): ``random`` (random
prompts of ``--prompt-len`` tokens, ``--max-tokens`` out, ignore_eos) and
``prefix`` (vLLM's ``prefix_repetition``: 8 shared prefixes of 96 tokens);
``--size tiny`` (default, where the plumbing shows) or ``compute`` (8 layers,
hidden 1024, the corpus's whole BPE vocabulary: about 90 M parameters, where
the engine dominates). Its figures: output tokens/s, TTFT p50 and p99, ITL and
end-to-end p50.

Fairness: the systems never run at once; they take turns (raydp, vLLM, raydp,
vLLM, ...), each turn a fresh server start and a few warm-up requests before
the measured ones; the table shows medians over the turns. Startup is from
spawning the server command to its first successful completion.

Fault row (one more turn per system unless ``--no-faults``): under the same
closed-loop load, SIGKILL rank 1's engine process (raydp: the Ray actor titled
``raydp::<name> dp1 ...``; vLLM: ``VLLM::EngineCore_DP1``) and watch for up to
``--fault-window`` seconds: the requests in flight that failed, whether
requests started after the kill succeed, the time to the first such success,
and, for raydp, the time until the restarted rank is live again (its
``/metrics``). Every server is stopped in a ``finally`` (SIGTERM, then SIGKILL to
its process group and every descendant seen), and runs under a small
supervisor that stops it if the bench itself dies, so nothing is left running.

The hang turn's injection (and the wedge bench's) is ``hang_hook/sitecustomize.py``: not a module
of this package, but a folder put first on the servers' ``PYTHONPATH``.

Modules:

- ``bench``: the whole benchmark: every system's turns, then the fault and hang turns;
- ``run``: one turn;
- ``faults``: the fault turns: a killed engine, a hung worker;
- ``table``: the table;
- ``bench_serve``: ``vllm bench serve`` against one server, its result;
- ``serve_llm``: Ray Serve LLM's data-parallel app, as a server process;
- ``load``: readiness, warm-up and the fault turn's load (streamed completions in a closed loop);
- ``servers``: starting a server under a supervisor, and stopping it for sure;
- ``pd``: a benchmark of its own (``python -m benchmarks.vllm_dp.pd``): P/D pools against collocated DP=2
  under long prompts mixed with short chats;
- ``wedge``: a benchmark of its own (``python -m benchmarks.vllm_dp.wedge``): a startup whose model load
  never ends, raydp's ``serve`` against vLLM's own DP server;
- ``loras``: a benchmark of its own (``python -m benchmarks.vllm_dp.loras``): adapter-aware routing against
  least-loaded and round robin, under ``vllm bench serve``'s LoRA options;
- ``lora_bound``: the fewest adapter loads any routing could reach on ``loras``'s workload (a count, no
  engines: least-loaded, raydp's rule and a clairvoyant bound on the same request sequences).
"""

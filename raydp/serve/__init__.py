"""HTTP front-ends: an OpenAI-compatible API, served by N processes sharing one listening socket.

Each process builds a :mod:`raydp.client` client from the cluster's endpoints;
no Ray runs in them. For vLLM engines a process runs vLLM's own OpenAI
front-end over raydp's ranks (``vllm_server``, ``vllm_core``); for every other
engine, raydp's own small server, whose text goes through a :mod:`raydp.text`
tokenizer. Imports the client, :mod:`raydp.text`, :mod:`raydp.models` (the
vLLM codec), :mod:`raydp.backend` and :mod:`raydp.processes`; never Ray or a
backend.

Modules:

- ``app``: ``build_app``, the Starlette app over one client;
- ``completions``: ``POST /v1/completions`` and ``POST /v1/generate``;
- ``chat``: ``POST /v1/chat/completions``, over the tokenizer's chat template;
- ``generation``: one generation as a route serves it (deadline, typed errors, metrics, hang-ups);
- ``text_answer``: text answers, whole or streamed, cut at stop strings;
- ``bodies``: request bodies, parsed with errors that name the field;
- ``api_errors``: errors in OpenAI's shape, with the status that fits;
- ``api_keys``: the bearer-key check, as ASGI middleware;
- ``responses``: JSON bodies and server-sent events;
- ``metrics``: Prometheus metrics of one API server process;
- ``readiness``: ``GET /ready``, a one-token probe of every rank (a route, or middleware in vLLM's app);
- ``rank_series``: raydp's per-rank series, described once: read at scrape time (raydp's server) or
  pushed into the default registry (vLLM's front-end, multiprocess mode included);
- ``server``: uvicorn on a socket that N processes share, over HTTP or HTTPS;
- ``protocol``: uvicorn's h11 protocol with the connection timers uvicorn lacks;
- ``settings``: ``ServerSettings``, and ``ServeEnvironment`` (``RAYDP_API_KEY``);
- ``draining``: stopping a server without cutting its requests off;
- ``processes``: ``APIServerProcessManager``, N API server processes, respawned when one dies;
- ``metrics_dir``: the multiprocess-metrics directory they share, removed by the next manager if its owner was killed;
- ``vllm_server``: vLLM's own OpenAI server in an API server process, over raydp's ranks;
- ``vllm_core``: ``RaydpCoreClient``, vLLM's engine core client over raydp's client (routing,
  outputs, aborts, utility calls, retries and stream migration);
- ``vllm_loras``: LoRA adapters across N API servers: one numbering for the ranks, and a resolver that
  finds an adapter another server loaded;
- ``vllm_unloads``: LoRA unloads made the cluster's (every rank forgets, every server drops the name);
"""

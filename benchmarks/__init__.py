"""Side-by-side benchmarks of raydp against its floor and against Ray's own paths.

Run as ``.venv/bin/python -m benchmarks [--quick] [--only SECTION] [--skip SECTION]
[--json out.json] [--plot DIR]`` from the repository's root (``--only`` and
``--skip`` repeat or take a comma list). It starts its own local Ray (4
logical CPUs, 4 logical GPUs) and needs no cluster.

Only the RATIOS mean anything: every system runs in the same process, on the
same machine, minutes apart, so a shared or slow machine moves all of them
together. Ten benchmarks (sections ``round-trips``, ``lockstep``, ``http``,
``workers``, ``scale``, ``startup``, ``coordinator``, ``routing``, ``adapters``, ``faults``):

1. request round trips (:mod:`~benchmarks.roundtrip`; tiny prompt, ``max_tokens=1``), pipelined (a window
   of requests in flight) and sequential (one at a time: p50 latency), for
   raydp (DP=2; same-node IPC, and TCP with and without CURVE), raw ZeroMQ +
   msgspec with 2 server processes (the floor),
   plain Ray actor calls, the same actors in STRICT_PACK placement groups,
   and Ray Serve with 2 replicas;
2. lockstep overhead (:mod:`~benchmarks.lockstep`): the step rate of a busy DP=2 cluster in lockstep mode
   (with and without a per-step all-reduce in the engine) against the same
   cluster in dense mode. ``EchoEngine(step_delay_s=...)`` sleeps in each step
   to stand in for device time; ``step_delay_s=0`` is the worst case;
3. the HTTP front-end (:mod:`~benchmarks.frontend`): OpenAI ``/v1/completions``
   throughput and p50/p99 latency, plain and streamed (time to first token),
   of raydp's 4 API servers against a Ray Serve HTTP deployment with the same
   echo engine and replica count;
4. device workers (:mod:`~benchmarks.workers`): the per-step round trip of one
   rank's workers (broadcast a small step input, gather the driver worker's
   output) at world sizes 1, 2 and 4, through raydp's channel
   (``RayExecutor``), a plain Ray actor call per worker, and a Ray Compiled
   Graph over the same actors, against a direct in-process call (the floor);
5. elastic scaling (:mod:`~benchmarks.scale`): the time to add one rank and to
   remove one (DP 2 -> 3 -> 2), dense and lockstep, against a fresh launch of
   DP=3 and a bare Ray actor started in a new placement group;
6. startup (:mod:`~benchmarks.scale`): the time until a new DP=4 cluster answers a
   request, dense and lockstep, against 4 bare torch-importing Ray actors
   started together in 4 STRICT_PACK groups;
7. the coordinator at scale (:mod:`~benchmarks.coordinator`, no Ray): the real
   coordinator loop against 64, 256 and 1,024 simulated engines sending
   stats through real sockets; its CPU share and the snapshot lag (p50/p99)
   from a stats change to a client seeing it. ``--only coordinator`` starts no Ray;
8. routing under skew (:mod:`~benchmarks.routing`): p50/p99 latency and each
   rank's share for raydp's balancer, round robin and power-of-two choices,
   with arrivals from 2 API server processes and a driver client, on a
   skewed (10% long requests) and a uniform workload;
9. adapter-aware routing (:mod:`~benchmarks.adapters`, no Ray): adapter loads, time to first
   token and throughput for routing to an adapter's holders, against adapter-blind least-loaded and
   round robin, with 8 adapters of Zipf popularity over 2 ranks of 2 slots each;
10. failures (:mod:`~benchmarks.faults.dense`, its own 2-node Ray in a process of its
   own): per fault (kill a rank, a worker, the coordinator, an API server;
   remove a node; kill a lockstep rank), the time until it is detected and
   until the cluster serves again, and the requests lost under a light load;
   ``faults-extra`` (:mod:`~benchmarks.faults.extra`, not in the default run: it
   needs root for network namespaces) adds a partitioned node, SIGTERM on
   ``raydp serve`` and ``ray job stop``.

``vllm`` (:mod:`~benchmarks.vllm_dp`, not in the default run either: minutes of vLLM
starts) is the LLM-level anchor: raydp with vLLM engines at DP=2 against
vLLM's own ``--data-parallel-size 2`` server, same checkpoint and streamed
workload, plus a killed engine under load.

``autoscale`` (:mod:`~benchmarks.autoscale`, opt-in) runs a step load against an
autoscaled cluster, a fixed minimum and a fixed maximum. ``prefix``
(:mod:`~benchmarks.prefix_cache`, opt-in) compares prefix-cache-aware routing
with the load-only policies and an oracle on vLLM engines. ``gang``
(:mod:`~benchmarks.gang`, opt-in) times a lockstep gang's restart after one
rank's death.

It prints the environment, the exact command and markdown tables, and exits
0 when every measurement ran (1 if one failed; the tables say which).

Modules:

- ``roundtrip``: request round trips (section ``round-trips``, alias ``roundtrip``);
- ``lockstep``: lockstep overhead;
- ``adapters``: adapter-aware routing;
- ``frontend``: the HTTP front-end (section ``http``);
- ``workers``: device workers' per-step round trip;
- ``scale``: elastic scaling and startup (sections ``scale`` and ``startup``);
- ``coordinator``: the coordinator at scale;
- ``routing``: routing under skew;
- ``faults``: the failure tables (``faults``, ``faults-extra``);
- ``gang``: a lockstep gang's restart;
- ``autoscale``: autoscaling under a step load, against a fixed minimum and a fixed maximum (opt-in, ``mp`` backend);
- ``prefix_cache``: prefix-cache-aware routing on vLLM engines (section ``prefix``, opt-in, ``mp`` backend);
- ``vllm_dp``: vLLM engines against vLLM's own data-parallel server (section ``vllm``);
- ``sections``: each section's run, table and JSON, by name;
- ``report``: the environment, the printed report, the JSON;
- ``common``: sizes, constants, the ratio format, progress logs;
- ``plot``: ``--plot``, the printed tables drawn as PNG charts.
"""

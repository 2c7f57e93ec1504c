"""Support for raydp's tests and tools: not public API, and free to change with them.

It ships with raydp so that Ray workers, job drivers and the benchmarks can
import it wherever raydp is installed; raydp itself never imports it (it is
the top layer). The chaos soak runs as ``python -m raydp.testing.chaos``.

Modules:

- ``chaos``: the seeded chaos soak: steady load while random faults hit a cluster, every request accounted for;
- ``chaos_vllm``: the chaos soak's vLLM mode (``--hosts vllm``): a hangable vLLM engine, the answers to check;
- ``chaos_report``: the soak's ledger, its JSON report and what it prints;
- ``hangs``: engines that hang on purpose (in a step, a dummy batch, while starting, in vLLM's executor);
- ``serve_cli``: ``raydp serve`` run as a user runs it: its banner, URL, rank processes, probes and end;
- ``faults``: fault injectors against a running cluster, and the probes that time detection and recovery;
- ``fault_load``: steady driver and HTTP load that records how every request ended;
- ``leftovers``: what a closed cluster left behind (actors, placement groups, socket directories);
- ``http_call``: one HTTP request on a thread of its own, judged after the server was stopped or killed;
- ``netns``: hosts with their own IPs on one machine, made of Linux network namespaces;
- ``ray_hosts``: Ray nodes as processes of their own (``ray start --block``), on such hosts;
- ``netns_ray``: a Ray over namespace hosts that can partition a host and replace it;
- ``fake_autoscaler``: a Ray whose autoscaler adds and removes local nodes (Ray's fake multi-node provider).
"""

"""The control sequences of a cluster, written once for every backend, in plain Python.

Starting a cluster, restarting a dense rank, restarting a lockstep gang,
restarting the coordinator, and scaling up or down run here against a small
runtime interface (spawn, kill, wait, call, remove a placement), which
:mod:`raydp.actors` implements over Ray and :mod:`raydp.local` over local
processes; the property tests drive the same sequences over a model. Nothing
here imports Ray or assumes which process it runs in.

Modules:

- ``core``: ``Orchestrator``, which builds a cluster's state and controls, starts it, and routes deaths to policies;
- ``state``: ``ClusterState``, the cluster's shared facts, changed only through named transitions;
- ``controls``: ``Controls``, what each policy gets (never the orchestrator itself);
- ``ranks``: the rank table, one ``RankRecord`` per rank;
- ``reports``: ``DeathReports``, a death told to the coordinator and then to the listeners;
- ``owned``: ``OwnedResources``, what a launch owns on the launching side, released once;
- ``runtime``: the ``Runtime`` interface the backends implement;
- ``restart``: restarting one dense rank (the one restart procedure of both backends);
- ``budget``: a dense rank's restart budget: restarts per sliding window, and the backoff before each;
- ``gang``: restarting a lockstep gang;
- ``coordinator_restart``: restarting the coordinator at its addresses;
- ``scaling``: growing and shrinking a running cluster, step by step;
- ``pools``: a P/D cluster's pool sizes after one pool's change, and the order of the steps;
- ``autoscaling``: the load-driven autoscaling policy (pure) and the loop that applies it;
- ``silence``: ``SilenceWatch``, which ends a rank frozen whole (silent to the coordinator) as hung.
"""

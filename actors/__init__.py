"""The Ray backend (installed as ``raydp.actors``): a cluster as Ray actors.

:class:`~raydp.actors.manager.ActorManager` implements
:class:`raydp.backend.Backend` on Ray for a cluster it launches,
:class:`~raydp.actors.attached.AttachedBackend` for one launched elsewhere.
With :mod:`raydp.placement`'s ``live`` and ``groups`` it holds every Ray call
of raydp (``docs/architecture.md``, "Layering"). Imports placement and the
layers below it, never :mod:`raydp.local`. Only :mod:`raydp.api` and the CLI
choose it.

Modules:

- ``manager``: ``ActorManager``, the Ray backend of a cluster it launches, over the shared orchestration;
- ``runtime``: ``RayRuntime``, the orchestration's runtime over Ray actors and placement groups;
- ``engine``: ``EngineCoreActor``, one DP rank as a Ray actor around the engine host;
- ``coordinator``: ``CoordinatorActor``, the named actor that hosts a cluster's coordinator;
- ``joining``: ranks joining at launch, restart or scale-up (handshake, DP rendezvous, subscription);
- ``slots``: where each rank runs (its placement group, node and devices) and the device probes;
- ``watch``: watching ``run()`` refs, whose end means a death;
- ``deaths``: turning what Ray says about a finished ref into a typed death cause;
- ``supervisor``: ``SupervisorActor``, a detached cluster's supervision inside the cluster, and the
  launcher's ``SupervisedBackend``;
- ``attached``: ``AttachedBackend``, a handle's backend on a cluster another process launched (``raydp.attach``),
  and what ``raydp status`` reads;
- ``owned``: what a launch created and must release, once;
- ``terminate``: ending actors, and clusters this process did not launch;
- ``connection``: joining Ray (the given cluster, the ambient one, or a local one);
- ``metrics``: Ray metrics from the coordinator and the engines;
- ``api_servers``: API servers hosted on another node (hybrid and external modes);
- ``workers``: a rank's device workers as Ray actors (``WorkerActor``, ``RayExecutor``).
"""

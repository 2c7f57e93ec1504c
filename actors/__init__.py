"""The Ray backend (installed as ``raydp.actors``): a cluster as Ray actors.

Owns :class:`~raydp.actors.manager.ActorManager` (``manager``), which
implements :class:`raydp.backend.Backend`; the engine core and coordinator
actors (``engine``, ``coordinator``); where each rank runs (``slots``);
watching ``run()`` refs and classifying deaths (``watch``, ``deaths``); what
a launch owns and releases (``owned``); ending actors and foreign clusters
(``terminate``); and joining a Ray cluster (``connection``). Every Ray call
of raydp outside :mod:`raydp.placement` is here. Imports placement and the
layers below it, never :mod:`raydp.local`. Only :mod:`raydp.cluster` and the
CLI choose it.
"""

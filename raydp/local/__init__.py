"""The multiprocessing backend: a cluster as local processes, no Ray.

:class:`ProcessManager` (``launch(backend="mp")``) spawns the coordinator and
one process per rank on this machine and implements
:class:`raydp.backend.Backend`. May import the wire, engine, coordinator and
client layers, :mod:`raydp.orchestration`, :mod:`raydp.backend` and :mod:`raydp.processes`; never Ray, and
never :mod:`raydp.actors`. Only :mod:`raydp.cluster` and the CLI choose it.

Modules:

- ``manager``: ``ProcessManager``, the mp backend over the shared orchestration;
- ``runtime``: ``ProcessRuntime``, the orchestration's runtime over local processes;
- ``children``: the child processes' entry points (a rank, the coordinator);
- ``control``: the coordinator's control pipe: numbered questions, their answers, late ones dropped;
- ``executor``: ``MPExecutor``, a rank's device workers as child processes of its engine.
"""

from raydp.local.manager import ProcessManager

__all__ = ["ProcessManager"]

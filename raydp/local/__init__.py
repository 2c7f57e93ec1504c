"""The multiprocessing backend: a cluster as local processes, no Ray.

Owns :class:`ProcessManager` (``launch(backend="mp")``), which spawns the
coordinator and one process per rank on this machine and implements
:class:`raydp.backend.Backend`. May import the wire, engine, coordinator and
client layers, :mod:`raydp.backend` and :mod:`raydp.processes`; never Ray, and
never :mod:`raydp.actors`. Only :mod:`raydp.cluster` and the CLI choose it.

Modules: ``manager`` (the backend, its child entry points and control pipe).
"""

from raydp.local.manager import ProcessManager

__all__ = ["ProcessManager"]

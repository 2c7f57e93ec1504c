"""Device workers inside a rank: the per-step channel, a worker's runtime, the driver-side executor.

Owns the channel between an engine core and its workers (``channel``: Unix
sockets on one node, CURVE TCP across nodes), what runs in each worker
process (``runtime``: join the device group, build the user's worker class,
answer calls), and the executor both backends build on (``executor``:
``ChannelExecutor``). The backends start the processes:
``raydp.actors.workers`` (Ray actors) and ``raydp.local.executor`` (child
processes). Imports the engine and wire layers, never Ray or a backend.
"""

"""Device workers inside a rank: the per-step channel, a worker's runtime, the driver-side executor.

The backends start the processes: ``raydp.actors.workers`` (Ray actors) and
``raydp.local.executor`` (child processes). Imports the engine and wire
layers, never Ray or a backend.

Modules:

- ``channel``: the channel between an engine core and its workers (Unix sockets on one node,
  CURVE TCP across nodes);
- ``runtime``: one worker in any process (join the device group, build the worker class, answer calls);
- ``executor``: ``ChannelExecutor``, the driver side both backends build on.
"""

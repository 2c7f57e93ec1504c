"""The coordinator: per-rank load, request waves and START_DP_WAVE.

Imports the wire layer, never Ray, the engine, the client or a backend; the
Ray actor that hosts it lives in :mod:`raydp.actors`, the process that hosts
it in :mod:`raydp.local`.

Modules:

- ``state``: the pure state machine (counts, waves, dead ranks, size, snapshot timing);
- ``publish``: the snapshot clients get and the status operators get, built from the state;
- ``cache``: each rank's prefix-cache picture, and the numbered changes the snapshots carry;
- ``hold``: holding a lockstep gang at a wave boundary while its DP group re-forms;
- ``resync``: what a restarted coordinator restores from its launcher and relearns from the engines;
- ``silence``: when the coordinator last heard from each rank (a frozen rank goes silent);
- ``loop``: the socket loop around the state machine;
- ``client``: the PUSH client a launcher uses to report deaths, restarts and scale changes.
"""

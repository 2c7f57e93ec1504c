"""The coordinator: per-rank load, request waves and START_DP_WAVE.

Owns the pure state machine (``state``: counts, waves, dead ranks, snapshot
timing), the socket loop around it (``loop``) and the PUSH client a launcher
uses to report deaths and restarts (``client``). Imports the wire layer,
never Ray, the engine, the client or a backend; the Ray actor that hosts it
lives in :mod:`raydp.actors`, the process that hosts it in :mod:`raydp.local`.
"""

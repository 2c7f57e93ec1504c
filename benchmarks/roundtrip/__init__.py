"""The round-trip table: tiny requests through raydp, its floors, Ray actor calls and Ray Serve.

Modules:

- ``turns``: the run (the ZeroMQ-class systems side by side, taking turns; Ray's alone) and the table;
- ``targets``: the systems under test (raydp, raw ZeroMQ + msgspec, Ray actors, Ray Serve) and the request loops;
- ``pipe``: the second floor (one PUSH/PULL pipe) and raydp's ``submit_many`` runner.
"""

"""The HTTP front-end table: raydp's API servers against a Ray Serve HTTP deployment.

Modules:

- ``compare``: both systems, the benchmark and its table;
- ``load``: the load generator (its own process, aiohttp) and the sizes.
"""

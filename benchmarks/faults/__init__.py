"""The failure tables: per fault, the time until it is detected and until the cluster serves again; requests lost.

Modules:

- ``table``: a row, the table, a row's tally, and running rows in a process of their own;
- ``dense``: the ``faults`` section (killed ranks, workers, coordinator, API server; a removed node);
- ``extra``: the opt-in ``faults-extra`` section (a partitioned host, SIGTERM, ``ray job stop``);
- ``partition``: the partitioned namespace host row;
- ``stop``: the SIGTERM on ``raydp serve`` and ``ray job stop`` rows.
"""

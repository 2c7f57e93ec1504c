"""The rank table: one typed record per rank, owned by one class.

A rank's state used to sit in parallel collections (slots, engines, groups,
devices, capacity, run refs) that every sequence trimmed one by one. Here it
is one :class:`RankRecord` per rank, and the sequences ask the table for the
ranks they act on. Ranks stay dense: ``0..len(table)-1``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class RankRecord:
    """Where one rank runs and what it is running as.

    ``group`` is the backend's placement handle (a Ray placement group; None on
    the ``mp`` backend), ``owns_group`` whether raydp made it (and may re-place
    it), ``handle`` the actor or process, ``run_ref`` what its death is watched
    by (a Ray ``run()`` ref; the process itself on ``mp``).
    """

    rank: int
    node_id: str
    local_rank: int = 0
    group: Any = None
    owns_group: bool = True
    handle: Any = None
    run_ref: Any = None
    devices: tuple[str, ...] = ()
    capacity: int = 0
    restarts: int = 0


class RankTable:
    """The ranks of one cluster, dense from 0; every change holds :attr:`lock`."""

    def __init__(self, records: Iterable[RankRecord] = ()) -> None:
        self.lock = threading.RLock()
        self._records: list[RankRecord] = []
        self.extend(records)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RankRecord]:
        return iter(list(self._records))

    def __getitem__(self, rank: int) -> RankRecord:
        return self._records[rank]

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < len(self._records)

    def extend(self, records: Iterable[RankRecord]) -> None:
        """Append ranks; each must be the next one."""
        with self.lock:
            for record in records:
                if record.rank != len(self._records):
                    raise ValueError(f"rank {record.rank} added to a table of {len(self._records)} ranks")
                self._records.append(record)

    def replace(self, record: RankRecord) -> None:
        with self.lock:
            self._records[record.rank] = record

    def truncate(self, size: int) -> list[RankRecord]:
        """Drop the ranks from ``size`` up (a scale-down) and return them."""
        with self.lock:
            gone, self._records = self._records[size:], self._records[:size]
            return gone

    def ranks(self) -> list[int]:
        return list(range(len(self._records)))

    def handles(self) -> list[Any]:
        return [r.handle for r in self._records]

    def capacity(self, ranks: Iterable[int]) -> int:
        return sum(self._records[r].capacity for r in ranks if r < len(self._records))

"""Settings for the whole suite."""

from __future__ import annotations

from hypothesis import settings

# Properties check behaviour, not speed: hypothesis' default 200 ms deadline per example
# would fail a correct test on a slow or busy machine, so no test of the suite has one.
settings.register_profile("raydp", deadline=None)
settings.load_profile("raydp")

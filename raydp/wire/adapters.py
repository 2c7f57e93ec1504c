"""LoRA adapters as every process names them, and what a rank reports of the ones it holds.

An adapter is named by the string a request names it by (vLLM's
``lora_name``, the ``model`` of an OpenAI request). A rank holds a few of
them at once (vLLM's ``max_loras``); loading one more evicts the least
recently used. Ranks report which they hold (:class:`AdapterState`) so that a
client sends an adapter's requests where it is already loaded, and loads it
somewhere new only when its holders are busy (:mod:`raydp.client.adapters`).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from raydp.wire.codec import WireMessage

MAX_ADAPTER_NAME: Final = 256  # characters; a request naming a longer adapter is refused
MAX_RESIDENT: Final = 1024  # adapters in one report: a peer cannot make a decoder allocate without end
AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADAPTER_NAME)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class AdapterState(WireMessage):
    """The adapters one rank holds, least recently used first, and its counts since it started.

    ``slots``: how many it can hold at once. ``loads``: adapters it loaded
    (an eviction, when it was full, came with each load past ``slots``);
    ``requests`` and ``hits``: requests naming an adapter, and those whose
    adapter it already held when they arrived. ``known``: the adapters it was
    given by name and path (vLLM's ``add_lora``), held or not: where an API
    server finds an adapter another server loaded. ``unloaded``: adapters an
    API server unloaded (vLLM's ``/v1/unload_lora_adapter``) and nobody
    loaded again since: every API server forgets them too.
    """

    resident: Annotated[list[AdapterName], msgspec.Meta(max_length=MAX_RESIDENT)] = []
    slots: Count = 0
    loads: Count = 0
    evictions: Count = 0
    requests: Count = 0
    hits: Count = 0
    known: Annotated[dict[AdapterName, str], msgspec.Meta(max_length=MAX_RESIDENT)] = {}
    unloaded: Annotated[list[AdapterName], msgspec.Meta(max_length=MAX_RESIDENT)] = []


def check_adapter_name(adapter: object) -> str | None:
    """Why ``adapter`` cannot name an adapter ("" names none), or None if it can."""
    if not isinstance(adapter, str):
        return f"adapter={adapter!r}: must be a str (an adapter's name; '' for the base model)"
    if len(adapter) > MAX_ADAPTER_NAME or not adapter.isprintable():
        return f"adapter={adapter[:40]!r}...: must be printable and at most {MAX_ADAPTER_NAME} characters"
    return None


__all__ = ["MAX_ADAPTER_NAME", "AdapterName", "AdapterState", "check_adapter_name"]

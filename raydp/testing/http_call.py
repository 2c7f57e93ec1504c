"""One HTTP request on a thread of its own, to an API server that may be stopped or killed under it."""

from __future__ import annotations

import http.client
import json
import threading
from typing import Any


class Call(threading.Thread):
    """One HTTP request on its own connection; ``started`` is set once a stream's first event is in."""

    def __init__(self, address: tuple[str, int], path: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.address, self.path, self.body = address, path, body
        self.started = threading.Event()
        self.status: int | None = None
        self.data = b""
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection(*self.address, timeout=60)
            conn.request("POST", self.path, json.dumps(self.body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if self.body.get("stream"):
                self.data = resp.readline()
                self.started.set()
            self.data += resp.read()  # IncompleteRead if the chunked body is cut off
            conn.close()
        except BaseException as exc:  # a reset, a cut-off body: what the test must not see
            self.error = exc
        finally:
            self.started.set()

"""SIGTERM on ``raydp serve`` while HTTP requests run: every client gets a whole answer, none a reset.

The echo engine sleeps 20 ms a step (``RAYDP_ENGINE_KWARGS``), so a request
for 100k tokens is still running when the signal comes; a short one finishes
within the grace period. Requests go over ``http.client``, which raises on
a reset or a cut-off chunked body, and one stream goes through the official
``openai`` SDK, which raises the error event as ``APIError``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import openai
import psutil
import pytest

from raydp.testing.http_call import Call
from raydp.testing.serve_cli import ServeProcess
from tests.integration.helpers import socket_dirs
from tests.integration.http_helpers import shutting_down

LONG = 100_000  # tokens: minutes at 20 ms a step
GRACE_S = 3.0  # the short stream below needs 0.2 s of it: room for a busy machine
SLOW_ENGINE = {"RAYDP_ENGINE_KWARGS": json.dumps({"step_delay_s": 0.02})}


def sdk_stream(url: str, model: str, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model=model, prompt=[5], max_tokens=LONG, stream=True)
        out["chunks"] = 0
        try:
            for _ in stream:
                out["chunks"] += 1
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_sigterm_answers_every_running_request_then_exits(backend: str) -> None:
    name = f"drain{backend}"
    # On Ray, a local one of its own (not a test cluster that may be running): one rank of CPU bundles.
    on_ray = ("--address", "local", "--accelerator", "CPU", "--dp-size", "1") if backend == "ray" else ()
    server = ServeProcess(
        "--backend",
        backend,
        "--name",
        name,
        "--engine",
        "echo",
        "--api-servers",
        "2",
        "--port",
        "0",
        "--graceful-shutdown-s",
        f"{GRACE_S:g}",
        *on_ray,
        env=SLOW_ENGINE,
    )
    with server:
        server.banner()
        url, address = server.url, server.address
        children = psutil.Process(server.proc.pid).children(recursive=True)
        plain = [
            Call(address, "/v1/completions", {"model": name, "prompt": [1], "max_tokens": LONG}),
            Call(address, "/v1/generate", {"prompt_token_ids": [2], "max_tokens": LONG}),
        ]
        streams = [
            Call(address, "/v1/completions", {"model": name, "prompt": [3], "max_tokens": LONG, "stream": True})
            for _ in range(2)
        ]
        sdk: dict[str, Any] = {}
        sdk_thread = sdk_stream(url, name, sdk)
        for call in streams:
            assert call.started.wait(30), "the stream started"
        deadline = time.monotonic() + 30
        while sdk.get("chunks", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        # 0.2 s of tokens left once it has started: it ends within the grace period.
        short = Call(address, "/v1/completions", {"model": name, "prompt": [4], "max_tokens": 10, "stream": True})
        assert short.started.wait(30)
        sent = time.monotonic()
        code, _, stderr = server.stop(signal.SIGTERM)
        took = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM; everything was shut down" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    # Not before the grace is over, and long before the 100,000-token requests could have ended (2,000 s).
    assert GRACE_S <= took < GRACE_S + 60, f"exit {took:.1f}s after SIGTERM"

    for call in [*plain, *streams, short]:
        call.join(timeout=10)
        assert call.error is None, f"{call.path} {call.body}: {call.error!r}"
    assert short.status == 200 and short.data.endswith(b"data: [DONE]\n\n"), "one that ends within the grace does"
    tokens = [t for e in short.data.decode().split("\n\n")[:-2] for t in json.loads(e[6:])["choices"][0]["token_ids"]]
    assert tokens == [4] * 10
    for call in plain:
        assert call.status == 503 and shutting_down(json.loads(call.data), GRACE_S), call.data
    for call in streams:
        assert call.status == 200
        events = [e for e in call.data.decode().split("\n\n") if e]
        assert len(events) > 1 and b"[DONE]" not in call.data
        assert shutting_down(json.loads(events[-1].removeprefix("data: ")), GRACE_S), events[-1]
    sdk_thread.join(timeout=10)
    assert isinstance(sdk.get("error"), openai.APIError), sdk
    assert "shutting down" in str(sdk["error"]) and sdk["chunks"] >= 1

    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [p for p in alive if p.name() != "raylet"], f"left behind: {alive}"
    assert socket_dirs(name) == []

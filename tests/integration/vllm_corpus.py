"""The request corpus of the differential tests against vLLM's own server, and vLLM's answers to it.

Each body goes to both servers one at a time; answers are compared field by
field with ids and timestamps left out and floats rounded (:func:`normal`).
vLLM's own server answers the corpus once per test session
(:func:`vllm_corpus_answers`): every module that compares with it shares
that one run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from tests.integration.vllm_helpers import SERVE_FLAGS, computed_once, fingerprint, lora_adapter, vllm_serve

MODEL = "m"  # --served-model-name: every vLLM client names its model
LORA_PROMPT = {"prompt": "Once upon", "max_tokens": 10, "temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CHAT = [{"role": "user", "content": "Hello there"}]
# (name, path, body): completions and chat, the sampling fields, structured outputs, tools, utilities, errors.
CORPUS: list[tuple[str, str, dict[str, Any] | None]] = [  # a body of None: GET
    ("greedy", "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}),
    ("multibyte", "/v1/completions", {"prompt": "héllo wörld ✓ 日本語", "max_tokens": 12, "temperature": 0}),
    ("token ids", "/v1/completions", {"prompt": [5, 17, 99, 300], "max_tokens": 8, "temperature": 0}),
    ("logprobs", "/v1/completions", {"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 3}),
    (
        "echo+prompt_logprobs",
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "echo": True, "prompt_logprobs": 2},
    ),
    ("n=2 seeded", "/v1/completions", {"prompt": "Hi", "max_tokens": 8, "n": 2, "seed": 7, "temperature": 0.9}),
    (
        "penalties",
        "/v1/completions",
        {
            "prompt": "a a a a",
            "max_tokens": 10,
            "temperature": 0,
            "repetition_penalty": 1.3,
            "frequency_penalty": 0.6,
            "presence_penalty": 0.4,
        },
    ),
    (
        "min_tokens+logit_bias",
        "/v1/completions",
        {"prompt": "Stop", "max_tokens": 8, "min_tokens": 6, "temperature": 0, "logit_bias": {"42": 5.0}},
    ),
    ("stop", "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "stop": ["e"]}),
    (
        "choice",
        "/v1/completions",
        {"prompt": "Yes or no?", "max_tokens": 5, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
    ),
    (
        "regex",
        "/v1/completions",
        {"prompt": "A number:", "max_tokens": 6, "temperature": 0, "structured_outputs": {"regex": "[0-9]{3}"}},
    ),
    ("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0}),
    (
        "chat logprobs",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ),
    (
        "json_schema",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 20,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        },
    ),
    (
        "json_object",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 12, "temperature": 0, "response_format": {"type": "json_object"}},
    ),
    (
        "named tool",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 20,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    # LoRA: one adapter named on the command line, one loaded at run time (both made with peft, here).
    ("base", "/v1/completions", {"prompt": "Once upon", "max_tokens": 10, "temperature": 0}),
    ("lora by name", "/v1/completions", {"model": "ad1", **LORA_PROMPT}),
    ("lora load", "/v1/load_lora_adapter", {"lora_name": "ad2", "lora_path": "{ad2}"}),
    ("lora loaded", "/v1/completions", {"model": "ad2", **LORA_PROMPT}),
    # Longer than a KV block (128 tokens on the CPU): what a P/D prefill stores and its decode loads.
    (
        "long prompt",
        "/v1/completions",
        {"prompt": [(7 * k) % 900 + 5 for k in range(300)], "max_tokens": 8, "temperature": 0, "logprobs": 2},
    ),
    ("models", "/v1/models", None),
    ("tokenize", "/tokenize", {"prompt": "héllo there"}),
    ("detokenize", "/detokenize", {"tokens": [5, 17, 99, 300]}),
    # Errors: raydp's status codes and error shapes must be vLLM's.
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
    ("too long", "/v1/completions", {"prompt": [7] * 600, "max_tokens": 2}),
    ("bad field", "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": -1}),
    (
        "bad schema",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
    ),
    ("id past the tokenizer", "/v1/completions", {"prompt": [400, 450], "max_tokens": 3, "temperature": 0}),
]
STREAMED = [("stream", "/v1/completions", {"prompt": "héllo wörld", "max_tokens": 10, "temperature": 0})]
DROPPED = {"created", "system_fingerprint"}  # differ between any two answers, by design
RANDOM_ID = re.compile(r"[a-z]+(-[a-z]+)*-[0-9a-f]{8,}")  # cmpl-..., chatcmpl-..., modelperm-...: not model ids
RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # vLLM's switch for /v1/load_lora_adapter


def corpus_adapters(model: Path) -> dict[str, str]:
    """The corpus's LoRA adapters, made with peft on the test model (cached on disk)."""
    return {name: str(lora_adapter(model, name)) for name in ("ad1", "ad2")}


def corpus_flags(adapters: dict[str, str]) -> list[str]:
    """What both servers run with: the engine's flags, the served name, and LoRA as vllm serve takes it."""
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"ad1={adapters['ad1']}"]
    return [*SERVE_FLAGS, "--served-model-name", MODEL, *lora]


_answers: dict[str, dict[str, Any]] = {}  # vLLM's answers, by the flags its server ran with


def vllm_corpus_answers(model: Path, flags: list[str], adapters: dict[str, str]) -> dict[str, Any]:
    """vLLM's own server's answers to the whole corpus: once per machine for these flags, to spare the 2 cores."""
    key = json.dumps(flags)
    if key not in _answers:

        def ask_vllm() -> dict[str, Any]:
            with vllm_serve(model, *flags, env=RUNTIME_LORA) as url:
                return ask_all(url, adapters)

        what = [key, json.dumps([CORPUS, STREAMED, adapters]), *fingerprint(model, *map(Path, adapters.values()))]
        _answers[key] = computed_once(model.parent / "vllm-corpus", what, ask_vllm)
    return _answers[key]


def ask_all(url: str, adapters: dict[str, str]) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as http:
        for name, path, body in CORPUS:
            if body is None:
                answers[name] = answer(http.get(path))
                continue
            named = {"model": MODEL, **body} if path.startswith(("/v1/completions", "/v1/chat")) else body
            filled = {k: v.format(**adapters) if isinstance(v, str) else v for k, v in named.items()}
            answers[name] = answer(http.post(path, json=filled))
        for name, path, body in STREAMED:
            with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            # Chunk boundaries depend on timing, in vLLM's own server too: the text and the ending do not.
            text = "".join(choice["text"] for c in chunks for choice in c["choices"])
            answers[name] = {"text": text, "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}
    return answers


def answer(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:  # some routes answer plain text (/v1/load_lora_adapter)
        body = response.text
    return {"status": response.status_code, "body": normal(body)}


def normal(value: Any) -> Any:
    """Ids and times out, floats rounded (the ranks batch differently, so the last bits may differ)."""
    if isinstance(value, dict):
        return {
            k: normal(v)
            for k, v in value.items()
            if k not in DROPPED and not (k == "id" and isinstance(v, str) and RANDOM_ID.fullmatch(v))
        }
    if isinstance(value, list):
        return [normal(v) for v in value]
    if isinstance(value, float):
        return round(value, 3)
    return value

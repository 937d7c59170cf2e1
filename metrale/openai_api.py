"""The OpenAI request and response shapes ``met serve`` speaks: fields checked, bodies built.

A request body is checked field by field; the first bad one is an :class:`ApiError` with the
HTTP status and an OpenAI-style error body naming the field (``param``). Fields the server does
not use are ignored, as OpenAI-compatible servers do, unless they carry a known name with the
wrong type.

>>> parse_completion({"model": "m", "prompt": "hi", "max_tokens": -1}, "m").param
Traceback (most recent call last):
...
metrale.openai_api.ApiError: 400 max_tokens: must be an integer >= 1 (found -1)
>>> parse_completion({"model": "m", "prompt": [1, 2], "stop": "x"}, "m").stop
('x',)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from metrale.lkb.errors import ConfigError
from metrale.runtime.sampling import Sampling

__all__ = ["ApiError", "Parsed", "chunk", "error_body", "parse_chat", "parse_completion"]


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, OpenAI ``kind``, the field ``param``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                       kind, code)
        super().__init__(f"{status} {param + ': ' if param else ''}{message}")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers errors."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_config_error(e: ConfigError, status: int = 400) -> ApiError:
    """A request-level ``ConfigError`` as a 4xx: its key is the field."""
    return ApiError(status, e.message + (f" (expected {e.expected}, found {e.found})"
                                         if e.expected is not None and e.found is not None
                                         else ""), param=e.key)


@attrs.frozen
class Parsed:
    """A checked request: the prompt (text, ids or messages), limits, sampling, stream."""

    prompt: Any
    chat: bool
    max_tokens: int | None
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    seed_given: bool
    ignore_eos: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _field(body: Mapping[str, Any], name: str, check: Any, what: str) -> Any:
    v = body.get(name)
    if v is not None and not check(v):
        raise ApiError(400, f"must be {what} (found {v!r})"[:300], param=name)
    return v


def _common(body: Any, model: str, chat: bool) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(400, "must be a string naming the model", param="model")
    if name != model:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {model!r}",
                       param="model", code="model_not_found")
    n = _field(body, "n", _is_int, "an integer")
    if n not in (None, 1):
        raise ApiError(400, "only n = 1 is served", param="n")
    limit = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _field(body, limit, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    for key, lo, hi in (("temperature", 0, 100), ("top_p", 0, 1), ("min_p", 0, 1)):
        _field(body, key, lambda v, lo=lo, hi=hi: _is_num(v) and lo <= v <= hi,
               f"a number in [{lo}, {hi}]")
    _field(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1")
    _field(body, "seed", lambda v: _is_int(v) and 0 <= v < 2 ** 64, "an integer in [0, 2**64)")
    stop = _field(body, "stop", lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) and s for s in v) and len(v) <= 4),
        "a string or a list of at most 4 non-empty strings")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    opts = _field(body, "stream_options", lambda v: isinstance(v, Mapping), "an object")
    ignore_eos = _field(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean")
    top_k = body.get("top_k")
    try:
        sampling = Sampling.from_defaults(
            None, temperature=body.get("temperature"), top_p=body.get("top_p"),
            min_p=body.get("min_p"), top_k=None if top_k in (None, -1) else top_k,
            seed=body.get("seed"))
    except ConfigError as e:
        raise from_config_error(e) from None
    return {"max_tokens": max_tokens, "sampling": sampling,
            "stop": (stop,) if isinstance(stop, str) else tuple(stop or ()),
            "stream": bool(stream), "include_usage": bool((opts or {}).get("include_usage")),
            "seed_given": body.get("seed") is not None, "ignore_eos": bool(ignore_eos)}


def parse_completion(body: Any, model: str) -> Parsed:
    """Check a ``/v1/completions`` body (prompt: text, token ids, or a list of one of them)."""
    common = _common(body, model, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        raise ApiError(400, "must be a non-empty string or a non-empty list of token ids",
                       param="prompt")
    return Parsed(prompt, False, **common)


def parse_chat(body: Any, model: str) -> Parsed:
    """Check a ``/v1/chat/completions`` body (messages with string or text-part contents)."""
    common = _common(body, model, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ApiError(400, "a message is an object with a string role",
                           param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # text parts: joined, as a text-only server reads them
            if not all(isinstance(p, Mapping) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, "only text content parts are served",
                               param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "must be a string or a list of text parts",
                           param=f"messages[{i}].content")
        out.append({**{k: v for k, v in m.items() if k != "content"}, "content": content})
    return Parsed(out, True, **common)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chunk(kind: str, rid: str, model: str, created: int, text: str, finish: str | None,
          ids: list[int], *, first: bool = False) -> dict[str, Any]:
    """One streamed chunk of a completion (``kind`` "text") or chat completion ("chat").
    ``token_ids`` (an extension, as some servers offer) lists the ids the chunk adds."""
    if kind == "text":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "token_ids": ids}
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [choice]}
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
        {"content": text} if text else {})
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                         "token_ids": ids}]}


def whole(kind: str, rid: str, model: str, text: str, finish: str, usage: dict[str, int],
          ids: list[int]) -> dict[str, Any]:
    """The body of a non-streamed completion or chat completion."""
    created = int(time.time())
    if kind == "text":
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish, "token_ids": ids}], "usage": usage}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish, "token_ids": ids}],
            "usage": usage}

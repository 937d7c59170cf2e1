"""Text in, text out on one engine: ``Engine.generate`` and ``Engine.stream``.

A prompt is text (encoded by the checkpoint's tokenizer, with its special tokens), chat
messages or a string rendered through the chat template (``chat=True``), or token ids. The
request runs through a :class:`~metrale.runtime.batching.Batcher` (the same path a server's
requests take), stops at the checkpoint's stop ids, at a ``stop`` string or at
``max_tokens``, and draws by ``sampling`` (default: ``generation_config.json``'s defaults, or
greedy when the checkpoint has none).

>>> from metrale.runtime.engine import Engine
>>> eng = Engine.load("tiny-qwen3", act="f32", max_ctx=32)
>>> g = eng.generate([1, 2, 3], 4)
>>> len(g.ids), g.finish, g.text
(4, 'length', '')
>>> [d.ids for d in eng.stream([1, 2, 3], 4)] == [[t] for t in g.ids]
True
>>> eng.close()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from metrale.lkb.errors import ConfigError

from .batching import Batcher, Request
from .sampling import Sampling

__all__ = ["Delta", "Generation", "generate", "prompt_ids", "resolve_sampling", "stream"]


@attrs.frozen
class Generation:
    """A finished generation: the new ids, their text, and why it ended (``stop``/``length``)."""

    ids: tuple[int, ...]
    text: str
    finish: str
    prompt_tokens: int


@attrs.frozen
class Delta:
    """One step of a stream: the ids kept this step, the text they complete, the finish reason
    on the last one."""

    ids: list[int]
    text: str
    finish: str | None = None


def prompt_ids(engine: Any, prompt: Any, *, chat: bool = False) -> list[int]:
    """Token ids of a prompt: ids as given, text through the tokenizer, chat through the
    template (a string is one user message)."""
    text = engine.text
    if chat:
        if text is None:
            raise ConfigError("a chat prompt needs the checkpoint's tokenizer and template",
                              key="prompt", expected="a checkpoint with tokenizer.json")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, Sequence) or not all(isinstance(m, Mapping)
                                                         for m in messages):
            raise ConfigError("chat messages are a list of objects", key="messages",
                              found=type(prompt).__name__)
        return text.chat_ids(messages)
    if isinstance(prompt, str):
        if text is None:
            raise ConfigError("a text prompt needs the checkpoint's tokenizer", key="prompt",
                              expected="token ids, or a checkpoint with tokenizer.json")
        return text.encode(prompt)
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
        return list(prompt)
    raise ConfigError("a prompt is text or a list of token ids", key="prompt",
                      found=type(prompt).__name__)


def resolve_sampling(engine: Any, sampling: Sampling | None) -> Sampling:
    """``sampling``, or the checkpoint's generation defaults, or greedy."""
    if sampling is not None:
        return sampling
    defaults = engine.text.defaults if engine.text is not None else None
    return Sampling.from_defaults(defaults)


def _request(engine: Any, prompt: Any, max_tokens: int, sampling: Sampling | None,
             stop: Sequence[str], chat: bool) -> Request:
    ids = prompt_ids(engine, prompt, chat=chat)
    stops = engine.text.stop_ids if engine.text is not None else ()
    return Request(ids, max_tokens, resolve_sampling(engine, sampling), stops, tuple(stop))


def stream(engine: Any, prompt: Any, max_tokens: int = 16, *, sampling: Sampling | None = None,
           stop: Sequence[str] = (), chat: bool = False) -> Iterator[Delta]:
    """The deltas of one generation, step by step (see the module docstring)."""
    req = _request(engine, prompt, max_tokens, sampling, stop, chat)
    batcher = Batcher(engine)
    run = batcher.admit(req)
    try:
        while not run.done:
            for ev in batcher.step():
                if ev.running is run:
                    yield Delta([] if ev.token is None else [ev.token], ev.text, ev.finish)
    finally:
        batcher.cancel(run)


def generate(engine: Any, prompt: Any, max_tokens: int = 16, *,
             sampling: Sampling | None = None, stop: Sequence[str] = (),
             chat: bool = False) -> Generation:
    """The whole generation at once (see the module docstring)."""
    req = _request(engine, prompt, max_tokens, sampling, stop, chat)
    run = Batcher(engine).run_alone(req)
    return Generation(tuple(run.ids), run.text, run.finish or "length", len(req.prompt))

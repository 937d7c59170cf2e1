"""``met serve``: an OpenAI-compatible HTTP server over one engine, on uvicorn + starlette.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` or not),
``GET /v1/models``, ``GET /health``. One thread steps a
:class:`~metrale.runtime.batching.Batcher` (continuous batching over the engine's KV slots:
every running request shares each decode step, a new request's prefill runs between steps);
the handlers admit requests and read their events from a queue. A request when every slot is
busy gets 429; a client that disconnects frees its slot at once; shutdown cancels what is in
flight (its streams end with ``finish_reason`` ``"cancelled"``), stops the stepping thread and
closes the engine.

>>> from metrale.runtime.engine import Engine
>>> from starlette.testclient import TestClient
>>> eng = Engine.load("tiny-qwen3", act="f32", max_ctx=32, slots=2)
>>> with TestClient(make_app(Server(eng, "tiny"))) as client:
...     r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 3})
...     r.status_code, r.json()["usage"]
(200, {'prompt_tokens': 2, 'completion_tokens': 3, 'total_tokens': 5})
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from metrale.lkb.errors import ConfigError
from metrale.openai_api import (
    ApiError,
    Parsed,
    chunk,
    error_body,
    from_config_error,
    new_id,
    parse_chat,
    parse_completion,
    whole,
)
from metrale.runtime.batching import Batcher, Busy, Event, Request, Running
from metrale.runtime.generate import prompt_ids

__all__ = ["Server", "listen", "make_app", "serve"]

MAX_BODY = 4 << 20
"""Largest request body read (bytes); a larger one is a 413."""


class Server:
    """The engine, its batcher and the thread that steps it; ``name`` is the model's id."""

    def __init__(self, engine: Any, name: str, *, idle_wait: float = 0.05) -> None:
        self.engine, self.name = engine, name
        self.batcher = Batcher(engine)
        self.idle_wait = idle_wait
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- the stepping thread -------------------------------------------------------------------

    def start(self) -> None:
        self.batcher.warm()
        self._thread = threading.Thread(target=self._loop, name="metrale-batcher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.batcher.busy():
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            try:
                events = self.batcher.step()
            except BaseException as e:  # a device fault: every running request ends with it
                self.error = e
                for run in self.batcher.busy():
                    self.batcher.cancel(run, "error")
                    self._deliver(Event(run, None, "", "error"))
                continue
            for ev in events:
                self._deliver(ev)

    def _deliver(self, ev: Event) -> None:
        target = self._queues.get(id(ev.running))
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, ev)

    def stop(self) -> None:
        """Cancel what is in flight, stop the thread, close the engine."""
        for run in self.batcher.busy():
            self.batcher.cancel(run)
            self._deliver(Event(run, None, "", "cancelled"))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.engine.close()

    # -- requests ------------------------------------------------------------------------------

    def admit(self, parsed: Parsed) -> tuple[Running, asyncio.Queue]:
        eng = self.engine
        try:
            ids = prompt_ids(eng, parsed.prompt, chat=parsed.chat)
        except ConfigError as e:
            raise from_config_error(e) from None
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            max_tokens = max(1, eng.max_ctx - len(ids)) if parsed.chat else 16
        stops = eng.text.stop_ids if eng.text is not None and not parsed.ignore_eos else ()
        req = Request(ids, max_tokens, parsed.sampling, stops, parsed.stop)
        queue: asyncio.Queue = asyncio.Queue()
        try:
            with self.batcher.lock:
                run = self.batcher.admit(req)
                self._queues[id(run)] = (asyncio.get_running_loop(), queue)
        except Busy as e:
            raise ApiError(429, f"{e.message}: retry later", kind="rate_limit_error",
                           code="slots_busy") from None
        except ConfigError as e:
            raise from_config_error(e) from None
        self._wake.set()
        return run, queue

    def release(self, run: Running) -> None:
        """Free ``run``'s slot (a no-op once it finished) and forget its queue."""
        self.batcher.cancel(run)
        self._queues.pop(id(run), None)


def _json(data: Any, status: int = 200) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(data, status_code=status)


def _error(e: ApiError) -> Any:
    return _json(e.body(), e.status)


async def _body(request: Any) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None


def make_app(server: Server) -> Any:
    """The starlette application of ``server`` (its lifespan starts and stops the thread)."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def health(request: HttpRequest) -> Any:
        ok = server.error is None
        return _json({"status": "ok" if ok else "error", "model": server.name,
                      "slots": server.engine.slots, "free_slots": server.batcher.free_slots()},
                     200 if ok else 503)

    async def models(request: HttpRequest) -> Any:
        return _json({"object": "list", "data": [
            {"id": server.name, "object": "model", "created": 0, "owned_by": "metrale",
             "max_model_len": server.engine.max_ctx}]})

    async def generate(request: HttpRequest, kind: str) -> Any:
        try:
            body = await _body(request)
            parsed = (parse_completion if kind == "text" else parse_chat)(body, server.name)
            run, queue = server.admit(parsed)
        except ApiError as e:
            return _error(e)
        rid = new_id("cmpl" if kind == "text" else "chatcmpl")
        if parsed.stream:
            return StreamingResponse(_stream(server, run, queue, kind, rid, parsed),
                                     media_type="text/event-stream")
        try:
            text, finish = [], None
            while finish is None:
                try:
                    ev = await asyncio.wait_for(queue.get(), 0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return _json(error_body("client went away"), 499)
                    continue
                text.append(ev.text)
                finish = ev.finish
        finally:
            server.release(run)
        if finish == "error":
            return _json(error_body(f"the engine failed: {server.error}", "server_error"), 500)
        usage = _usage(run)
        return _json(whole(kind, rid, server.name, "".join(text), finish, usage,
                           list(run.ids)))

    async def completions(request: HttpRequest) -> Any:
        return await generate(request, "text")

    async def chat(request: HttpRequest) -> Any:
        return await generate(request, "chat")

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            server.stop()

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ], lifespan=lifespan)


def _usage(run: Running) -> dict[str, int]:
    n, m = len(run.request.prompt), len(run.ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


async def _stream(server: Server, run: Running, queue: asyncio.Queue, kind: str, rid: str,
                  parsed: Parsed) -> AsyncIterator[str]:
    """Server-sent events of one request; a disconnect (the task cancelled) frees the slot."""
    created = int(time.time())
    first = True
    try:
        finish = None
        while finish is None:
            ev = await queue.get()
            finish = ev.finish
            if ev.text or ev.token is not None or finish is not None:
                ids = [] if ev.token is None else [ev.token]
                data = chunk(kind, rid, server.name, created, ev.text, finish, ids,
                             first=first)
                first = False
                yield f"data: {json.dumps(data)}\n\n"
        if parsed.include_usage:
            data = {"id": rid, "object": "text_completion" if kind == "text" else
                    "chat.completion.chunk", "created": created, "model": server.name,
                    "choices": [], "usage": _usage(run)}
            yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        server.release(run)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, or a ``ConfigError`` naming the flag:
    ``met serve`` binds before it loads the model, so a bad address fails at once.

    >>> listen("../..", 8000)
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: --host: cannot resolve the address (expected an IP address or a host name this machine resolves, found '../..')
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ConfigError("cannot resolve the address", key="--host",
                          expected="an IP address or a host name this machine resolves",
                          found=repr(host)) from e
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ConfigError("cannot listen on the address", key="--port",
                          expected="a free port on an address of this machine",
                          found=f"{host}:{port} ({e.strerror or e})") from e
    return sock


def serve(engine: Any, name: str, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", graceful_s: float = 10.0,
          sock: socket.socket | None = None) -> None:
    """Serve ``engine`` until interrupted (uvicorn handles SIGINT/SIGTERM: it stops taking
    connections, waits up to ``graceful_s`` for open ones, then the lifespan cancels the rest;
    the return is then normal, so ``met serve`` stopped that way exits 0),
    on ``sock`` (from :func:`listen`) or on a socket bound to ``host:port`` now."""
    import uvicorn

    sock = sock if sock is not None else listen(host, port)
    config = uvicorn.Config(make_app(Server(engine, name)), host=host, port=port,
                            log_level=log_level, timeout_graceful_shutdown=graceful_s)
    with sock:
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:
            # uvicorn raises the signal it stopped on again once its shutdown is done: a server
            # stopped by Ctrl-C or SIGTERM after draining has done its job (status 0)
            pass

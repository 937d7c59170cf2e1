"""``met serve`` on loopback, through the official ``openai`` client and raw ``httpx``.

The server runs the tiny text checkpoint (``tests/text_checkpoint.py``) on the host backend
under the exact policy, in a thread on 127.0.0.1 (an ephemeral port); every wait is bounded.
Acceptance: completions and chat completions, streaming and not; each of 16 concurrent
greedy streams returns exactly the ids it returns alone; bad requests get OpenAI-style 4xx
bodies and the server keeps serving; 429 when every slot is busy; clients killed mid-stream
give their slots back.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.runtime.engine import Engine
from metrale.serve import Server, make_app
from tests.text_checkpoint import make_text_checkpoint

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

MODEL = "tiny-text"
CONTEXT = 64
WAIT_S = 60


class Running:
    """A uvicorn server in a thread, bound to 127.0.0.1 on an ephemeral port."""

    def __init__(self, engine, grace_s=5.0):
        self.server = Server(engine, MODEL)
        config = uvicorn.Config(make_app(self.server), host="127.0.0.1", port=0,
                                log_level="warning", timeout_graceful_shutdown=grace_s)
        self.uv = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not (self.uv.started and self.uv.servers):
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.uv.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=WAIT_S,
                             max_retries=0)

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("serve") / "ck")


@pytest.fixture(scope="module")
def served(ckpt):
    run = Running(Engine.load(ckpt, act="f32", max_ctx=CONTEXT, slots=16))
    yield run
    run.stop()


def test_models_and_health(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(served.url + "/health", timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["free_slots"] == 16


def test_completions_streaming_and_not(served):
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=8,
                                      temperature=0)
    choice = whole.choices[0]
    assert whole.usage.completion_tokens == len(choice.token_ids) >= 1
    assert choice.finish_reason in ("length", "stop")
    parts = list(client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=8,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == choice.text
    assert [t for p in parts for t in p.choices[0].token_ids] == choice.token_ids
    assert parts[-1].choices[0].finish_reason == choice.finish_reason
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_chat_streaming_and_not(served, ckpt):
    from metrale.runtime.text import Text

    client = served.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is two plus two?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(Text.load(ckpt).chat_ids(messages))
    parts = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == \
        whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seeded_sampling_reproduces(served):
    client = served.client()
    kw = dict(model=MODEL, prompt="Hello", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kw).choices[0].token_ids
    b = client.completions.create(**kw).choices[0].token_ids
    assert a == b


PROMPTS = [f"{w} number {i}" for i, w in enumerate(
    ["Hello", "The quick", "Metrale", "A category", "Über", "system", "What is", "Tokens",
     "brown fox", "lazy dog", "kernel plans", "functor", "emoji 🙂", "12345", "café", "two"])]


def _stream_ids(client, prompt):
    ids = []
    for part in client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                          temperature=0, stream=True):
        ids += part.choices[0].token_ids
    return ids


def test_sixteen_concurrent_streams_equal_each_alone(served):
    client = served.client()
    alone = [_stream_ids(client, p) for p in PROMPTS]
    served.server.batcher.peak_rows = 0
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _stream_ids(served.client(), p), PROMPTS))
    assert served.server.batcher.peak_rows >= 4, "the requests never shared a decode step"
    for p, a, t in zip(PROMPTS, alone, together):
        assert t == a, p
    assert len({tuple(a) for a in alone}) > 1  # the prompts really differ


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 9}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(1, CONTEXT + 10))}, 400,
     "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 6]}, 400, "token_ids[1]"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
     400, "chat_template"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "n": 2}, 400, "n"),
]


@pytest.mark.parametrize("route,body,status,param", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, route, body,
                                                                     status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(served.url + route, content=raw, timeout=WAIT_S,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    ok = served.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert len(ok.choices[0].token_ids) >= 1
    assert served.server.batcher.free_slots() == 16


KILLABLE = """
import sys, httpx
with httpx.stream("POST", sys.argv[1] + "/v1/completions", timeout=60, json={
        "model": sys.argv[2], "prompt": [1, 2, 3], "max_tokens": 50, "stream": True}) as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            print("chunk", flush=True)
"""


def _wait(pred, what):
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_busy_slots_get_429_and_killed_clients_free_their_slots(ckpt):
    """Two slots: two streaming clients (separate processes) hold them, a third request gets
    429; the clients are killed mid-stream and both slots come back, then serve again."""
    run = Running(Engine.load(ckpt, act="f32", max_ctx=CONTEXT, slots=2))
    procs = []
    try:
        batcher = run.server.batcher
        # slow each step so the streams are surely still running when the clients die
        step = batcher.step

        def slow_step():
            time.sleep(0.05)
            return step()

        batcher.step = slow_step
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", KILLABLE, run.url, MODEL],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "chunk"
        assert batcher.free_slots() == 0
        r = httpx.post(run.url + "/v1/completions", timeout=WAIT_S,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        for p in procs:
            p.kill()
            p.wait(timeout=WAIT_S)
        _wait(lambda: batcher.free_slots() == 2, "the killed clients' slots did not come back")
        ok = run.client().completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert len(ok.choices[0].token_ids) >= 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        run.stop()


@pytest.mark.parametrize("grace_s", [10.0, 0.3])
def test_shutdown_finishes_or_cancels_streams_in_flight(ckpt, grace_s):
    """A stream in flight at shutdown finishes within the grace period, else is cancelled;
    either way the slots are free and the engine closed."""
    run = Running(Engine.load(ckpt, act="f32", max_ctx=CONTEXT, slots=2), grace_s)
    batcher = run.server.batcher
    step = batcher.step

    def slow_step():
        time.sleep(0.05)
        return step()

    batcher.step = slow_step
    finishes = []

    def client():
        try:
            with httpx.stream("POST", run.url + "/v1/completions", timeout=WAIT_S, json={
                    "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 60, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        finishes.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        except httpx.RemoteProtocolError:  # the server cut the stream at the grace period's end
            finishes.append("closed")

    t = threading.Thread(target=client)
    t.start()
    _wait(lambda: finishes, "the stream did not start")
    run.stop()
    t.join(timeout=WAIT_S)
    assert not t.is_alive()
    if grace_s > 5:
        assert finishes[-1] == "length" and len(finishes) == 60
    else:
        assert finishes[-1] in ("closed", "cancelled") and len(finishes) < 60
    assert batcher.free_slots() == 2
    assert run.server.engine.backend.live_bytes() == 0  # the engine was closed


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n",
          "ignore_eos", "logprobs"]


@settings(max_examples=60, deadline=None)
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.fixed_dictionaries({"model": st.just(MODEL) | json_values},
                                  optional={f: json_values for f in FIELDS[1:]}))
def test_any_json_body_gets_a_response_below_500(fuzz_client, route, body):
    """Whatever a client sends, the answer is a success or a 4xx with an OpenAI error body;
    never a 5xx, and every slot is free after it."""
    client, server = fuzz_client
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep the successes short
    r = client.post(route, content=json.dumps(body).encode(),  # inf and NaN as Python writes them
                    headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]
    assert server.batcher.free_slots() == 2


@pytest.fixture(scope="module")
def fuzz_client(ckpt):
    from starlette.testclient import TestClient

    server = Server(Engine.load(ckpt, act="f32", max_ctx=CONTEXT, slots=2), MODEL)
    with TestClient(make_app(server)) as client:
        yield client, server

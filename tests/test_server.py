"""`oled serve` end to end: the real server (uvicorn, in a subprocess) with the tiny random model on CPU, driven by
the official openai client and raw HTTP. One server for the module (started with --api-key and a small queue)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "test-key"
MODEL = "random:tiny"
MAX_QUEUE = 4
BODY_TIMEOUT = 2.0               # the module server's --body-timeout (seconds)
HEADER_TIMEOUT = 2.0             # the module server's --header-timeout (seconds)
JSON = {"Content-Type": "application/json"}
AUTH = {"Authorization": f"Bearer {KEY}"}
CLI = "import sys; from oled.cli import main; sys.exit(main(sys.argv[1:]))"
# a request that keeps the engine busy for seconds: one token per forward, the full 1024-position canvas each time
SLOW = {"max_tokens": 1000, "threshold": 1.0, "cache": "none"}


def oled_env() -> dict:
    # one intra-op thread: the server shares two cores with the test process (more threads only contend)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--random-weights", MODEL.split(":")[1],
                             "--device", "cpu", "--dtype", "float32", "--port", "0", "--api-key", KEY,
                             "--max-queue", str(MAX_QUEUE), "--body-timeout", str(BODY_TIMEOUT),
                             "--header-timeout", str(HEADER_TIMEOUT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=oled_env())
    log: list[str] = []
    url = None
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(log) + proc.stderr.read())
    drain = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    drain.start()
    yield url
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not stop on SIGINT:\n" + "".join(log))
    drain.join(5)
    assert rc in (0, 130), "".join(log)          # uvicorn re-raises the SIGINT it handled: exit 130 like Ctrl-C
    assert "Traceback" not in "".join(log), "".join(log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        yield c


def metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(http, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = http.get("/health").json()
        if h["running"] == 0 and h["queue_depth"] == 0:
            return h
        time.sleep(0.05)
    pytest.fail(f"the engine is still busy: {h}")


def assert_error(r, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# ---------------------------------------------------------------------------------------------------- happy paths
def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = http.get("/health", headers={})            # no key needed for the health probe
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["model"] == MODEL


def test_completion_plain_and_streamed(client):
    resp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=40)
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    choice = resp.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("length", "stop")
    assert 0 < resp.usage.completion_tokens <= 40 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    diffusion = resp.model_extra["diffusion"]
    assert diffusion["nfe"] > 0 and diffusion["tokens_per_forward"] > 0 and diffusion["tpot_s"] > 0

    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text                     # streaming commits the same tokens, block by block
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert finals[0].model_extra["diffusion"]["nfe"] == diffusion["nfe"]
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_plain_and_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=70)
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    answer = resp.choices[0].message.content
    assert resp.usage.completion_tokens > 0 and "diffusion" in resp.model_extra

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=70, stream=True)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == answer
    if resp.usage.completion_tokens > 32:            # more than one block: more than one chunk
        assert len(pieces) >= 2
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason
    assert "nfe" in chunks[-1].model_extra["diffusion"]


def test_diffusion_fields_stop_and_seed(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                     extra_body={"block_length": 8, "threshold": 0.5})
    d = resp.model_extra["diffusion"]
    assert d["block_length"] == 8 and d["threshold"] == 0.5
    assert len(d["iterations_per_block"]) >= 3                   # 24 tokens in blocks of 8

    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64).choices[0].text
    start = len(full) // 2
    stop = next((full[i:i + 2] for i in range(start, len(full) - 1) if "\ufffd" not in full[i:i + 2]), None)
    if stop is not None:
        cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64, stop=[stop])
        assert cut.choices[0].text == full[: full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"

    a, b = (client.completions.create(model=MODEL, prompt="Roll", max_tokens=16, temperature=1.0, seed=7)
            .choices[0].text for _ in range(2))
    assert a == b                                                # same seed, same sample


# ------------------------------------------------------------------------------------------------------ bad input
def test_bad_input_gets_openai_errors(http):
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    post = lambda body, path="/v1/completions": http.post(path, json=body)   # noqa: E731
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
                 400, code="invalid_json")
    assert_error(http.post("/v1/completions", content=b"", headers={"Content-Type": "application/json"}), 400,
                 code="invalid_json")
    assert_error(post([1, 2]), 400)
    assert_error(post({**ok, "model": "gpt-4"}), 404, param="model", code="model_not_found")
    assert_error(post({**ok, "max_tokens": 0}), 400, param="max_tokens")
    assert_error(post({**ok, "max_tokens": -3}), 400, param="max_tokens")
    assert_error(post({**ok, "max_tokens": 10**9}), 400, param="max_tokens")
    assert_error(post({**ok, "max_tokens": None, "prompt": "x" * 2000}), 400, code="context_length_exceeded")
    assert_error(post({**ok, "prompt": list(range(200)) * 6}), 400, code="context_length_exceeded")
    assert_error(post({**ok, "prompt": "y" * 1000, "max_tokens": 100}), 400, code="context_length_exceeded")
    assert_error(post({**ok, "prompt": [7, 100000]}), 400, param="prompt")
    assert_error(post({**ok, "prompt": ""}), 400, param="prompt")
    assert_error(post({**ok, "max_tokens": "5"}), 400, param="max_tokens", code="invalid_type")
    assert_error(post({**ok, "max_tokens": 2.5}), 400, param="max_tokens")
    assert_error(post({**ok, "temperature": "hot"}), 400, param="temperature")
    assert_error(post({**ok, "temperature": 5.0}), 400, param="temperature")
    assert_error(post({**ok, "stream": "yes"}), 400, param="stream")
    assert_error(post({**ok, "prompt": 5}), 400, param="prompt")
    assert_error(post({**ok, "stop": 3}), 400, param="stop")
    assert_error(post({**ok, "n": 2}), 400, param="n")
    assert_error(post({**ok, "block_length": 0}), 400, param="block_length")
    assert_error(post({**ok, "threshold": 1.5}), 400, param="threshold")
    assert_error(post({**ok, "rule": "magic"}), 400, param="rule")
    assert_error(post({**ok, "frobnicate": True}), 400, param="frobnicate", code="unknown_parameter")
    assert_error(post({"prompt": "Hi"}), 400, param="model")
    chat = "/v1/chat/completions"
    assert_error(post({"model": MODEL, "messages": "hi"}, chat), 400, param="messages")
    assert_error(post({"model": MODEL, "messages": []}, chat), 400, param="messages")
    assert_error(post({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, chat), 400,
                 param="messages.0.role")
    assert_error(post({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, chat), 400)
    assert_error(post({"model": MODEL, "messages": [{"role": "user", "content": "x" * 3000}]}, chat), 400,
                 code="context_length_exceeded")
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.get("/v1/nothing"), 404)
    # still serving
    assert http.get("/health").json()["status"] == "ok"
    r = post(ok)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def test_hostile_requests_get_4xx(http, server):
    """What used to be answered 500 (or served to any web page) gets a 4xx OpenAI error, and the server goes on."""
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    chat = "/v1/chat/completions"

    def raw(body: bytes, path="/v1/completions"):
        return http.post(path, content=body, headers=JSON)

    text_part = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert_error(http.post(chat, json=text_part), 400, param="messages.0.content.0.text")
    # lone surrogates (a prompt, a message, a key) and bytes that are not UTF-8
    assert_error(raw(b'{"model": "random:tiny", "prompt": "a\\ud800b"}'), 400, code="invalid_json")
    assert_error(raw(b'{"model": "random:tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', chat), 400,
                 code="invalid_json")
    assert_error(raw(b'{"\\ud800": 1}'), 400, code="invalid_json")
    assert_error(raw(b'{"model": "random:tiny", "prompt": "\xff\xfe"}'), 400, code="invalid_json")
    # JSON nested 1,000 and 100,000 deep
    for depth in (1000, 100_000):
        nested = b"[" * depth + b"]" * depth
        assert_error(raw(b'{"model": "random:tiny", "prompt": "Hi", "metadata": {"a": ' + nested + b"}}", chat), 400,
                     code="invalid_json")
        assert_error(raw(nested), 400, code="invalid_json")
    assert_error(raw(b'{"model": "random:tiny", "prompt": "Hi", "temperature": NaN}'), 400, param="temperature")
    assert_error(raw(b'{"model": "random:tiny", "prompt": "Hi", "top_p": Infinity}'), 400, param="top_p")
    assert_error(http.post("/v1/completions", json={**ok, "seed": 2**64}), 400, param="seed")
    # bodies a web page may send anywhere without a preflight: not JSON, or no type at all
    for media_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert_error(http.post("/v1/completions", content=json.dumps(ok), headers={"Content-Type": media_type}),
                     415, code="unsupported_media_type")
    assert_error(http.post("/v1/completions", content=json.dumps(ok)), 415, code="unsupported_media_type")
    # a foreign Host (DNS rebinding): refused on every path, before the key is even looked at
    port = server.rsplit(":", 1)[1]
    for host in (f"attacker.example:{port}", "attacker.example", "127.0.0.2", "[::2]:80"):
        assert_error(http.get("/health", headers={"Host": host}), 400, code="invalid_host")
    csrf = {"Host": "attacker.example", "Content-Type": "text/plain"}           # the issue's "simple request"
    assert_error(http.post("/v1/completions", content=json.dumps(ok), headers=csrf), 400, code="invalid_host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", "LOCALHOST"):
        assert http.get("/health", headers={"Host": host}).status_code == 200, host
    # still serving, with a charset parameter too
    charset = {"Content-Type": "application/json; charset=utf-8"}
    r = http.post("/v1/completions", content=json.dumps(ok), headers=charset)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def _recv_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.time() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    pytest.fail(f"the server kept the connection open: {data!r}")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"],
                         ids=["nothing", "half the headers"])
def test_slow_headers_get_a_408_and_the_connection_closed(server, http, sent):
    """A connection whose request line and headers do not arrive within --header-timeout is answered 408 and closed
    (uvicorn itself only times out idle keep-alive connections), while other clients are served."""
    host, port = server.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(sent)
        start = time.time()
        time.sleep(HEADER_TIMEOUT / 2)
        assert http.get("/health").status_code == 200
        reply = _recv_until_closed(sock, start + HEADER_TIMEOUT + 8)
        waited = time.time() - start
    assert reply.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in reply, reply
    assert HEADER_TIMEOUT - 0.5 < waited < HEADER_TIMEOUT + 5, waited
    # a keep-alive connection is not cut while it waits between requests or while a request is served
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}).status_code == 200
            time.sleep(HEADER_TIMEOUT + 0.5)


def test_big_deep_and_slow_bodies_leave_health_answering(server, http):
    """A 20 MB body (with and without Content-Length), a 7 MB prompt, deep JSON, a slow half-sent request and a
    client that leaves mid-body, while another client polls /health: each gets its 4xx (the last one a quiet
    close), and /health answers every time within a second."""
    host, port = server.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    failures: list[str] = []
    done = threading.Event()

    def poll_health():
        with httpx.Client(base_url=server, timeout=5) as c:
            deadline = time.time() + 120
            while not done.is_set() and time.time() < deadline:
                start = time.perf_counter()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    failures.append(str(status))
                time.sleep(0.05)

    before = metrics(http)
    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        big = b'{"model": "random:tiny", "prompt": "' + b"x" * 20_000_000 + b'"}'
        assert_error(http.post("/v1/completions", content=big, headers=JSON), 413, code="request_too_large")
        chunks = (big[i:i + 2**20] for i in range(0, len(big), 2**20))          # chunked: no Content-Length
        assert_error(http.post("/v1/completions", content=chunks, headers=JSON), 413, code="request_too_large")
        with socket.create_connection((host, int(port)), timeout=10) as sock:      # 100 MB announced, none sent
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100000000\r\n\r\n".encode())
            reply, deadline = b"", time.time() + 10
            while b'"code":"request_too_large"' not in reply and time.time() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 413 ") and b'"code":"request_too_large"' in reply, reply
        start = time.perf_counter()
        assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 7_000_000}), 400,
                     param="prompt", code="context_length_exceeded")
        assert time.perf_counter() - start < 5                   # refused before tokenizing it (that took 46 s)
        depth = 1_000_000
        assert_error(http.post("/v1/completions", content=b"[" * depth + b"]" * depth, headers=JSON), 400,
                     code="invalid_json")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\n\r\n{{\"model\": ".encode())
            start = time.time()
            reply = _recv_until_closed(sock, start + BODY_TIMEOUT + 8)
            waited = time.time() - start
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b'"code":"request_timeout"' in reply and BODY_TIMEOUT - 0.5 < waited < BODY_TIMEOUT + 5, (reply, waited)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\n\r\n{{\"model\": ".encode())
        gone = 'oled_requests_total{endpoint="/v1/completions",status="499"}'
        deadline = time.time() + 10
        while metrics(http).get(gone, 0) == before.get(gone, 0):     # counted as gone, not as a 500
            assert time.time() < deadline, "the disconnect mid-body was not recorded"
            time.sleep(0.05)
    finally:
        done.set()
        poller.join(10)
    assert not failures, failures
    assert len(latencies) >= 20 and max(latencies) < 1.0, (len(latencies), max(latencies))
    after = metrics(http)
    assert after.get('oled_requests_total{endpoint="/v1/completions",status="500"}', 0) == 0
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def test_api_key_required(server, client):
    with httpx.Client(base_url=server, timeout=30) as anon:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        assert_error(anon.post("/v1/completions", json=body), 401, code="invalid_api_key")
        assert_error(anon.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(anon.post("/v1/completions", json=body, headers={"Authorization": KEY}), 401)
        assert_error(anon.get("/v1/models"), 401)
        assert_error(anon.get("/metrics"), 401)
        assert anon.get("/health").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert client.models.list().data


# ------------------------------------------------------------------------------------ concurrency, cancellation
def _first_content(lines) -> None:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                return
    pytest.fail("the stream ended before its first block")


def test_disconnecting_stream_cancels(http):
    wait_idle(http)
    before = metrics(http)
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Tell a long story", "stream": True,
                                                        **SLOW}) as r:
        assert r.status_code == 200
        _first_content(r.iter_lines())
    # the response is closed after its first block: the engine must stop long before 1000 forwards
    deadline = time.time() + 20
    while time.time() < deadline:
        after = metrics(http)
        if after["oled_requests_cancelled_total"] > before["oled_requests_cancelled_total"]:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the request was not cancelled")
    wait_idle(http)
    after = metrics(http)
    forwards = after['oled_forwards_total{kind="iteration"}'] - before['oled_forwards_total{kind="iteration"}']
    assert 0 < forwards < 500, forwards
    assert after['oled_generations_total{finish_reason="cancelled"}'] >= 1


def test_disconnecting_plain_request_cancels(http, server):
    wait_idle(http)
    before = metrics(http)
    with httpx.Client(base_url=server, headers=AUTH, timeout=1.0) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json={"model": MODEL, "prompt": "Tell a long story", **SLOW})
    wait_idle(http)
    after = metrics(http)
    assert after["oled_requests_cancelled_total"] == before["oled_requests_cancelled_total"] + 1
    forwards = after['oled_forwards_total{kind="iteration"}'] - before['oled_forwards_total{kind="iteration"}']
    assert 0 < forwards < 800, forwards


def test_concurrent_burst_queue_limit(http, server):
    """12 concurrent requests while a long one holds the engine: MAX_QUEUE wait and complete, the rest get 429."""
    wait_idle(http)
    results: list = [None] * 12

    def worker(i: int) -> None:
        with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
            if i % 3 == 0:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 8}
                r = c.post("/v1/chat/completions", json=body)
            elif i % 3 == 1:
                body = {"model": MODEL, "prompt": f"Number {i}", "max_tokens": 8, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 200:
                        lines = list(r.iter_lines())
                        assert [x for x in lines if x][-1] == "data: [DONE]", lines
                    else:
                        r.read()
            else:
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"Number {i}", "max_tokens": 8})
            results[i] = r

    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hold the engine", "stream": True,
                                                        **SLOW}) as blocker:
        lines = blocker.iter_lines()                 # keep the generator: dropping it would close the stream
        _first_content(lines)                        # the engine is now busy with the blocker
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        deadline = time.time() + 20                  # wait for the rejections (the accepted ones are queued)
        while sum(r is not None and r.status_code == 429 for r in results) < 12 - MAX_QUEUE:
            assert time.time() < deadline, [r and r.status_code for r in results]
            time.sleep(0.05)
        assert http.get("/health").json()["queue_depth"] == MAX_QUEUE
    # the blocker is gone (cancelled): the queued requests run
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200] * MAX_QUEUE + [429] * (12 - MAX_QUEUE), statuses
    for r in results:
        if r.status_code == 429:
            err = assert_error(r, 429, code="queue_full")
            assert err["type"] == "rate_limit_error" and r.headers.get("retry-after")
    h = wait_idle(http)
    assert h["status"] == "ok"
    m = metrics(http)
    assert m['oled_requests_total{endpoint="/v1/completions",status="429"}'] >= 1
    for name in ("oled_tpot_seconds_count", 'oled_expert_pairs_total{kind="iteration"}',
                 'oled_h2d_bytes_total{kind="iteration"}', "oled_expert_hit_rate",
                 "oled_gpu_memory_allocated_bytes"):
        assert name in m, name
    assert 0 < m["oled_expert_hit_rate"] <= 1

"""The server app in-process (no sockets): the published OpenAPI document, schema fuzzing over it with schemathesis,
the per-request seed, and the 500 answer. One engine for the module (random:tiny on the CPU)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (hypothesis comes with schemathesis)
from starlette.testclient import TestClient  # noqa: E402

from oled.config import EngineConfig  # noqa: E402
from oled.engine import Engine  # noqa: E402
from oled.server.guards import default_allowed_hosts, host_name  # noqa: E402
from oled.server.routes import create_app  # noqa: E402

MODEL = "random:tiny"
FUZZ_EXAMPLES = 50                # per operation (and the coverage phase's cases): about 10 s on 2 cores
FUZZ_WORK = {"gen_length": 8, "steps": 2}     # the most one fuzzed request may decode (see clamped_engine)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(random_weights="tiny", device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def clamped_engine(engine):
    """The engine, with each request's decoding cut to a few forwards: the fuzzer draws max_tokens, steps and
    block_length anywhere in their valid ranges, and decoding cost is the decoding loop's business, not the HTTP
    layer's. Everything before the loop (translation, validation, the queue, streaming) runs unchanged."""
    generate_ids = engine.generate_ids

    def clamped(prompt_ids, params, **kwargs):
        params = replace(params, gen_length=min(params.gen_length, FUZZ_WORK["gen_length"]),
                         steps=min(params.steps or FUZZ_WORK["steps"], FUZZ_WORK["steps"]))
        return generate_ids(prompt_ids, params, **kwargs)

    engine.generate_ids = clamped
    yield engine
    del engine.generate_ids


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, allowed_hosts=["testserver"])) as c:
        yield c


# ------------------------------------------------------------------------------------------- the OpenAPI document
def test_openapi_declares_bodies_and_errors(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        post = doc["paths"][path]["post"]
        body = post["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert {"400", "404", "408", "413", "415", "429"} <= set(post["responses"]), post["responses"].keys()
        assert "422" not in post["responses"]                   # validation errors are 400s, like OpenAI's
        assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        error = post["responses"]["413"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert {"model", "prompt"} <= set(schemas["CompletionRequest"]["required"])
    assert schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0] == {
        "type": "integer", "minimum": -2**63, "maximum": 2**63 - 1}
    for ref in json.dumps(doc).split('"$ref": "')[1:]:           # every reference resolves
        assert ref.split('"')[0].removeprefix("#/components/schemas/") in schemas, ref
    assert "401" not in doc["paths"]["/v1/models"]["get"]["responses"]   # no key: no 401, no security scheme
    assert "securitySchemes" not in doc["components"]


def test_openapi_with_a_key_declares_401_and_bearer(engine):
    with TestClient(create_app(engine, api_key="k")) as keyed:
        doc = keyed.get("/openapi.json").json()
        assert keyed.post("/v1/completions", json={}).status_code == 401
    assert doc["components"]["securitySchemes"] == {"HTTPBearer": {"type": "http", "scheme": "bearer"}}
    for path in ("/v1/models", "/metrics", "/v1/completions"):
        operation = next(iter(doc["paths"][path].values()))
        assert "401" in operation["responses"] and operation["security"] == [{"HTTPBearer": []}], path
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]


# ---------------------------------------------------------------------------------------------------- fuzzing
fuzzed = schemathesis.pytest.from_fixture("fuzz_schema")


@pytest.fixture(scope="module")
def fuzz_schema(clamped_engine):
    app = create_app(clamped_engine)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.generation.update(max_examples=FUZZ_EXAMPLES)

    @schema.hook("map_case")
    def served_model(context, case):
        # a random model id is answered 404 before anything else runs: name the served one so the rest is fuzzed
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL
        return case

    return schema


@fuzzed.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_schema_fuzzing_finds_no_server_error(case):
    """Valid and invalid requests drawn from the published document: never a 5xx, every status and content type
    declared, every error an OpenAI error object. Derandomized, so that CI runs the same requests every time
    (a deeper local run: raise FUZZ_EXAMPLES and drop derandomize; 1,500 per operation found nothing either)."""
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance])


# ------------------------------------------------------------------------------------------ seeds, the 500 body
def sample(client, seed=None) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": "Roll the dice", "max_tokens": 16, "temperature": 1.0}
    r = client.post("/v1/completions", json=body if seed is None else {**body, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["diffusion"]["seed"]


def test_sampling_without_seed_draws_one_per_request(client):
    (a, seed_a), (b, seed_b) = sample(client), sample(client)
    assert seed_a != seed_b                            # not the fixed seed 0 of every call
    # and the seed decides the sample (two random seeds' texts may coincide: the tiny model's samples repeat often)
    assert len({sample(client, seed)[0] for seed in range(16)}) > 1
    assert sample(client, seed_a) == (a, seed_a)       # the reported seed reproduces the sample
    greedy = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}).json()
    assert greedy["diffusion"]["seed"] is None


def test_a_vanishing_temperature_decodes_greedily(client):
    """logits / 1e-38 overflow to inf: such a temperature is decoded as the argmax it would sample (found by the
    fuzzing: it was a 500)."""
    body = {"model": MODEL, "prompt": "Roll the dice", "max_tokens": 16}
    greedy = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "temperature": 1e-38})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"] and r.json()["diffusion"]["seed"] is None


def test_seed_out_of_range_is_a_400(client):
    for seed in (2**64, 2**63, -2**63 - 1):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": 1.0, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", (seed, r.text)
    assert sample(client, 2**63 - 1)[1] == 2**63 - 1


def test_internal_error_says_nothing_of_its_cause(engine, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("secret path /home/op/weights")

    app = create_app(engine, allowed_hosts=["testserver"])
    app.state.worker.engine = broken_engine = type("Broken", (), {})()
    broken_engine.generate_ids = broken
    broken_engine.manager = engine.manager
    broken_engine.tokenizer = engine.tokenizer
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "secret" not in r.text and "RuntimeError" not in r.text
        assert c.get("/health").json()["status"] == "ok"          # the engine thread survived
    assert "secret path" in caplog.text                             # the operator's log has the cause


# ------------------------------------------------------------------------------------ the event loop, the Host check
def test_long_prompt_is_tokenized_off_the_event_loop(engine, monkeypatch):
    """A prompt that takes seconds to tokenize (the early refusal turned off) leaves /health answering."""
    httpx = pytest.importorskip("httpx")
    monkeypatch.setattr(engine.tokenizer, "max_chars_per_token", lambda: None)
    app = create_app(engine)
    prompt = "def f(x): return x + 1\n" * 100_000           # 2.3 MB: about 3 s of tokenizing

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            big = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": prompt}))
            await asyncio.sleep(0.3)                        # the prompt is being tokenized now
            latencies, deadline = [], time.perf_counter() + 60
            while not big.done() and time.perf_counter() < deadline:
                start = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return await big, latencies

    app.state.worker.start()
    try:
        r, latencies = asyncio.run(main())
    finally:
        app.state.worker.stop()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert len(latencies) >= 5 and max(latencies) < 0.5, latencies


def test_allowed_hosts_follow_the_bind_address():
    assert default_allowed_hosts("127.0.0.1") == ["127.0.0.1", "localhost", "::1"]
    assert default_allowed_hosts("::1") == ["::1", "localhost", "127.0.0.1"]
    assert default_allowed_hosts("localhost") == ["localhost", "127.0.0.1", "::1"]
    assert default_allowed_hosts("192.168.1.5") == ["192.168.1.5"]
    assert default_allowed_hosts("0.0.0.0") == default_allowed_hosts("::") == ["*"]
    assert [host_name(h) for h in ("Example.COM:8000", "example.com", "[::1]:80", "[::1]", "::1", "1.2.3.4:5")] == [
        "example.com", "example.com", "::1", "::1", "::1", "1.2.3.4"]

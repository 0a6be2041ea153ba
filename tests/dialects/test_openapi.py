"""GET /openapi.json: a valid OpenAPI 3.1 document of exactly the routes the proxy serves."""

from __future__ import annotations

from typing import get_args

import jsonschema_rs
import orjson
import pytest
import schemathesis

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.ops.diagnosis import Cause
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.errors import ApiError, error_body
from proxy.openapi import document as openapi
from proxy.security import browser_policy
from proxy.state import ProxySettings
from tests.conftest import DEMO_IDS, fresh_cache_dir


@pytest.fixture
async def served(aiohttp_client, demo_root, tmp_path):
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=list(DEMO_IDS),
            ssd_enabled=False,
        )
    )
    app = create_app(engine, ProxySettings(), UpstreamConfig(enabled=False))
    client = await aiohttp_client(app)
    r = await client.get("/openapi.json")
    assert r.status == 200
    return app, client, await r.json()


def validator(doc: dict, name: str):
    """A validator for one component schema, its $refs resolved inside `doc`."""
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(root)


def test_document_is_valid_openapi_31_and_every_schema_is_valid_json_schema():
    doc = openapi.document(DEMO_IDS)
    assert doc["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(doc).validate()
    for name in doc["components"]["schemas"]:
        validator(doc, name)  # raises on a schema that is not one


async def test_every_route_the_app_serves_itself_is_documented_and_nothing_else(served):
    app, _, doc = served
    routes = set()
    for route in app.router.routes():
        if route.method in ("HEAD", "*"):  # HEAD comes with every GET; * is the passthrough
            continue
        routes.add((route.resource.canonical, route.method.lower()))
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == routes


async def test_model_names_are_the_models_served_here(served):
    _, _, doc = served
    assert doc["components"]["schemas"]["LocalModel"]["enum"] == list(DEMO_IDS)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["model"] == {"$ref": "#/components/schemas/LocalModel"}


def test_error_schemas_match_the_error_bodies_the_proxy_sends():
    doc = openapi.document(DEMO_IDS)
    err = ApiError(400, "max_tokens: expected an integer, got str 'ten'", param="max_tokens")
    validator(doc, "OpenAIError").validate(error_body(err, "openai"))
    validator(doc, "AnthropicError").validate(error_body(err, "anthropic"))
    with pytest.raises(jsonschema_rs.ValidationError):
        validator(doc, "AnthropicError").validate(error_body(err, "openai"))


@pytest.mark.parametrize(
    "route,body,schema",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            "ChatCompletion",
        ),
        ("/v1/completions", {"prompt": "The cache"}, "Completion"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "Message"),
        (
            "/v1/messages/count_tokens",
            {"messages": [{"role": "user", "content": "hi"}]},
            "TokenCount",
        ),
    ],
)
async def test_real_answers_match_their_documented_schema(served, route, body, schema):
    _, client, doc = served
    request = {"model": "demo-llama", "max_tokens": 2, **body}
    r = await client.post(
        route, data=orjson.dumps(request), headers={"content-type": "application/json"}
    )
    assert r.status == 200, await r.text()
    validator(doc, schema).validate(await r.json())
    ok = doc["paths"][route]["post"]["responses"]["200"]
    for name, header in ok.get("headers", {}).items():
        assert name in r.headers or not header.get("required"), name
    request_schema = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]
    validator(doc, request_schema["schema"]["$ref"].rsplit("/", 1)[1]).validate(request)


async def test_diagnosis_answers_and_refusals_match_their_documented_schemas(
    served, aiohttp_client, demo_root, tmp_path
):
    _, client, doc = served
    schemas = doc["components"]["schemas"]
    assert schemas["CacheLossCause"]["properties"]["cause"]["enum"] == list(get_args(Cause))
    op = doc["paths"]["/v1/cache/diagnosis"]["get"]
    assert [p["name"] for p in op["parameters"]] == ["window", "model", "tenant", "session"]
    assert {"200", "400", "403"} <= set(op["responses"])
    system = "You are terse. Current time: 2026-12-05 0{}:00:00. " + "Keep answers short. " * 20
    for turn in range(2):  # the client rewrites its system prompt's time stamp
        messages = [{"role": "system", "content": system.format(turn)},
                    {"role": "user", "content": "hi"}]  # fmt: skip
        body = {"model": "demo-llama", "max_tokens": 2, "messages": messages}
        r = await client.post("/v1/chat/completions", json=body,
                              headers={"x-session-id": "openapi-diagnosis"})  # fmt: skip
        assert r.status == 200, await r.text()
    r = await client.get("/v1/cache/diagnosis", params={"window": "30m"})
    assert r.status == 200, await r.text()
    answer = await r.json()
    validator(doc, "CacheDiagnosis").validate(answer)
    assert answer["requests"] == 2 and answer["window_s"] == 1800.0
    assert "client_rewrote" in {c["cause"] for c in answer["causes"]}
    r = await client.get("/v1/cache/diagnosis", params={"window": "soon"})
    assert r.status == 400
    validator(doc, "OpenAIError").validate(await r.json())
    # With [tenants] api_keys a key sees its own tenant only: another is a documented 403.
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "keyed"),
            model_specs=["demo-llama"],
            ssd_enabled=False,
        )
    )
    keyed = await aiohttp_client(
        create_app(
            engine,
            ProxySettings(tenant_api_keys={"sk-team": "team"}),
            UpstreamConfig(enabled=False),
            browser_policy("0.0.0.0", api_keys=["sk-team"]),
        )
    )
    auth = {"Authorization": "Bearer sk-team"}
    r = await keyed.get("/v1/cache/diagnosis", params={"tenant": "other"}, headers=auth)
    assert r.status == 403
    error = await r.json()
    validator(doc, "OpenAIError").validate(error)
    assert error["error"]["param"] == "tenant"
    r = await keyed.get("/v1/cache/diagnosis", headers=auth)  # no tenant named: its own
    assert r.status == 200
    assert (await r.json())["filter"]["tenant"] == "team"

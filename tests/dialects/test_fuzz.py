"""Fuzzing a live proxy on the demo models: no answer is a 5xx, the server stays up, and
every 4xx is in its dialect's shape, naming the field at fault.

CI runs a seeded subset. `scripts/fuzz` runs the full count: it raises the schemathesis
cases with `--cases` and these Hypothesis tests with MLX_FUZZ_PROFILE=full
(MLX_FUZZ_EXAMPLES overrides the count).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from tests.conftest import Server, fresh_cache_dir, start_server
from tests.tools import fuzz_bodies as fb
from tests.tools import fuzzing

settings.register_profile(
    "fuzz-ci",
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
settings.register_profile("fuzz-full", settings.get_profile("fuzz-ci"), max_examples=1000)
PROFILE = settings.get_profile(f"fuzz-{os.environ.get('MLX_FUZZ_PROFILE', 'ci')}")
if "MLX_FUZZ_EXAMPLES" in os.environ:
    PROFILE = settings(PROFILE, max_examples=int(os.environ["MLX_FUZZ_EXAMPLES"]))
SCHEMATHESIS_CASES = int(os.environ.get("MLX_FUZZ_CASES", "20"))
# Errors about the prompt as a whole (too long for the context) name "messages" or
# "prompt": any field that is part of the prompt may be the cause.
PROMPT_FIELDS = {"messages", "system", "tools", "prompt"}


@pytest.fixture(scope="module")
def server(demo_root, tmp_path_factory) -> Iterator[Server]:
    """A proxy of its own: fuzzed caches and sessions do not reach other tests' server."""
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("fuzz-cache"))
    s = start_server(cache_dir, env=fuzzing.UPSTREAM_OFF)
    yield s
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200, s.log()[-3000:]
    s.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, route: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else fb.encode(body)
    return http.post(route, content=raw, headers={"content-type": "application/json"})


def error_of(route: str, r: httpx.Response) -> tuple[str, str | None]:
    """(message, param) of a 4xx, after checking it is in the route's dialect shape."""
    assert r.headers["content-type"].startswith("application/json"), r.text[:500]
    data = r.json()
    if fb.ROUTES[route] == "anthropic":
        assert data["type"] == "error", data
        assert set(data["error"]) == {"type", "message"}, data
        return data["error"]["message"], None
    assert set(data) == {"error"}, data
    assert {"message", "type", "param", "code"} <= set(data["error"]), data
    return data["error"]["message"], data["error"]["param"]


def names_one_of(message: str, param: str | None, fields: set) -> bool:
    for name in map(str, fields):
        if (param or "").startswith(name) or re.search(rf"\b{re.escape(name)}\b", message):
            return True
    return "context" in message and bool(fields & PROMPT_FIELDS)


def check(http: httpx.Client, route: str, body, fields: set) -> httpx.Response:
    if not isinstance(body, bytes):
        fuzzing.clamp_body(body, route)
    raw = body if isinstance(body, bytes) else fb.encode(body)
    r = post(http, route, raw)
    if currently_in_test_context():
        event(f"{route} {r.status_code}")  # shown by --hypothesis-show-statistics
    assert r.status_code < 500, f"{route} {r.status_code}: {r.text[:800]}\nbody: {raw[:800]!r}"
    if 400 <= r.status_code < 500:
        message, param = error_of(route, r)
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError:
            assert r.status_code == 400 and ("JSON" in message or "UTF-8" in message), message
            return r
        assert names_one_of(message, param, fields), (
            f"{route} {r.status_code} does not name any of {sorted(fields)}: "
            f"{message!r} (param {param!r})\nbody: {raw[:800]!r}"
        )
    return r


# ---------------------------------------------------------------------------------------
# Schemathesis, driven by the proxy's own /openapi.json


def test_schemathesis_seeded_subset_has_no_server_errors_and_conforms(server):
    tally = fuzzing.run(server.url, cases=SCHEMATHESIS_CASES, seed=fuzzing.DEFAULT_SEED)
    print(tally.report())
    assert tally.server_errors == []
    assert tally.failures == []
    # Every operation of the document got cases (test_openapi checks that every route the
    # proxy registers is in the document).
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    routes = {f"{method.upper()} {path}" for path, ops in doc["paths"].items() for method in ops}
    assert {f"POST {p}" for p in fb.ROUTES} <= routes
    assert set(tally.cases) == routes
    assert tally.total >= 10 * SCHEMATHESIS_CASES
    assert tally.statuses["2xx"] > 0 and tally.statuses["4xx"] > 0


# ---------------------------------------------------------------------------------------
# Hypothesis bodies, sent as raw JSON


@PROFILE
@given(case=fb.hostile_bodies)
def test_hostile_but_well_formed_bodies_never_get_a_5xx(http, case):
    """Odd unicode, huge strings, images, unknown block types, tool schemas that are not."""
    route, body = case
    check(http, route, body, set(body))


@PROFILE
@given(case=fb.clean_bodies, data=st.data())
def test_a_wrong_value_anywhere_gets_a_4xx_naming_its_field(http, case, data):
    route, body = case
    path = data.draw(st.sampled_from(fb.paths(body)))
    body = fb.replace_at(body, path, data.draw(fb.wrong))
    check(http, route, body, {path[0]})


@PROFILE
@given(case=fb.clean_bodies, data=st.data())
def test_nulls_everywhere_get_a_4xx_naming_a_nulled_field(http, case, data):
    route, body = case
    chosen = data.draw(st.sets(st.sampled_from(fb.paths(body)), min_size=1))
    for path in sorted(chosen, key=len, reverse=True):
        body = fb.replace_at(body, path, None)
    check(http, route, body, {p[0] for p in chosen})


@PROFILE
@given(case=fb.clean_bodies, data=st.data())
def test_nan_infinity_surrogates_and_deep_nesting_get_a_400(http, case, data):
    """JSON has no NaN or lone surrogates: the proxy must say so, not fail later."""
    route, body = case
    path = data.draw(st.sampled_from(fb.paths(body)))
    value = data.draw(st.one_of(fb.raw_not_json, fb.raw_odd_but_valid, fb.deep_value))
    check(http, route, fb.replace_at(body, path, value), {path[0]})


@pytest.mark.parametrize("route", sorted(fb.ROUTES))
@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "demo-llama", "max_tokens": NaN, "messages": []}',
        b'{"model": "demo-llama", "temperature": Infinity}',
        b'{"model": "demo-llama", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b"\xff\xfe{}",
        b'{"model": "demo-llama"' + b" " * 1000,
    ],
    ids=["nan", "infinity", "lone-surrogate", "deep-array", "deep-object", "bad-utf8", "cut"],
)
def test_bodies_that_are_not_json_get_a_400_in_dialect_shape(http, route, raw):
    r = check(http, route, raw, set())
    assert r.status_code == 400
    assert http.get("/health").status_code == 200

"""Schemathesis against a live proxy, driven by the proxy's own /openapi.json.

Shared by tests/dialects/test_fuzz.py (a seeded CI subset) and scripts/fuzz (the full count):

    python -m tests.tools.fuzzing [--url URL] [--cases N] [--seed S]

Every operation gets N positive and N negative cases (fewer when its inputs run out, as a
GET without parameters does). Each response is tallied by route and status class and run
through schemathesis' checks; a 5xx or a failed check is listed with a curl line to replay.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Generation length is not what is being fuzzed: capping it keeps each case at parsing,
# validation and a few decode steps, so thousands of cases fit in minutes on a CPU.
MAX_TOKENS = 8
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
DEFAULT_SEED = 20261201
UPSTREAM_OFF = {"MLX_PROMPT_CACHE_UPSTREAM_ENABLED": "false"}
DEFAULT_CASES = 200  # per operation and mode: 6 POST routes x 2 modes x 200 = 2,400


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    by_route: dict[str, Counter[str]] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    accepted_invalid: Counter[str] = field(default_factory=Counter)
    # A few accepted negative cases per route, as curl lines, to judge the proxy or the doc.
    accepted_examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def add(self, route: str, status: int) -> None:
        self.cases[route] += 1
        self.statuses[f"{status // 100}xx"] += 1
        self.by_route.setdefault(route, Counter())[str(status)] += 1

    def report(self) -> str:
        lines = [f"schemathesis: {self.total} cases"]
        for route, n in sorted(self.cases.items()):
            detail = ", ".join(f"{s}: {c}" for s, c in sorted(self.by_route[route].items()))
            lines.append(f"  {route:34} {n:5}   ({detail})")
        lines.append(
            "  by status class: " + ", ".join(f"{k} {v}" for k, v in sorted(self.statuses.items()))
        )
        lines.append(f"  responses >= 500: {len(self.server_errors)}")
        lines += [f"    {e}" for e in self.server_errors[:20]]
        lines.append(f"  failed checks: {len(self.failures)}")
        lines += [f"    {e}" for e in self.failures[:20]]
        if self.accepted_invalid:
            lines.append(
                "  negative cases answered 2xx (the proxy is laxer than the document): "
                + ", ".join(f"{r} {n}" for r, n in sorted(self.accepted_invalid.items()))
            )
            for route, examples in sorted(self.accepted_examples.items()):
                lines += [f"    {route}: {e}" for e in examples]
        return "\n".join(lines)


def cap_max_tokens(doc: dict[str, Any], cap: int = MAX_TOKENS) -> dict[str, Any]:
    """The served document with every max_tokens field limited to `cap`, for fuzzing."""

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                for name in TOKEN_FIELDS:
                    if name in props:
                        props[name] = {"type": "integer", "minimum": 1, "maximum": cap}
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return doc


def clamp_body(body: Any, route: str) -> None:
    """Negative cases may carry any max_tokens; a valid one above the cap would only spend
    minutes decoding. OpenAI's default when it is missing is 2048: cap that too."""
    if not isinstance(body, dict):
        return
    for name in TOKEN_FIELDS:
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if MAX_TOKENS < value < 1 << 20 and float(value).is_integer():
            body[name] = MAX_TOKENS
    if "/messages" not in route and not any(body.get(name) is not None for name in TOKEN_FIELDS):
        body["max_tokens"] = MAX_TOKENS


def load_schema(base_url: str):
    import schemathesis

    doc = httpx.get(base_url + "/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(cap_max_tokens(doc))


def checks() -> list:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]


def run(base_url: str, cases: int = DEFAULT_CASES, seed: int = DEFAULT_SEED) -> Tally:
    import requests
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from schemathesis import GenerationMode

    schema = load_schema(base_url)
    tally = Tally()
    all_checks = checks()
    session = requests.Session()

    def send(case, route: str, mode: GenerationMode) -> None:
        clamp_body(case.body, route)
        response = case.call(base_url=base_url, session=session, timeout=120)
        status = response.status_code
        tally.add(route, status)
        if status >= 500:
            tally.server_errors.append(f"{route} {status}: {case.as_curl_command()}")
        if mode == GenerationMode.NEGATIVE and status < 300:
            tally.accepted_invalid[route] += 1
            examples = tally.accepted_examples.setdefault(route, [])
            if len(examples) < 3:
                examples.append(case.as_curl_command()[:400])
        try:
            case.validate_response(response, checks=all_checks)
        except BaseExceptionGroup as e:  # schemathesis' FailureGroup: one per failed check
            first = str(e).strip().splitlines()
            tally.failures.append(f"{route} {status}: {' | '.join(first[:6])}")

    for result in schema.get_all_operations():
        op = result.ok()
        route = f"{op.method.upper()} {op.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                strategy = op.as_strategy(generation_mode=mode)
            except Exception:  # nothing to negate (no parameters, no body)
                continue

            def make(route: str, mode: GenerationMode, strategy):
                @settings(
                    max_examples=cases,
                    database=None,
                    deadline=None,
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
                @hseed(seed)
                @given(case=strategy)
                def fuzz(case) -> None:
                    send(case, route, mode)

                return fuzz

            try:
                make(route, mode, strategy)()
            except Exception as e:  # an operation with no negative space raises Unsatisfiable
                if mode == GenerationMode.POSITIVE:
                    raise
                print(f"{route} negative: {type(e).__name__}", file=sys.stderr)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running proxy; default: start one on the demo models")
    parser.add_argument("--cases", type=int, default=DEFAULT_CASES, help="per operation and mode")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    if args.url:
        tally = run(args.url.rstrip("/"), args.cases, args.seed)
    else:
        with demo_server() as url:
            tally = run(url, args.cases, args.seed)
            alive = httpx.get(url + "/health", timeout=30).status_code
            print(f"after fuzzing, /health answers {alive}")
    print(tally.report())
    return 1 if tally.server_errors or tally.failures else 0


class demo_server:
    """A proxy on the demo models in a scratch cache dir, with the upstream off.

    Off rather than unreachable: a model not served here then gets a 404 on every route,
    where an unreachable upstream would rightly answer /api/v0 requests with a 502.
    """

    def __enter__(self) -> str:
        from engine_bridge.models.demo import ensure_demo_model
        from tests.conftest import DEMO_IDS, start_server

        self._tmp = tempfile.TemporaryDirectory(prefix="mlx-fuzz-")
        root = Path(self._tmp.name)
        for name in DEMO_IDS:
            ensure_demo_model(name, root)
        self.server = start_server(root, env=UPSTREAM_OFF)
        return self.server.url

    def __exit__(self, *exc) -> None:
        self.server.stop()
        self._tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())

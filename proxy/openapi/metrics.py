"""The OpenAPI document of GET /metrics (see metrics.py); openapi.document merges `paths()`."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_TEXT = {
    "type": "string",
    "description": "Prometheus exposition text: one `# HELP`, `# TYPE` and samples per metric",
}


def paths() -> dict[str, Schema]:
    return {
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "description": "Requests, prompt and cached tokens by model, tenant and cache "
                "source; TTFT, prefill speed and restore time histograms; why requests hit or "
                "missed; sessions; answers with status 400 or more by route. And every number "
                "of `GET /v1/cache/stats` (requests, scheduler, memory, RAM, SSD, shared "
                "store, writes, vision: levels as gauges, counts as counters, faults "
                "included), read at the scrape and named `mlx_prompt_cache_<section>_<field>` "
                "unless an older name stands (docs/observability.md). "
                "`Accept: application/openmetrics-text` gets OpenMetrics. "
                "With [tenants] api_keys enforced, per-tenant series are the key's tenant's.",
                "tags": ["admin"],
                "responses": {
                    "200": {
                        "description": "the metrics, in the format the Accept header asks for",
                        "content": {
                            "text/plain": {"schema": _TEXT},
                            "application/openmetrics-text": {"schema": _TEXT},
                        },
                    }
                },
            }
        }
    }

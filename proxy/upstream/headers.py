"""Which headers cross the hop to the upstream and back.

The hop-by-hop headers (and any the Connection header names) stay on their own hop, a
request's Host, Content-Length and Expect are the proxy's to set, and with `[upstream]
api_token` LM Studio's token replaces the key the client sent.
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.config.model import UpstreamConfig

# RFC 9110 §7.6.1 connection-specific headers, plus the de-facto Proxy-Connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Host names the upstream, Content-Length is recomputed from the body actually sent, and
# Expect: 100-continue was already answered to the client when its body was read.
REQUEST_ONLY_DROP = frozenset({"host", "content-length", "expect"})


def filtered(headers: CIMultiDictProxy[str], drop: Iterable[str]) -> CIMultiDict[str]:
    # Headers named in Connection are hop-by-hop for this hop only (RFC 9110 §7.6.1).
    dropped = set(drop)
    for value in headers.getall("Connection", []):
        dropped.update(t.strip().lower() for t in value.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in dropped or low.startswith("proxy-"):
            continue
        out.add(name, value)
    return out


def with_token(headers: CIMultiDict[str], config: UpstreamConfig) -> CIMultiDict[str]:
    """With `[upstream] api_token` set, LM Studio's token replaces whatever key the client
    sent (that one is for this proxy, or a placeholder)."""
    if config.api_token is not None:
        headers["Authorization"] = f"Bearer {config.api_token}"
    return headers

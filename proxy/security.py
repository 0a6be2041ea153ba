"""Browser safety: which Host, Origin, content type and API key a request may carry.

A local HTTP server is reachable by every web page the user opens. Three checks close
that door, in the order a request meets them:

- **Host allowlist.** DNS rebinding points an attacker's name at 127.0.0.1, so the page
  becomes "same-origin" with us; its requests still carry ``Host: attacker.example``.
  Only loopback names, the bind address and ``[server] allowed_hosts`` are answered.
- **Origin on state-changing requests.** A cross-origin form or ``fetch(no-cors)`` POST
  needs no preflight; the browser marks it with ``Origin``. SDKs and curl send none.
- **JSON content type.** The only bodies a page can send cross-origin without a preflight
  are ``text/plain``, form-encoded and multipart, so a route served here that reads a body
  takes only ``application/json``.

CORS stays off unless ``[server] cors_origins`` lists origins; then those get the
``Access-Control-*`` headers and nothing else does, including what the upstream sends.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web

from .errors import ApiError

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Routes that anyone who can reach the port may call without an API key (probes, menus).
KEYLESS_PATHS = frozenset({"/health"})
# Routes a browser loads by navigating, which sends no key: the dashboard's page and files
# hold no data, and the page sends the key itself on every call that reads or changes some.
KEYLESS_ROUTES = frozenset({"dashboard", "dashboard_asset"})
# The catch-all route that hands requests to the upstream; the upstream judges their bodies.
PASSTHROUGH_ROUTE = "passthrough"
# Headers a listed origin's page may read from our responses (fetch hides the rest).
EXPOSED_HEADERS = (
    "x-request-id, x-prompt-cache-hit-tokens, x-prompt-cache-source, "
    "x-prompt-cache-diverged-at, retry-after"
)
ALLOWED_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"


# ---------------------------------------------------------------------------------------
# Parsing Host values and origins


def split_host(value: str) -> tuple[str, int | None]:
    """``"[::1]:1235"`` → ``("::1", 1235)``; names lower-cased, IPs in canonical form.

    Raises ValueError for something that is not a host with an optional port.
    """
    text = value.strip()
    if not text or any(c.isspace() or c in "/@?#\\" for c in text):
        raise ValueError(f"{value!r} is not a host name or address (no scheme, path or spaces)")
    port_text = ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{value!r}: unclosed '['")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{value!r}: unexpected text after ']'")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        if not port_text:
            raise ValueError(f"{value!r}: empty port")
    else:
        host = text  # a bare name, IPv4 address, or IPv6 address without brackets
    port = None
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
            raise ValueError(f"{value!r}: port {port_text!r} is not a number in 1..65535")
        port = int(port_text)
    return _canonical(host, value), port


def _canonical(host: str, value: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    if not name or any(c in "[]:" for c in name):
        raise ValueError(f"{value!r} is not a host name or address")
    return name


def is_loopback(host: str) -> bool:
    """Whether a host (name or address, as ``split_host`` returns it) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


Origin = tuple[str, str, int]


def parse_origin(value: str) -> Origin | None:
    """``"http://LocalHost:1235"`` → ``("http", "localhost", 1235)``; None for "null" or junk."""
    scheme, sep, rest = value.strip().partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        return None
    try:
        host, port = split_host(rest)
    except ValueError:
        return None
    return scheme, host, port or (443 if scheme == "https" else 80)


def check_origin_entry(value: str) -> None:
    """Raise ValueError unless a ``cors_origins`` entry is ``"*"`` or scheme://host[:port]."""
    if value != "*" and parse_origin(value) is None:
        raise ValueError(
            f"{value!r} is not an origin: use scheme://host[:port] with no path, "
            'like "http://localhost:3000", or "*"'
        )


def check_host_entry(value: str) -> None:
    """Raise ValueError unless an ``allowed_hosts`` entry is ``"*"`` or host[:port]."""
    if value != "*":
        split_host(value)


# ---------------------------------------------------------------------------------------
# The policy


@dataclass(slots=True, frozen=True)
class BrowserPolicy:
    """What the middleware enforces; the default is a loopback-only server without keys."""

    # (host, port or None for any port); loopback names are always allowed.
    allowed_hosts: frozenset[tuple[str, int | None]] = frozenset()
    any_host: bool = False
    cors_origins: frozenset[Origin] = frozenset()
    any_origin: bool = False
    # Set only when the server is reachable from the network and [tenants] api_keys exist.
    api_keys: tuple[str, ...] = field(default_factory=tuple)

    @property
    def cors_enabled(self) -> bool:
        return self.any_origin or bool(self.cors_origins)

    def host_allowed(self, host: str, port: int | None) -> bool:
        if self.any_host or is_loopback(host):
            return True
        return (host, None) in self.allowed_hosts or (host, port) in self.allowed_hosts

    def cors_allowed(self, origin: str) -> bool:
        return self.any_origin or parse_origin(origin) in self.cors_origins

    def key_valid(self, key: str | None) -> bool:
        # compare_digest against every key, so the time taken does not say which was close.
        if key is None:
            return False
        # surrogatepass: a key header whose bytes are not UTF-8 is a wrong key, not a 500.
        raw = key.encode("utf-8", "surrogatepass")
        found = False
        for known in self.api_keys:
            found |= hmac.compare_digest(raw, known.encode())
        return found


def bind_hosts(bind: str) -> list[str]:
    """Host names a client of this bind address may use, beyond the loopback ones."""
    if bind in WILDCARD_BINDS:
        # Every address of every interface: an IP-literal Host cannot come from DNS
        # rebinding, and LAN clients that dial an address send that address.
        import psutil

        hosts = []
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    hosts.append(a.address.split("%")[0])
        return hosts
    return [bind]


def browser_policy(
    bind: str,
    allowed_hosts: Iterable[str] = (),
    cors_origins: Iterable[str] = (),
    api_keys: Iterable[str] = (),
) -> BrowserPolicy:
    """The policy for a server bound to ``bind`` with the given ``[server]`` lists."""
    allowed_hosts, cors_origins = list(allowed_hosts), list(cors_origins)
    hosts: set[tuple[str, int | None]] = set()
    for entry in [*bind_hosts(bind), *allowed_hosts]:
        if entry == "*":
            continue
        hosts.add(split_host(entry))
    origins = {parse_origin(o) for o in cors_origins if o != "*"}
    exposed = not is_loopback_bind(bind)
    return BrowserPolicy(
        allowed_hosts=frozenset(hosts),
        any_host="*" in allowed_hosts,
        cors_origins=frozenset(o for o in origins if o is not None),
        any_origin="*" in cors_origins,
        api_keys=tuple(api_keys) if exposed else (),
    )


def is_loopback_bind(bind: str) -> bool:
    if bind in WILDCARD_BINDS:
        return False
    try:
        return is_loopback(split_host(bind)[0])
    except ValueError:
        return False


POLICY = web.AppKey("browser_policy", BrowserPolicy)


def setup_browser_safety(app: web.Application, policy: BrowserPolicy) -> None:
    """Install the checks; the middleware must run inside the app's error middleware."""
    app[POLICY] = policy
    app.on_response_prepare.append(_cors_headers)


# ---------------------------------------------------------------------------------------
# The middleware


@web.middleware
async def browser_safety(request: web.Request, handler):
    policy = request.app[POLICY]
    host, port = _check_host(request, policy)
    origin = request.headers.get("Origin")
    if _is_preflight(request):
        return _preflight(request, policy, origin or "")
    if origin is not None and _needs_origin_check(request):
        if not (_same_origin(origin, host, port) or policy.cors_allowed(origin)):
            raise ApiError(
                403,
                f"Origin {origin!r} may not {request.method} {request.path}: only pages "
                "served from this server, or origins listed in [server] cors_origins, may "
                "send state-changing requests (a web page elsewhere must not drive it)",
                code="origin_not_allowed",
            )
    if policy.api_keys and not _keyless(request):
        if not policy.key_valid(api_key(request)):
            raise ApiError(
                401,
                "missing or unknown API key: this server is reachable from the network, so "
                "send one of [tenants] api_keys as 'Authorization: Bearer KEY' or 'x-api-key'",
                code="invalid_api_key",
            )
    if _reads_json_body(request):
        _check_json_type(request)
    return await handler(request)


def api_key(request: web.Request) -> str | None:
    """The key a client presented, the way both SDKs send it."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _keyless(request: web.Request) -> bool:
    # By route name, not path prefix: /dashboard/a/b is not a dashboard route but the
    # passthrough's, and must not reach the upstream without a key.
    return request.path in KEYLESS_PATHS or request.match_info.route.name in KEYLESS_ROUTES


def _check_host(request: web.Request, policy: BrowserPolicy) -> tuple[str, int | None]:
    # Not request.host: aiohttp falls back to this machine's name when Host is missing.
    values = request.headers.getall("Host", [])
    how = "add it to [server] allowed_hosts in the config file"
    if len(values) != 1:
        raise ApiError(
            403,
            f"request has {len(values)} Host headers; exactly one naming this server is needed",
            code="host_not_allowed",
        )
    try:
        host, port = split_host(values[0])
    except ValueError:
        raise ApiError(
            403, f"Host {values[0]!r} is not a host name; {how}", code="host_not_allowed"
        ) from None
    if not policy.host_allowed(host, port):
        raise ApiError(
            403,
            f"Host {values[0]!r} is not allowed: this server answers to localhost, 127.0.0.1, "
            f"::1 and its bind address; to reach it as {host!r}, {how} "
            f'(allowed_hosts = ["{host}"]). The check stops DNS-rebinding attacks from web pages.',
            code="host_not_allowed",
        )
    return host, port


def _is_preflight(request: web.Request) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


def _preflight(request: web.Request, policy: BrowserPolicy, origin: str) -> web.Response:
    if not policy.cors_allowed(origin):
        raise ApiError(
            403,
            f"cross-origin requests from {origin!r} are not allowed: CORS is "
            + (
                "on only for the origins in [server] cors_origins"
                if policy.cors_enabled
                else "off; list the origin in [server] cors_origins to allow it"
            ),
            code="origin_not_allowed",
        )
    headers = {
        "Access-Control-Allow-Methods": ALLOWED_METHODS,
        "Access-Control-Max-Age": "600",
    }
    if wanted := request.headers.get("Access-Control-Request-Headers"):
        headers["Access-Control-Allow-Headers"] = wanted
    # _cors_headers adds the Allow-Origin and Vary headers as the response is prepared.
    return web.Response(status=204, headers=headers)


def _needs_origin_check(request: web.Request) -> bool:
    # Browsers apply no CORS to WebSockets: an upgrade is as state-changing as a POST.
    upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
    return request.method in STATE_CHANGING or upgrade


def _same_origin(origin: str, host: str, port: int | None) -> bool:
    """A page of this server: the origin is the Host it dialled, or loopback on that port."""
    parsed = parse_origin(origin)
    if parsed is None:
        return False
    scheme, o_host, o_port = parsed
    port = port or 80
    return scheme == "http" and o_port == port and (o_host == host or is_loopback(o_host))


def _reads_json_body(request: web.Request) -> bool:
    if request.method not in STATE_CHANGING or not request.body_exists:
        return False
    route = request.match_info.route
    return route.name != PASSTHROUGH_ROUTE


def _check_json_type(request: web.Request) -> None:
    sent = request.headers.get("Content-Type")
    mime = (sent or "").split(";")[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    what = f"Content-Type {sent!r}" if sent else "no Content-Type"
    raise ApiError(
        415,
        f"{request.method} {request.path} takes a JSON body, and the request has {what}; "
        "send it with 'Content-Type: application/json'",
        param="Content-Type",
        code="unsupported_media_type",
    )


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Our CORS policy on every response, replacing whatever the upstream said."""
    preflight = _is_preflight(request)  # answered here, never by the upstream
    if not preflight:
        for name in {n for n in response.headers if n.lower().startswith("access-control-")}:
            response.headers.popall(name, None)
    policy = request.app.get(POLICY)
    if policy is None or not policy.cors_enabled:
        return
    vary = response.headers.get("Vary", "")
    if "origin" not in vary.lower():
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
    origin = request.headers.get("Origin")
    if origin is not None and policy.cors_allowed(origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        if not preflight:
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS

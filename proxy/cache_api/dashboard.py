"""GET /dashboard: the cache dashboard, a static page that polls the /v1/cache/* routes.

The page and its assets are files under ``dashboard_static/`` (no build step, no CDN; the
chart library is vendored). They hold no data, so they are served without an API key: the
page asks for one when the JSON routes answer 401, and sends it itself. Assets are served
from a fixed list of names read at import, so no request path ever reaches the filesystem.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from ..errors import ApiError

STATIC = Path(__file__).resolve().parent / "dashboard_static"
PAGE = "index.html"
PAGE_ROUTE = "dashboard"
ASSET_ROUTE = "dashboard_asset"
# Same-origin only: no inline script or style, no framing, nothing fetched elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# By suffix, not mimetypes: its answer for .js depends on the machine's /etc/mime.types.
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _assets() -> dict[str, Path]:
    """Served name -> file: the page's own files, and vendor/ files under their bare names."""
    found = {p.name: p for p in STATIC.iterdir() if p.is_file() and p.name != PAGE}
    vendor = STATIC / "vendor"
    for p in vendor.iterdir():
        assert p.name not in found, f"vendor file {p.name} shadows a dashboard file"
        found[p.name] = p
    return dict(sorted(found.items()))


ASSETS = _assets()


def _file_response(path: Path) -> web.Response:
    kind = TYPES.get(path.suffix, "text/plain; charset=utf-8")
    return web.Response(body=path.read_bytes(), headers={**HEADERS, "Content-Type": kind})


async def page(request: web.Request) -> web.Response:
    return _file_response(STATIC / PAGE)


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    path = ASSETS.get(name)
    if path is None:
        raise ApiError(
            404,
            f"no dashboard file named {name!r}; the dashboard serves {', '.join(ASSETS)}",
            param="asset",
            code="not_found",
        )
    return _file_response(path)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/dashboard", page, name=PAGE_ROUTE)
    app.router.add_get("/dashboard/{asset}", asset, name=ASSET_ROUTE)


def openapi_paths() -> dict:
    """The two routes' entries in /openapi.json."""

    def ok(what: str, media: str) -> dict:
        return {"description": what, "content": {media: {"schema": {"type": "string"}}}}

    return {
        "/dashboard": {
            "get": {
                "summary": "the cache dashboard (HTML; polls the /v1/cache routes)",
                "tags": ["admin"],
                "responses": {"200": ok("the page", "text/html")},
            }
        },
        "/dashboard/{asset}": {
            "get": {
                "summary": "a script, style sheet or license file of the dashboard",
                "tags": ["admin"],
                "parameters": [
                    {
                        "name": "asset",
                        "in": "path",
                        "required": True,
                        "schema": {"enum": list(ASSETS)},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "the file",
                        "content": {"*/*": {"schema": {"type": "string"}}},
                    },
                    "404": {
                        "description": "no dashboard file of that name",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/OpenAIError"}
                            }
                        },
                    },
                },
            }
        },
    }

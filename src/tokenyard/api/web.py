"""The two browser pages: the chat page at ``/`` and the operator dashboard at
``/dashboard``, with their scripts and style under ``/static/``.

Plain files shipped as package data (`api/web/static/`; a data folder beside this
module, not a package), read once when the application
is built: no build step, nothing fetched from elsewhere. The pages themselves need no
key (they hold no data); what they show comes from the API with the key the user gives
them, so the middleware lets these paths through (`is_public`).

Every answer carries a strict Content-Security-Policy: scripts and styles only from this
origin, no inline script or style attribute, no framing. The pages build their DOM with
`textContent` and element creation only, so a reply's text can never become markup.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

#: Where the static files are served from.
STATIC_PREFIX = "/static/"
#: Page path → its file.
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # Revalidated each load: an upgraded server's pages are never mixed with cached ones.
    "Cache-Control": "no-cache",
}


def is_public(path: str) -> bool:
    """Whether `path` is one of the pages or their static files (served without a key)."""
    return path in PAGES or path.startswith(STATIC_PREFIX)


def _load() -> dict[str, tuple[bytes, str]]:
    """Every static file: name → (bytes, content type)."""
    files: dict[str, tuple[bytes, str]] = {}
    for entry in (resources.files("tokenyard.api") / "web" / "static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return files


def add_web_routes(app: web.Application) -> None:
    """Register the pages and their static files on `app`."""
    files = _load()

    def serve(name: str) -> web.Response:
        body, content_type = files[name]
        response = web.Response(body=body, headers=SECURITY_HEADERS)
        response.content_type, _, _charset = content_type.partition("; charset=")
        if _charset:
            response.charset = _charset
        return response

    async def page(request: web.Request) -> web.Response:
        return serve(PAGES[request.path])

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in files:  # a fixed set of names: no path reaches the file system
            raise web.HTTPNotFound()
        return serve(name)

    for path in PAGES:
        app.router.add_get(path, page)
    app.router.add_get(STATIC_PREFIX + "{name}", static)

"""The live cluster page: static files the master API serves at ``/ui``.

Design. The page (``master/page/``: ``index.html``, ``app.js``, ``style.css``; package
data, read once at construction) is a client of the existing JSON API and nothing more:
its script polls ``GET /status`` with ``Authorization: Bearer <token or id:secret>``, as
``gcache status`` does, and draws members, tier usage and each server's recent hit rate,
GB/s and p99 (the heartbeat figures of ``server/recent.py``) as hand-written SVG charts
over the last minutes of polls, which it keeps in the browser. No build step, no CDN:
the page works offline.

Auth. The files answer without a credential, because they hold no cluster data (no
member, address, epoch or version): the page asks for the credential, or takes it from
the URL fragment ``#token=...`` (a fragment is never sent to a server), keeps it in the
tab's ``sessionStorage`` and sends it only to ``/status`` on the same origin. A
credential that may not call ``/status`` (not a cluster admin) sees the API's 401/403
message on the page.

Bounds. ``ClusterPage.get`` looks the request path up in a fixed table: no file name
is ever built from a request, so nothing outside these files can be served. Every file
goes out with a Content-Security-Policy that allows only this origin's script, style and
``/status`` (no inline script, no third-party fetch: an id or address a server reported
cannot run as script, and the page writes them with ``textContent`` only), ``nosniff``
and ``no-referrer``. The request itself is under the API's usual limits
(``gcache.bounded_aiohttp``: deadline, connection caps).
"""

from __future__ import annotations

from importlib import resources
from typing import NamedTuple

#: what the page's files are served with (the API adds Content-Type and Content-Length)
PAGE_HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-cache"),
)

# request path -> (file in master/page/, Content-Type)
_ROUTES: dict[str, tuple[str, str]] = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}


class PageFile(NamedTuple):
    body: bytes
    content_type: str


class ClusterPage:
    """The page's files, read from the installed package once."""

    def __init__(self) -> None:
        """``RuntimeError`` when a file is missing from the installation (a wheel built
        without the package data)."""
        root = resources.files("gcache.master") / "page"
        self._files: dict[str, PageFile] = {}
        for path, (name, ctype) in _ROUTES.items():
            try:
                body = (root / name).read_bytes()
            except OSError as exc:
                raise RuntimeError(f"the cluster page's {name} is missing from this gcache "
                                   f"installation ({exc}): reinstall gcache (its wheel ships "
                                   "gcache/master/page/)") from None
            self._files[path] = PageFile(body, ctype)

    def get(self, path: str) -> PageFile | None:
        """The file served at ``path`` (the URL path, without query), or None."""
        return self._files.get(path)

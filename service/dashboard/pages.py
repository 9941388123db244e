"""The dashboard's HTML pages and static assets.

Every page is a static shell: the HTML carries no run data at all (names, tags, config and messages
arrive as JSON and are written with ``textContent``), so nothing a trainer logs can become markup.
A strict Content-Security-Policy (no inline script) backs that up.

Assets are served from this package; plotly.js comes from the installed ``plotly`` Python package
(``plotly/package_data/plotly.min.js``), so the dashboard works air-gapped. Asset URLs carry a content
hash (``?v=…``) and are cached as immutable; pages themselves are never cached.
"""

from __future__ import annotations

import hashlib
import json
import mimetypes
from dataclasses import dataclass
from functools import cache
from html import escape as html_escape
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter
from rlvitals.service.errors import NotFound
from starlette.responses import HTMLResponse, Response

PACKAGE_DIR = Path(__file__).resolve().parent
STATIC_DIR = PACKAGE_DIR / "static"
TEMPLATE_DIR = PACKAGE_DIR / "templates"
PLOTLY_ROUTE = "vendor/plotly.min.js"
SIGNALS_ROUTE = "js/signals.js"
# Panels of the run page, in this order, before every other metric.
PANEL_ORDER = ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower", "kl_loss", "entropy", "pg_loss")

# plotly.js builds style sheets at runtime (inline <style>), hence 'unsafe-inline' for styles only.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
ASSET_CACHE = "public, max-age=31536000, immutable"

# page name -> (template, <title>, the scripts it loads after common.js, prefetch mode)
PAGES: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "runs": ("runs.html", "Runs", ("js/runs.js",), "runs"),
    "run": (
        "run.html",
        "Run",
        (SIGNALS_ROUTE, "js/charts.js", "js/marks.js", "js/runhead.js", "js/sections.js", "js/run.js"),
        "run",
    ),
    "audits": ("audits.html", "Audits", (SIGNALS_ROUTE, "js/charts.js", "js/audits.js"), "audits"),
    "alerts": ("alerts.html", "Alerts", ("js/alerts.js",), "alerts"),
    "mismatch": ("mismatch.html", "Rollout vs training", ("js/mismatch.js",), "mismatch"),
    "compare": (
        "compare.html",
        "Compare runs",
        ("js/signals.js", "js/charts.js", "js/compare.js"),
        "compare",
    ),
}
PLOTLY_PAGES = frozenset({"audits", "compare", "mismatch"})
# The run page draws its first charts as light SVG previews and loads plotly.js after the first one:
# downloading and booting plotly.js costs 1-2 s of server and main thread on a busy machine, which
# must not stand between a user and the first chart. Its first request (the first panel's series)
# is preloaded from the HTML, so it starts with the page's own assets.
LAZY_PLOTLY_PAGES = frozenset({"run"})
FIRST_SERIES_POINTS = 2000


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    digest: str


def plotly_js_path() -> Path:
    """The plotly.min.js that ships inside the installed ``plotly`` Python package."""
    path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise RuntimeError(f"plotly.min.js not found at {path}; is the 'plotly' package installed?")
    return path


def _asset(body: bytes, name: str) -> Asset:
    media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if media_type.startswith("text/") or media_type.endswith("javascript"):
        media_type += "; charset=utf-8"
    return Asset(body=body, media_type=media_type, digest=hashlib.sha256(body).hexdigest()[:12])


def _load(path: Path) -> Asset:
    return _asset(path.read_bytes(), path.name)


@cache
def signal_table() -> dict[str, Any]:
    """The analyzers' alias tables in panel order: the charts group metrics exactly as the health
    rules read them (one source of truth for verl / TRL / OpenRLHF names)."""
    from rlvitals.analyzers.health import signals

    return {
        "order": [s for s in PANEL_ORDER if s in signals.ALIASES]
        + [s for s in signals.ALIASES if s not in PANEL_ORDER],
        "aliases": {name: list(raws) for name, raws in signals.ALIASES.items()},
        "prefixes": list(signals.PREFIXES),  # ("train/",): how W&B / HF Trainer prefix TRL's logs
    }


def signals_script() -> bytes:
    """``window.RLV_SIGNALS = <signal_table()>`` for the browser."""
    # JSON is a JS expression; "</" is escaped so the text can never close a script element.
    text = json.dumps(signal_table(), separators=(",", ":")).replace("</", "<\\/")
    return f"window.RLV_SIGNALS = {text};\n".encode()


@cache
def assets() -> dict[str, Asset]:
    """Every servable static file by its URL path under /static (read once per process)."""
    found = {
        str(path.relative_to(STATIC_DIR)).replace("\\", "/"): _load(path)
        for path in sorted(STATIC_DIR.rglob("*"))
        if path.is_file()
    }
    found[PLOTLY_ROUTE] = _load(plotly_js_path())
    found[SIGNALS_ROUTE] = _asset(signals_script(), "signals.js")
    return found


def asset_url(name: str) -> str:
    return f"/static/{name}?v={assets()[name].digest}"


@cache
def render_page(page: str) -> bytes:
    """The page's HTML: layout + body template; only constants from this module are substituted."""
    template, title, scripts, prefetch = PAGES[page]
    layout = (TEMPLATE_DIR / "_layout.html").read_text(encoding="utf-8")
    body = (TEMPLATE_DIR / template).read_text(encoding="utf-8")
    head = [f'<link rel="stylesheet" href="{asset_url("dashboard.css")}">']
    tail = []
    if page in LAZY_PLOTLY_PAGES:
        head.append(f'<meta name="rlv-plotly" content="{asset_url(PLOTLY_ROUTE)}">')
        head.append(
            '<link rel="preload" as="fetch" crossorigin="anonymous" id="first-series" href="{{first_series}}">'
        )
    # common.js runs first and synchronously: it starts the page's data requests (and the event
    # stream) at once.
    head.append(f'<script src="{asset_url("js/common.js")}" data-prefetch="{prefetch}"></script>')
    if page in PLOTLY_PAGES:
        tail.append(f'<script src="{asset_url(PLOTLY_ROUTE)}"></script>')
    tail += [f'<script src="{asset_url(name)}"></script>' for name in scripts]
    html = (
        layout.replace("{{title}}", title)
        .replace("{{page}}", page)
        .replace("{{head}}", "\n  ".join(head))
        .replace("{{body}}", body)
        .replace("{{scripts}}", "\n  ".join(tail))
    )
    return html.encode("utf-8")


def _page(page: str) -> HTMLResponse:
    return HTMLResponse(render_page(page), headers=PAGE_HEADERS)


def first_series_url(run_id: int) -> str:
    """The run page's first request: the first panel's metric, asked for by all its aliases."""
    table = signal_table()
    aliases = table["aliases"][table["order"][0]]
    names = aliases + [prefix + a for prefix in table["prefixes"] for a in aliases]
    query = urlencode({"names": ",".join(names), "max_points": FIRST_SERIES_POINTS, "wall_time": "true"})
    return f"/api/v1/runs/{int(run_id)}/metrics?{query}"


def _run_page(run_id: int) -> HTMLResponse:
    # the only per-request part of any page: an integer, in a URL we build
    html = render_page("run").replace(b"{{first_series}}", html_escape(first_series_url(run_id)).encode())
    return HTMLResponse(html, headers=PAGE_HEADERS)


def build_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    def runs_page() -> HTMLResponse:
        return _page("runs")

    @router.get("/runs/{run_id}")
    def run_page(run_id: int) -> HTMLResponse:
        return _run_page(run_id)

    @router.get("/runs/{run_id}/audits")
    def audits_page(run_id: int) -> HTMLResponse:
        return _page("audits")

    @router.get("/runs/{run_id}/mismatch")
    def run_mismatch_page(run_id: int) -> HTMLResponse:
        return _page("mismatch")

    @router.get("/mismatch")
    def mismatch_page() -> HTMLResponse:
        return _page("mismatch")

    @router.get("/alerts")
    def alerts_page() -> HTMLResponse:
        return _page("alerts")

    @router.get("/compare")
    def compare_page() -> HTMLResponse:
        return _page("compare")

    @router.get("/static/{name:path}")
    def static_asset(name: str) -> Response:
        asset = assets().get(name)  # a lookup in a fixed table: no path is ever joined from input
        if asset is None:
            raise NotFound(f"no such static file: {name}")
        return Response(
            asset.body,
            media_type=asset.media_type,
            headers={
                "Cache-Control": ASSET_CACHE,
                "ETag": f'"{asset.digest}"',
                "X-Content-Type-Options": "nosniff",
            },
        )

    return router

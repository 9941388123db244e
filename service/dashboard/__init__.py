"""The live dashboard: HTML pages and static assets, as one ``router`` that
``rlvitals.service.app.create_app`` includes.

- ``pages``: ``/``, ``/runs/{id}``, ``/runs/{id}/audits``, ``/alerts``, ``/compare`` and ``/static/…``
  (plotly.js from the installed ``plotly`` package: no CDN, works air-gapped).

The pages are clients of API v1 only (and its SSE stream), in the browser: series with wall times
and step ranges (``GET /api/v1/runs/{id}/metrics?wall_time=true``, ETag-cached), metric names
(``/api/v1/runs/{id}/metric-names``), the health rules' marks (``/api/v1/runs/{id}/health``) and an
audit's histograms (``/api/v1/audits/{id}/histograms``). Nothing here imports the audit worker's
path (``service.audits``, ``service.batches``, ``analyzers``' torch code): ``tests/dashboard`` checks.
"""

from fastapi import APIRouter
from rlvitals.service.dashboard.pages import build_router as _pages_router

router = APIRouter(include_in_schema=False)
router.include_router(_pages_router())

__all__ = ["router"]

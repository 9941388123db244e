"""The live dashboard: HTML pages, static assets and a few JSON helpers, as one ``router`` that
``rlvitals.service.app.create_app`` includes.

- ``pages``: ``/``, ``/runs/{id}``, ``/runs/{id}/audits``, ``/alerts``, ``/compare`` and ``/static/…``
  (plotly.js from the installed ``plotly`` package: no CDN, works air-gapped);
- ``api``: ``/dashboard-api/…`` (batch histograms for the audits page);
- ``histograms``: the torch code behind them.

The pages get all data from API v1 (and its SSE stream) in the browser.
"""

from fastapi import APIRouter
from rlvitals.service.dashboard.api import build_router as _api_router
from rlvitals.service.dashboard.pages import build_router as _pages_router

router = APIRouter(include_in_schema=False)
router.include_router(_pages_router())
router.include_router(_api_router())

__all__ = ["router"]

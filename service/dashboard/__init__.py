"""The live dashboard (HTML pages + static assets), mounted by ``rlvitals.service.app.create_app``."""

from fastapi import APIRouter

router = APIRouter(include_in_schema=False)

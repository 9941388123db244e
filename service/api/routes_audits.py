"""/api/v1 batches and audits: upload safetensors for audit, read results."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from rlvitals.service import audits, batches
from rlvitals.service.api.deps import (
    MAX_ID,
    AuditId,
    Offset,
    RunId,
    ServicesDep,
    WriteAuth,
    spool_body,
    upload_client,
)
from rlvitals.service.context import Services
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.errors import InvalidInput, UnsupportedMediaType
from rlvitals.service.schemas import AuditPublic, AuditsPublic, BatchAccepted, HistogramsPublic
from rlvitals.service.storage.blobs import SpooledBody

router = APIRouter(prefix="/api/v1", tags=["audits"])

BATCH_TYPES = ("application/octet-stream", "application/safetensors", "application/x-safetensors")

_BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "description": "A safetensors file: tensors log_prob, old_log_prob, advantages, response_mask "
        "(+ ref_log_prob, entropy, token_level_rewards, group_index, rollout_log_probs); metadata step, config, reported, "
        "rank, micro_batch, record_id (a resend with the same record_id is stored once).",
    }
}


def _submit(services: Services, run_id: int, body: SpooledBody) -> tuple[int, str | None]:
    settings = services.settings
    try:
        with body.mapped() as view:  # the tensors are views of the spooled file, dropped in the block
            batch = batches.validate(
                view, max_json_depth=settings.max_json_depth, max_tokens=settings.max_audit_tokens
            )[0]
    except InvalidInput:
        services.telemetry.count_batch("invalid")
        raise
    return services.audits.submit(run_id=run_id, batch=batch, blob=body)  # streamed into the row


@router.post(
    "/runs/{run_id}/batches",
    response_model=BatchAccepted,
    status_code=202,
    dependencies=[WriteAuth],
    openapi_extra=_BINARY_BODY,
    responses={
        200: {
            "model": BatchAccepted,
            "description": "A resend of an upload already stored (same metadata record_id on this run): "
            "the same audit id and its current status; nothing is stored or queued again.",
        }
    },
)
async def post_batch(run_id: RunId, request: Request, services: ServicesDep) -> JSONResponse:
    """Queue a tensor batch for audit (202). A resend with the same ``record_id`` -> 200, same id.
    Bad tensors/metadata -> 422; too big -> 413; queue full -> 429 with Retry-After."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in BATCH_TYPES:  # a browser's CORS "simple" POST (text/plain, forms, none) never passes
        raise UnsupportedMediaType(
            "send the batch as safetensors bytes with Content-Type application/octet-stream, not "
            f"{ctype or 'no Content-Type'}",
            detail={"allowed": list(BATCH_TYPES)},
        )
    declared = request.headers.get("content-length", "")
    held = int(declared) if declared.isdigit() else services.settings.max_batch_bytes
    held = min(held, services.settings.max_batch_bytes)
    client = upload_client(request)
    with request.app.state.uploads.admit(held, client, run_id), request.app.state.parsing.hold(held, client):
        body = await spool_body(
            request,
            services.settings.max_batch_bytes,
            grace=services.settings.body_timeout,
            min_rate=services.settings.upload_min_rate,
        )
        try:
            audit_id, resent_status = await run_in_threadpool(_submit, services, run_id, body)
        finally:
            body.close()
    if resent_status is not None:
        return JSONResponse({"id": audit_id, "status": resent_status}, status_code=200)
    return JSONResponse({"id": audit_id, "status": "pending"}, status_code=202)


@router.get("/runs/{run_id}/audits", response_model=AuditsPublic)
async def list_audits(
    run_id: RunId,
    services: ServicesDep,
    step: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Offset = 0,
) -> JSONResponse:
    return JSONResponse(
        await run_in_threadpool(audits.list_audits, services, run_id, step=step, limit=limit, offset=offset)
    )


@router.get("/audits/{audit_id}", response_model=AuditPublic)
async def get_audit(audit_id: AuditId, services: ServicesDep) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(audits.get_audit, services, audit_id))


@router.get("/audits/{audit_id}/histograms", response_model=HistogramsPublic)
async def get_audit_histograms(audit_id: AuditId, services: ServicesDep) -> JSONResponse:
    """Histograms of the importance ratio and the advantages of the batch behind an audit, with the
    clip bounds of its config. Stored by the audit worker after each audit; else computed from the
    batch's tensors while the server still holds them; otherwise 404 saying why."""
    return JSONResponse(await run_in_threadpool(audits.audit_histograms, services, audit_id))

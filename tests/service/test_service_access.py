"""Keys that stay closed, reads behind keys, the Host allowlist, browser-proof uploads (issue 13, item 3).

Before: revoking the last key reopened writes to everyone (and so the revoked key "worked" again);
reads were open whatever the keys; any Host was served (DNS rebinding); a ``text/plain`` batch POST
(a CORS simple request any web page may send) was accepted; ``/docs`` had no CSP.
"""

from __future__ import annotations

import base64

import pytest
from rlvitals.service.auth import create_key, revoke_key

from rlvitals.cli import main as rlvitals_main
from tests.service.batchdata import OCTET, make_batch


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def basic(key: str, user: str = "me") -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


def new_key(api, name: str = "ci") -> tuple[int, str]:
    made = create_key(api.services.db, name=name)
    api.services.auth.invalidate()
    return made


def test_revoking_the_last_key_keeps_writes_closed_until_keys_open(app_client, tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/keys.db"
    api = app_client(url)
    assert api.post("/api/v1/runs", json={"name": "open"}).status_code == 201  # no key yet: open
    key_id, key = new_key(api)
    assert api.post("/api/v1/runs", json={"name": "a"}, headers=bearer(key)).status_code == 201
    assert revoke_key(api.services.db, ident=str(key_id)) == 1
    api.services.auth.invalidate()
    for headers in ({}, bearer(key)):  # the revoked key never works again, nor does no key
        refused = api.post("/api/v1/runs", json={"name": "b"}, headers=headers)
        assert refused.status_code == 401, refused.text
        fast = api.post("/api/v1/runs/1/metrics", json={"steps": [{"step": 1, "metrics": {"x": 1.0}}]},
                        headers=headers)  # fmt: skip
        assert fast.status_code == 401, fast.text

    second_id, _ = new_key(api, "second")
    assert rlvitals_main(["keys", "--database-url", url, "open"]) == 1  # an active key exists
    assert "revoke them first" in capsys.readouterr().err
    revoke_key(api.services.db, ident=str(second_id))
    assert rlvitals_main(["keys", "--database-url", url, "open"]) == 0
    assert "2 revoked key(s) forgotten" in capsys.readouterr().out
    api.services.auth.invalidate()
    assert api.post("/api/v1/runs", json={"name": "c"}).status_code == 201


def test_reads_need_a_key_when_required(app_client, tmp_path):
    api = app_client(f"sqlite:///{tmp_path}/reads.db", require_key_for_reads=True)
    run_id = api.create_run("before-keys")
    assert api.get("/api/v1/runs").status_code == 200  # no key exists: nothing to check against
    _, key = new_key(api)
    reads = ["/api/v1/runs", f"/api/v1/runs/{run_id}", f"/api/v1/runs/{run_id}/metrics", "/metrics",
             "/api/v1/alerts", f"/api/v1/runs/{run_id}/audits", f"/api/v1/runs/{run_id}/metric-names",
             f"/api/v1/runs/{run_id}/metrics?wall_time=true"]  # fmt: skip
    for path in reads:
        refused = api.get(path)
        assert refused.status_code == 401, (path, refused.status_code)
        assert set(refused.json()["error"]) == {"code", "message", "detail"}
        assert api.get(path, headers=bearer("rlv_wrong")).status_code == 401, path
        assert api.get(path, headers=bearer(key)).status_code == 200, path
        assert api.get(path, headers=basic(key)).status_code == 200, path
    events = api.get(f"/api/v1/runs/{run_id}/events")
    assert events.status_code == 401  # the live stream too (refused before it opens)
    # probes, and the shells that hold no data (the dashboard asks for the key, then sends it)
    for path in ("/healthz", "/", f"/runs/{run_id}", f"/runs/{run_id}/audits", "/compare", "/docs",
                 "/openapi.json", "/static/js/common.js"):  # fmt: skip
        assert api.get(path).status_code == 200, path
    # Basic is for reads only: a browser replays cached Basic credentials cross-site
    assert api.post("/api/v1/runs", json={"name": "x"}, headers=basic(key)).status_code == 401


def test_reads_need_a_key_by_default_only_off_loopback():
    from rlvitals.service.settings import Settings

    assert Settings(host="127.0.0.1").reads_need_key is False
    assert Settings(host="0.0.0.0").reads_need_key is True
    assert Settings(host="0.0.0.0", require_key_for_reads=False).reads_need_key is False


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8000", True),
        ("localhost:8000", True),
        ("[::1]:8000", True),
        ("10.1.2.3:8000", True),  # an IP literal can never be a rebinding name
        ("evil.example:8000", False),
        ("localhost.evil.example", False),
        ("rlvitals.internal", True),  # allowed_hosts
        ("a.corp.example:443", True),  # ".corp.example" allows subdomains
        ("corp.example", False),
    ],
)
def test_host_allowlist_refuses_rebinding_names(app_client, tmp_path, host, allowed):
    api = app_client(f"sqlite:///{tmp_path}/hosts.db", allowed_hosts=["rlvitals.internal", ".corp.example"])
    run_id = api.create_run("r")
    headers = {"host": host}
    read = api.get("/api/v1/runs", headers=headers)
    write = api.post(
        f"/api/v1/runs/{run_id}/metrics",
        json={"steps": [{"step": 1, "metrics": {"x": 1.0}}]},
        headers=headers,
    )  # fmt: skip
    if allowed:
        assert (read.status_code, write.status_code) == (200, 200), (read.text, write.text)
    else:
        assert (read.status_code, write.status_code) == (403, 403)
        assert (
            read.json()["error"]["code"] == "forbidden" and "allowed_hosts" in read.json()["error"]["message"]
        )
        assert api.get(f"/api/v1/runs/{run_id}/metrics").json()["series"] == {}


def test_allowed_hosts_star_serves_any_name(app_client, tmp_path):
    api = app_client(f"sqlite:///{tmp_path}/star.db", allowed_hosts=["*"])
    assert api.get("/api/v1/runs", headers={"host": "anything.example"}).status_code == 200


@pytest.mark.parametrize("ctype", [None, "text/plain", "multipart/form-data; boundary=x",
                                   "application/x-www-form-urlencoded", "application/json"])  # fmt: skip
def test_batch_uploads_a_browser_could_send_cross_site_are_refused(app_client, tmp_path, ctype):
    api = app_client(f"sqlite:///{tmp_path}/ctype.db")
    run_id = api.create_run("r")
    headers = {"content-type": ctype} if ctype else {}  # httpx adds no Content-Type for bytes
    refused = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(0), headers=headers)
    assert refused.status_code == 415, refused.text
    assert "application/octet-stream" in refused.json()["error"]["message"]
    assert api.get(f"/api/v1/runs/{run_id}/audits").json()["count"] == 0


@pytest.mark.parametrize("ctype", ["application/octet-stream", "application/x-safetensors"])
def test_batch_uploads_as_binary_types_are_accepted(app_client, tmp_path, ctype):
    api = app_client(f"sqlite:///{tmp_path}/ok.db")
    run_id = api.create_run("r")
    accepted = api.post(
        f"/api/v1/runs/{run_id}/batches", content=make_batch(0), headers={"content-type": ctype}
    )
    assert accepted.status_code == 202, accepted.text
    assert OCTET["content-type"] == "application/octet-stream"


def test_docs_pages_carry_a_content_security_policy(app_client, tmp_path):
    api = app_client(f"sqlite:///{tmp_path}/docs.db")
    for path in ("/docs", "/redoc"):
        response = api.get(path)
        assert response.status_code == 200
        csp = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
        assert response.headers["x-frame-options"] == "DENY"

"""The dashboard is a client of API v1 only: it imports nothing of the audit worker's path (service
audits/batches/metrics/storage, the analyzers' torch code), reaches into no private name, and the
pages in real Chromium fetch their data from ``/api/v1/…`` routes alone, which answer with ETags."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.dashboard.conftest import ROOT
from tests.dashboard.dashdata import CONFIG, batch, reported

DASHBOARD = ROOT / "service" / "dashboard"
# the audit worker's path and the storage behind API v1: the dashboard reads them through HTTP only
FORBIDDEN = (
    "rlvitals.service.audits",
    "rlvitals.service.batches",
    "rlvitals.service.metrics",
    "rlvitals.service.storage",
    "rlvitals.service.api",
    "rlvitals.analyzers.contract.batch",
    "rlvitals.analyzers.verdicts.histograms",
    "rlvitals.analyzers.verdicts.auditing",
    "sqlalchemy",
    "torch",
)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_the_dashboard_imports_nothing_of_the_audit_path_and_no_private_name():
    sources = sorted(DASHBOARD.rglob("*.py"))
    assert sources
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for module, names in _imports(path):
            full = [module] + [f"{module}.{n}" for n in names]
            bad = [m for m in full for f in FORBIDDEN if m == f or m.startswith(f + ".")]
            assert not bad, f"{path.name} imports {bad}"
            assert not [n for n in names if n.startswith("_")], f"{path.name} imports private {names}"
        for node in ast.walk(tree):  # module._private (e.g. signals._PREFIXES, metrics._series)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.value.id != "self"
            ):
                raise AssertionError(f"{path.name} reaches into {node.value.id}.{node.attr}")


def test_importing_the_dashboard_loads_no_audit_code():
    code = (
        "import sys, rlvitals.service.dashboard; "
        "print([m for m in ('rlvitals.service.audits', 'rlvitals.service.batches', 'rlvitals.service.metrics',"
        " 'rlvitals.analyzers.contract.batch', 'torch', 'sqlalchemy') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_scripts_name_no_private_route():
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((DASHBOARD / "static").rglob("*.js")))
    assert "/dashboard-api" not in text and "/api/v1/" in text


def test_the_pages_fetch_their_data_from_api_v1_with_etags(api, browser, server):
    run = api.create_run("contract", project="dash", config={"actor_rollout_ref": {"actor": CONFIG}})
    api.log_series(run, lambda s: {"actor/ppo_kl": 1e-3 + s * 1e-6, "actor/entropy": 1.0}, range(50))
    tensors = batch(1)
    audit = api.upload_batch(run, tensors, step=10, config=CONFIG, reported=reported(tensors))
    api.wait_audit(audit)

    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    for path, ready in (
        (f"/runs/{run}", "window.RLV && RLV.timing.allCharts"),
        (f"/runs/{run}/audits?audit={audit}", "window.RLV && RLV.timing.histograms"),
        ("/", "window.RLV && RLV.timing.rendered"),
    ):
        page.goto(server.url + path)
        deadline = time.monotonic() + 30
        while not page.evaluate(f"!!({ready})"):
            assert time.monotonic() < deadline, f"{path} never rendered"
            page.wait_for_timeout(50)
    context.close()

    data = [
        httpx.URL(u).path for u in requests if httpx.URL(u).path.split("/")[1] not in ("static", "runs", "")
    ]
    data = [p for p in data if p not in ("/compare", "/alerts")]
    assert data, requests
    assert all(p.startswith("/api/v1/") for p in data), data
    assert f"/api/v1/runs/{run}/metrics" in data and f"/api/v1/runs/{run}/metric-names" in data
    assert f"/api/v1/runs/{run}/health" in data and f"/api/v1/audits/{audit}/histograms" in data
    # the series the charts read carry wall times and an ETag: a repeat with If-None-Match is a 304
    first = api.client.get(f"/api/v1/runs/{run}/metrics", params={"wall_time": "true", "max_points": 100})
    assert first.status_code == 200 and "ETag" in first.headers
    assert first.json()["series"]["actor/ppo_kl"]["wall_time"]
    again = api.client.get(
        f"/api/v1/runs/{run}/metrics",
        params={"wall_time": "true", "max_points": 100},
        headers={"If-None-Match": first.headers["ETag"]},
    )
    assert again.status_code == 304
    plain = api.client.get(f"/api/v1/runs/{run}/metrics", params={"max_points": 100})
    assert plain.headers["ETag"] != first.headers["ETag"]  # wall times are part of what is tagged
    names = api.client.get(f"/api/v1/runs/{run}/metric-names")
    listed = names.json()["names"]
    # the trainer's two names, and the series the audit itself wrote (rlvitals/entropy_cov, ...)
    assert [n for n in listed if not n.startswith("rlvitals/")] == ["actor/entropy", "actor/ppo_kl"]
    assert "rlvitals/entropy_cov" in listed and listed == sorted(listed)
    assert (
        api.client.get(
            f"/api/v1/runs/{run}/metric-names", headers={"If-None-Match": names.headers["ETag"]}
        ).status_code
        == 304
    )
    api.log(run, [{"step": 50, "metrics": {"actor/ppo_kl": 0.5}}])
    changed = api.client.get(
        f"/api/v1/runs/{run}/metrics",
        params={"wall_time": "true", "max_points": 100},
        headers={"If-None-Match": first.headers["ETag"]},
    )
    assert changed.status_code == 200 and changed.headers["ETag"] != first.headers["ETag"]
    assert api.client.get("/dashboard-api/runs/1/series").status_code == 404  # the private routes are gone

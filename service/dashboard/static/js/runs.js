// rlvitals dashboard: every run with its health badge, sick runs first; project filter and search.
(function () {
  "use strict";
  const RLV = window.RLV;
  const REFRESH_MS = 5000;
  const params = new URLSearchParams(window.location.search);
  const ui = { project: RLV.$("project-filter"), search: RLV.$("search") };
  let runs = [];

  // A run's firing alerts as [{rule, severity}] whatever shape the server lists them in.
  function firingOf(run) {
    const raw = run.firing_alerts || run.alerts || [];
    if (!Array.isArray(raw)) return [];
    return raw
      .filter(function (a) { return typeof a === "string" || !a.state || a.state === "firing"; })
      .map(function (a) { return typeof a === "string" ? { rule: a, severity: run.status } : a; });
  }

  function notInfo(a) { return a.severity !== "info"; }

  function matches(run, project, q) {
    if (project && run.project !== project) return false;
    if (!q) return true;
    const hay = [run.name, run.project].concat(run.tags || []).join("\n").toLowerCase();
    return hay.indexOf(q) >= 0;
  }

  function render() {
    const project = ui.project.value;
    const q = ui.search.value.trim().toLowerCase();
    const shown = runs.filter(function (r) { return matches(r, project, q); });
    shown.sort(function (a, b) {
      const d = (RLV.SEVERITY_RANK[b.status] || 0) - (RLV.SEVERITY_RANK[a.status] || 0);
      if (d) return d;
      const f = firingOf(b).filter(notInfo).length - firingOf(a).filter(notInfo).length;
      if (f) return f;
      return (b.updated_at || 0) - (a.updated_at || 0) || String(b.id).localeCompare(String(a.id), undefined, { numeric: true });
    });
    const tbody = RLV.clear(RLV.$("runs-body"));
    for (const run of shown) {
      const href = RLV.runPath(run.id);
      const tags = RLV.el("td", {});
      for (const t of run.tags || []) tags.appendChild(RLV.el("span", { className: "tag", text: t }));
      // warning and critical alerts as chips; info ones (which leave the run healthy) only counted, muted
      const alerts = RLV.el("td", {});
      const all = firingOf(run);
      for (const a of all.filter(notInfo)) {
        alerts.appendChild(RLV.el("span", { className: "chip " + (a.severity || "warning"), text: a.rule, title: a.message || "" }));
      }
      const notes = all.length - all.filter(notInfo).length;
      if (notes) {
        alerts.appendChild(RLV.el("span", { className: "muted notes-count", text: notes + (notes === 1 ? " note" : " notes"),
          title: all.filter(function (a) { return !notInfo(a); }).map(function (a) { return a.rule; }).join(", ") }));
      }
      const row = RLV.el("tr", { className: "clickable", dataset: { runId: String(run.id), status: run.status || "" } },
        RLV.el("td", {}, RLV.badge(run.status)),
        RLV.el("td", {}, RLV.el("a", { className: "run-name", href: href, text: run.name })),
        RLV.el("td", { text: run.project || "" }),
        tags,
        RLV.el("td", { className: "num", text: run.last_step === null || run.last_step === undefined ? "–" : run.last_step }),
        alerts,
        RLV.el("td", { className: "muted", text: RLV.fmtAgo(run.updated_at) }),
        RLV.el("td", {}, RLV.el("a", { href: "/compare?runs=" + encodeURIComponent(run.id), text: "compare" })));
      row.addEventListener("click", function (e) {
        if (e.target.closest("a")) return;
        window.location.assign(RLV.safeHref(href));
      });
      tbody.appendChild(row);
    }
    RLV.$("runs-empty").hidden = runs.length > 0;
    RLV.$("runs-count").textContent = shown.length === runs.length ? runs.length + " runs" : shown.length + " of " + runs.length + " runs";
  }

  function renderProjects() {
    const current = ui.project.value || params.get("project") || "";
    const projects = Array.from(new Set(runs.map(function (r) { return r.project || ""; }))).sort();
    while (ui.project.options.length > 1) ui.project.remove(1);
    for (const p of projects) ui.project.appendChild(RLV.el("option", { value: p, text: p }));
    ui.project.value = projects.indexOf(current) >= 0 ? current : "";
  }

  function syncUrl() {
    const u = new URLSearchParams();
    if (ui.project.value) u.set("project", ui.project.value);
    if (ui.search.value.trim()) u.set("q", ui.search.value.trim());
    const qs = u.toString();
    window.history.replaceState(null, "", qs ? "?" + qs : window.location.pathname);
  }

  function accept(body) {
    runs = body.data || [];
    RLV.showError("");
    renderProjects();
    render();
    RLV.timing.rendered = performance.now();
  }

  async function refresh() {
    if (document.visibilityState === "visible") {
      try { accept(await RLV.api("/api/v1/runs")); } catch (err) { RLV.fail(err); }
    }
    setTimeout(refresh, REFRESH_MS);
  }

  ui.search.value = params.get("q") || "";
  ui.project.addEventListener("change", function () { syncUrl(); render(); });
  ui.search.addEventListener("input", function () { syncUrl(); render(); });
  RLV.pre.runs.then(accept, RLV.fail).then(function () { setTimeout(refresh, REFRESH_MS); });
})();

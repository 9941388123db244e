// rlvitals dashboard: the run page's header, firing-alert list and latest audits (text only).
(function () {
  "use strict";
  const RLV = window.RLV;
  const H = (RLV.runHead = {});

  // The worst severity among firing alerts ("healthy" when none fire), as the server computes it.
  H.status = function (alerts) {
    let worst = "healthy";
    for (const a of alerts) {
      if (a.state !== "firing") continue;
      if ((RLV.SEVERITY_RANK[a.severity] || 0) > RLV.SEVERITY_RANK[worst]) worst = a.severity;
    }
    return worst;
  };

  H.renderRun = function (run) {
    RLV.$("run-name").textContent = run.name;
    document.title = run.name + " · rlvitals";
    RLV.$("run-project").textContent = run.project || "";
    const tags = RLV.clear(RLV.$("run-tags"));
    for (const t of run.tags || []) tags.appendChild(RLV.el("span", { className: "tag", text: t }));
    const tbody = RLV.clear(RLV.$("config-table").tBodies[0]);
    const rows = [];
    (function flatten(prefix, obj, depth) {
      for (const k of Object.keys(obj || {})) {
        const v = obj[k];
        const key = prefix ? prefix + "." + k : k;
        if (v && typeof v === "object" && !Array.isArray(v) && depth < 4) flatten(key, v, depth + 1);
        else rows.push([key, typeof v === "string" ? v : JSON.stringify(v)]);
      }
    })("", run.config, 0);
    for (const r of rows) tbody.appendChild(RLV.el("tr", {}, RLV.el("td", { text: r[0] }), RLV.el("td", { text: r[1] })));
    RLV.$("config-box").hidden = rows.length === 0;
    H.renderExport(run);
  };

  // Download links for the run's series (API v1 /export). With a saved key the file is fetched with
  // the Authorization header (a plain link cannot send one) and handed to the browser as a blob.
  H.renderExport = function (run) {
    for (const format of ["csv", "parquet"]) {
      const link = RLV.$("export-" + format);
      link.href = RLV.apiRun(run.id) + "/export?format=" + format;
      if (link.dataset.wired) continue;
      link.dataset.wired = "1";
      link.addEventListener("click", async function (e) {
        const key = RLV.getKey();
        if (!key) return; // the browser downloads the link itself
        e.preventDefault();
        try {
          const resp = await fetch(link.href, { headers: { Authorization: "Bearer " + key } });
          if (!resp.ok) throw new Error("export: HTTP " + resp.status);
          const name = /filename="([^"]+)"/.exec(resp.headers.get("Content-Disposition") || "");
          const url = URL.createObjectURL(await resp.blob());
          const a = document.createElement("a");
          a.href = url; // a blob: URL this page just made (RLV.el allows only same-origin paths)
          a.download = name ? name[1] : "run-" + run.id + "." + format;
          document.body.appendChild(a);
          a.click();
          a.remove();
          setTimeout(function () { URL.revokeObjectURL(url); }, 10000);
        } catch (err) { RLV.fail(err); }
      });
    }
  };

  H.renderLastStep = function (step) {
    RLV.$("run-last-step").textContent = Number.isFinite(step) ? String(step) : "–";
  };

  // Rules whose alert value is not a point of the alert's signal (a relative error, a NaN, a share of
  // zero points): their line shows no "latest" value beside the message, which would be another quantity.
  H.VALUE_NOT_SIGNAL = { audit_mismatch: true, non_finite: true, grad_norm_zero: true };

  // Warning and critical alerts fire (the red box, and the badge); info alerts and forecasts are notes.
  H.isFiring = function (a) { return a.state === "firing" && a.severity !== "info"; };

  // One alert as a list item: chip, rule, "since step N" (onFocus(N) zooms the charts there), the message
  // (which states the alert's value), the signal's latest point where it is the same quantity, the advice.
  function alertItem(runId, a, onFocus, health) {
    const since = RLV.el("a", { href: RLV.runPath(runId) + "?step=" + Number(a.first_step), text: "since step " + a.first_step });
    since.addEventListener("click", function (e) { e.preventDefault(); onFocus(Number(a.first_step)); });
    const now = RLV.marks && !H.VALUE_NOT_SIGNAL[a.rule] ? RLV.marks.current(health, a) : null;
    const item = RLV.el("li", { className: a.severity, dataset: { rule: a.rule, severity: a.severity, value: String(a.value) } },
      RLV.el("span", { className: "chip " + a.severity, text: a.severity }),
      RLV.el("b", { text: a.rule }), " ", since, " — ", a.message || "");
    if (now !== null) {
      item.appendChild(RLV.el("span", { className: "now", dataset: { now: String(now) },
        text: " · latest " + (a.signal || "") + " " + RLV.fmtNum(now) }));
    }
    item.appendChild(document.createTextNode(" "));
    item.appendChild(RLV.el("span", { className: "advice", text: a.advice || "" }));
    return item;
  }

  // A forecast mark as a note; "far" when it lies beyond RLV.marks.FORECAST_AHEAD run lengths.
  function forecastItem(f, far, last) {
    return RLV.el("li", { className: "forecast" + (far ? " far" : ""), dataset: { forecast: String(f.step), far: String(far) } },
      RLV.el("span", { className: "chip " + (far ? "outlook" : "warning"), text: far ? "far-off forecast" : "forecast" }),
      RLV.el("b", { text: f.signal }), " " + f.label +
        (far && Number.isFinite(last) ? " (the run is at step " + last + "; it is not falling fast enough to matter soon)" : ""));
  }

  // The red "Firing" box holds the warning and critical alerts, worst first: exactly what makes the badge
  // say warning or critical. Info alerts and the forecasts go to the neutral "Notes" box. first/last: the
  // run's first and latest steps (a forecast far beyond the latest step is said to be far off).
  H.renderAlerts = function (runId, alerts, onFocus, health, first, last) {
    const all = Array.from(alerts);
    RLV.setBadge(RLV.$("run-status"), H.status(all));
    const firing = all.filter(H.isFiring);
    firing.sort(function (a, b) { return (RLV.SEVERITY_RANK[b.severity] || 0) - (RLV.SEVERITY_RANK[a.severity] || 0); });
    const list = RLV.clear(RLV.$("alerts-list"));
    for (const a of firing) list.appendChild(alertItem(runId, a, onFocus, health));
    RLV.$("alerts-strip").hidden = list.children.length === 0;
    const notes = RLV.clear(RLV.$("notes-list"));
    for (const a of all) if (a.state === "firing" && a.severity === "info") notes.appendChild(alertItem(runId, a, onFocus, health));
    for (const f of RLV.marks ? RLV.marks.forecasts(health) : []) {
      notes.appendChild(forecastItem(f, RLV.marks.isFar(f, first, last), last));
    }
    RLV.$("notes-strip").hidden = notes.children.length === 0;
  };

  // The run's incidents (findings of one cause grouped): open ones first, each with its cause, severity,
  // primary rule, the GPU-hours spent after its onset, and its findings one click away (a <details>).
  H.renderIncidents = function (runId, incidents, onFocus) {
    const all = Array.from(incidents);
    const list = RLV.clear(RLV.$("incidents-list"));
    const rank = function (i) { return (i.state === "open" ? 10 : 0) + (RLV.SEVERITY_RANK[i.severity] || 0); };
    all.sort(function (a, b) { return rank(b) - rank(a) || b.id - a.id; });
    for (const i of all) {
      const since = RLV.el("a", { href: RLV.runPath(runId) + "?step=" + Number(i.onset_step), text: "since step " + i.onset_step });
      since.addEventListener("click", function (e) { e.preventDefault(); onFocus(Number(i.onset_step)); });
      const spent = i.spent_after_onset;
      const cost = !spent ? "" : spent.gpu_hours !== null && spent.gpu_hours !== undefined
        ? " · " + RLV.fmtNum(spent.gpu_hours) + " GPU-h since onset" : " · " + RLV.fmtNum(spent.hours) + " h since onset";
      const rows = RLV.el("tbody", {});
      for (const f of i.findings || []) {
        rows.appendChild(RLV.el("tr", { dataset: { rule: f.rule } },
          RLV.el("td", { text: f.rule }), RLV.el("td", { text: f.state }), RLV.el("td", { text: f.severity }),
          RLV.el("td", { text: String(f.step) }), RLV.el("td", { text: RLV.fmtNum(f.value) })));
      }
      const findings = RLV.el("details", { className: "findings" },
        RLV.el("summary", { text: (i.findings || []).length + (i.dropped_findings ? "+" + i.dropped_findings : "") + " finding(s): " + Object.keys(i.members || {}).join(", ") }),
        RLV.el("table", {}, RLV.el("thead", {}, RLV.el("tr", {},
          RLV.el("th", { text: "rule" }), RLV.el("th", { text: "state" }), RLV.el("th", { text: "severity" }),
          RLV.el("th", { text: "step" }), RLV.el("th", { text: "value" }))), rows),
        RLV.el("a", { href: "/api/v1/incidents/" + i.id, text: "alerts behind it (JSON)" }));
      list.appendChild(RLV.el("li", { className: i.severity + " " + i.state, dataset: { incidentId: String(i.id), cause: i.cause, state: i.state } },
        RLV.el("span", { className: "chip " + i.severity, text: i.severity }), " ",
        RLV.el("b", { text: "#" + i.number + " " + i.title }), " ", RLV.el("span", { className: "muted", text: i.state }), " ",
        since, cost, " — primary ", RLV.el("code", { text: i.primary_rule }), ": ", i.message || "", findings));
    }
    RLV.$("incidents-count").textContent = all.filter(function (i) { return i.state === "open"; }).length + " open of " + all.length;
    RLV.$("incidents-panel").hidden = all.length === 0;
  };

  // The five latest audits and the count of mismatches, linking to the audits page.
  H.renderAudits = function (runId, audits) {
    const all = Array.from(audits).sort(function (a, b) { return b.step - a.step || b.id - a.id; });
    const bad = all.filter(function (a) { return RLV.auditOk(a) === false; }).length;
    RLV.$("audit-summary").textContent = all.length ? "(" + all.length + (bad ? ", " + bad + " mismatched" : "") + ")" : "";
    const list = RLV.clear(RLV.$("audits-mini-list"));
    for (const a of all.slice(0, 5)) {
      const ok = RLV.auditOk(a);
      const text = ok === null ? a.status : ok ? "reported metrics match the recomputation" : a.summary || a.explanation || "mismatch";
      list.appendChild(RLV.el("li", { className: ok === false ? "bad" : "", dataset: { auditId: String(a.id) } },
        RLV.el("a", { href: RLV.runPath(runId) + "/audits?audit=" + encodeURIComponent(a.id), text: "step " + a.step }),
        ": " + text));
    }
    // the box is always there (its line is reserved from the first paint, so nothing below it moves)
    RLV.$("audits-mini-count").textContent = all.length ? all.length + " audits" + (bad ? ", " + bad + " mismatched" : "") : "none yet";
    RLV.$("audits-mini").classList.toggle("none", all.length === 0);
  };
})();

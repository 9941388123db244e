// rlvitals dashboard: a run's audits. Per step, reported vs recomputed with mismatches highlighted and
// explained; for a chosen audit, the counterfactual table and histograms of the batch's importance
// ratio and advantages. New audits arrive over the run's event stream.
(function () {
  "use strict";
  const RLV = window.RLV;
  const C = RLV.charts;
  const runId = RLV.pre.runId;
  const audits = new Map();
  let selected = new URLSearchParams(window.location.search).get("audit");

  function verdictOk(v) { return v && v.ok === true; }
  const auditOk = RLV.auditOk;
  // One row per audited metric: the recomputed name, paired with the name the trainer reported it
  // under (reported_as, from the audit's alias table: actor/pg_loss -> pg_loss); reported names the
  // audit does not check follow, on rows of their own.
  function metricsOf(a) {
    const as = a.reported_as || {};
    const reported = a.reported || {};
    const rows = [];
    const used = new Set();
    for (const m of Object.keys(a.verdicts || {}).sort()) {
      const name = Object.prototype.hasOwnProperty.call(reported, m) ? m : as[m];
      if (name !== undefined) used.add(name);
      rows.push({ metric: m, reportedAs: name });
    }
    for (const k of Object.keys(reported).sort()) if (!used.has(k)) rows.push({ metric: null, reportedAs: k });
    return rows;
  }
  // One explanation per audit: the summary, then each metric's detail folded.
  function explanationNode(a) {
    const td = RLV.el("td", {}, RLV.el("span", { className: "summary", text: a.summary || a.explanation || "" }));
    const details = a.details || {};
    const keys = Object.keys(details);
    if (keys.length) {
      const list = RLV.el("ul", {});
      for (const k of keys) {
        const line = String(details[k]);
        const text = line.startsWith(k + ": ") ? line.slice(k.length + 2) : line; // the name is the <code>
        list.appendChild(RLV.el("li", {}, RLV.el("code", { text: k }), " ", text));
      }
      td.appendChild(RLV.el("details", { className: "metric-details" },
        RLV.el("summary", { text: "details for " + keys.length + " metric" + (keys.length > 1 ? "s" : "") }), list));
    }
    td.colSpan = 8;
    return td;
  }

  function render() {
    const onlyBad = RLV.$("only-mismatch").checked;
    const list = Array.from(audits.values()).sort(function (a, b) { return b.step - a.step || b.id - a.id; });
    const tbody = RLV.clear(RLV.$("audits-body"));
    let bad = 0;
    for (const a of list) {
      const ok = auditOk(a);
      if (ok === false) bad += 1;
      if (onlyBad && ok !== false) continue;
      const metrics = metricsOf(a);
      const rows = Math.max(1, metrics.length);
      const statusText = a.status === "done" ? (ok ? "match" : "mismatch") : a.status;
      const rowsNodes = [];
      for (let i = 0; i < rows; i++) {
        const row = metrics[i];
        const m = row ? row.metric : null;
        const shownAs = row ? row.reportedAs : undefined;
        const v = m ? (a.verdicts || {})[m] : null;
        const tr = RLV.el("tr", {
          className: "clickable" + (v && !verdictOk(v) ? " mismatch" : "") + (String(a.id) === String(selected) ? " selected" : ""),
          dataset: { auditId: String(a.id), metric: m || "" },
        });
        if (i === 0) {
          const stepCell = RLV.el("td", { className: "num", text: a.step });
          const statusCell = RLV.el("td", {}, RLV.el("span", {
            className: "badge " + (ok === false ? "critical" : ok ? "healthy" : ""), text: statusText,
          }));
          stepCell.rowSpan = rows;
          statusCell.rowSpan = rows;
          tr.appendChild(stepCell);
          tr.appendChild(statusCell);
        }
        const label = m || shownAs;
        const nameCell = RLV.el("td", {}, label ? RLV.el("code", { text: label }) : a.status === "error" ? a.error || a.explanation || "error" : "–");
        if (m && shownAs && shownAs !== m) nameCell.appendChild(RLV.el("span", { className: "muted reported-as", text: " reported as " + shownAs }));
        if (!m && shownAs) nameCell.appendChild(RLV.el("span", { className: "muted", text: " not audited" }));
        tr.appendChild(nameCell);
        tr.appendChild(RLV.el("td", { className: "num", text: shownAs !== undefined ? RLV.fmtNum((a.reported || {})[shownAs]) : "" }));
        tr.appendChild(RLV.el("td", { className: "num", text: m ? RLV.fmtNum((a.recomputed || {})[m]) : "" }));
        tr.appendChild(RLV.el("td", { className: "num", text: v ? RLV.fmtNum(v.abs_err) : "" }));
        tr.appendChild(RLV.el("td", { className: "num", text: v ? RLV.fmtNum(v.rel_err) : "" }));
        tr.appendChild(RLV.el("td", { text: v ? (verdictOk(v) ? "ok" : "MISMATCH") : "" }));
        tr.addEventListener("click", function () { select(a.id); });
        rowsNodes.push(tr);
      }
      for (const tr of rowsNodes) tbody.appendChild(tr);
      if (ok === false && (a.summary || a.explanation)) {
        tbody.appendChild(RLV.el("tr", { className: "explain", dataset: { auditId: String(a.id) } }, explanationNode(a)));
      }
    }
    RLV.$("audits-empty").hidden = audits.size > 0;
    RLV.$("audit-count").textContent = audits.size + " audits" + (bad ? ", " + bad + " mismatched" : "");
  }

  // ---- counterfactuals: any nesting of {label: number | {label: number}} as tables -------------------
  function isScalar(v) { return v === null || typeof v !== "object"; }
  function cfTable(title, obj) {
    const wrap = RLV.el("div", { className: "cf-block" });
    if (title) wrap.appendChild(RLV.el("h4", { text: title }));
    const rowsKeys = Object.keys(obj);
    const nested = rowsKeys.some(function (k) { return !isScalar(obj[k]) && !Array.isArray(obj[k]); });
    const table = RLV.el("table", { className: "grid cf" });
    if (nested) {
      const cols = [];
      for (const k of rowsKeys) {
        if (isScalar(obj[k]) || Array.isArray(obj[k])) continue;
        for (const c of Object.keys(obj[k])) if (cols.indexOf(c) < 0) cols.push(c);
      }
      const head = RLV.el("tr", {}, RLV.el("th", { text: "" }));
      for (const c of cols) head.appendChild(RLV.el("th", { className: "num", text: c }));
      table.appendChild(RLV.el("thead", {}, head));
      const body = RLV.el("tbody", {});
      for (const k of rowsKeys) {
        const row = RLV.el("tr", {}, RLV.el("td", {}, RLV.el("code", { text: k })));
        const v = obj[k];
        for (const c of cols) {
          const cell = isScalar(v) || Array.isArray(v) ? "" : v[c];
          row.appendChild(RLV.el("td", { className: "num", text: isScalar(cell) ? RLV.fmtNum(cell) : JSON.stringify(cell) }));
        }
        body.appendChild(row);
      }
      table.appendChild(body);
    } else {
      const body = RLV.el("tbody", {});
      for (const k of rowsKeys) {
        const v = obj[k];
        body.appendChild(RLV.el("tr", {}, RLV.el("td", {}, RLV.el("code", { text: k })),
          RLV.el("td", { className: "num", text: typeof v === "number" || v === null || /^-?(NaN|Infinity)$/.test(v) ? RLV.fmtNum(v) : JSON.stringify(v) })));
      }
      table.appendChild(body);
    }
    wrap.appendChild(table);
    return wrap;
  }
  function renderCounterfactuals(cf) {
    const box = RLV.clear(RLV.$("counterfactuals"));
    if (!cf || typeof cf !== "object" || !Object.keys(cf).length) {
      box.appendChild(RLV.el("p", { className: "muted", text: "No counterfactuals for this audit." }));
      return;
    }
    const scalars = {};
    for (const k of Object.keys(cf)) {
      const v = cf[k];
      if (isScalar(v) || Array.isArray(v)) scalars[k] = v;
      else box.appendChild(cfTable(k, v));
    }
    if (Object.keys(scalars).length) box.appendChild(cfTable("", scalars));
  }

  async function renderHistograms(a) {
    const note = RLV.$("hist-note");
    note.textContent = "";
    try {
      const body = await RLV.api("/api/v1/audits/" + encodeURIComponent(a.id) + "/histograms");
      const lines = [];
      const clip = body.clip || {};
      if (typeof clip.low === "number") lines.push({ name: "clip-low", x: clip.low });
      if (typeof clip.high === "number") lines.push({ name: "clip-high", x: clip.high });
      // the dual-clip bound only when some ratio reaches it (it would squash the bars otherwise)
      if (typeof clip.dual === "number" && body.ratio.max >= clip.dual) lines.push({ name: "dual-clip", x: clip.dual, color: "#7c3aed" });
      await C.histogram(RLV.$("hist-ratio"), body.ratio, { name: "ratio", lines: lines, logy: true });
      await C.histogram(RLV.$("hist-adv"), body.advantages, { name: "advantages", color: "#0f766e" });
      note.textContent = body.tokens + " valid tokens" + (body.ratio.outside ? "; " + body.ratio.outside + " ratios beyond the plotted range" : "") +
        ". Dashed lines: the clip bounds 1 − clip_ratio_low and 1 + clip_ratio_high" + (lines.length > 2 ? ", and the dual-clip bound" : "") + ".";
      RLV.timing.histograms = performance.now();
    } catch (err) {
      RLV.clear(RLV.$("hist-ratio"));
      RLV.clear(RLV.$("hist-adv"));
      note.textContent = err.message;
    }
  }

  function select(id) {
    const a = audits.get(String(id)) || audits.get(id);
    if (!a) return;
    selected = a.id;
    const u = new URLSearchParams(window.location.search);
    u.set("audit", a.id);
    window.history.replaceState(null, "", "?" + u.toString());
    render();
    RLV.$("audit-detail").hidden = false;
    RLV.$("detail-title").textContent = "Audit " + a.id + " · step " + a.step;
    RLV.$("detail-explanation").textContent = a.explanation || (auditOk(a) ? "Reported metrics match the recomputation." : a.status);
    renderCounterfactuals(a.counterfactuals);
    renderHistograms(a);
  }

  function upsert(a) {
    audits.set(String(a.id), a);
  }

  RLV.$("only-mismatch").addEventListener("change", render);
  RLV.$("run-link").setAttribute("href", RLV.safeHref(RLV.runPath(runId)));
  RLV.pre.run.then(function (run) {
    RLV.$("run-link").textContent = run.name;
    document.title = run.name + " · audits · rlvitals";
    RLV.setBadge(RLV.$("run-status"), run.status);
  }, RLV.fail);
  RLV.pre.audits.then(function (body) {
    for (const a of body.data || []) upsert(a);
    render();
    if (selected !== null && audits.has(String(selected))) select(selected);
    RLV.timing.rendered = performance.now();
    RLV.stream(runId, function (type, data) {
      if (type !== "audit") return;
      upsert(data);
      render();
      if (String(data.id) === String(selected)) select(data.id);
    }, RLV.setLive);
  }, RLV.fail);
})();

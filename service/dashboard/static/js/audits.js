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

  // "micro-batch 0" (and the rank under data parallelism): a trainer samples several micro-batches of a
  // step (verl: the first and the last), each audited on its own.
  function microBatchLabel(a) {
    const parts = [];
    if (a.micro_batch !== null && a.micro_batch !== undefined) parts.push("micro-batch " + a.micro_batch);
    if (a.rank) parts.push("rank " + a.rank);
    return parts.join(" · ");
  }
  // Mismatches first (each with its metrics and explanation), then the rest by step, newest first.
  function ordered() {
    return Array.from(audits.values()).sort(function (a, b) {
      const bad = (auditOk(b) === false) - (auditOk(a) === false);
      return bad || b.step - a.step || (a.micro_batch || 0) - (b.micro_batch || 0) || b.id - a.id;
    });
  }
  // The largest relative error of an audit's verdicts (for the folded row of a matching audit).
  function worstRelErr(a) {
    let worst = null;
    for (const v of Object.values(a.verdicts || {})) {
      const r = RLV.num(v && v.rel_err);
      if (r !== null && Number.isFinite(r) && (worst === null || r > worst)) worst = r;
    }
    return worst;
  }
  const expanded = new Set(); // ids of matching audits unfolded to one row per metric

  function stepCells(a, ok, rows) {
    const statusText = a.status === "done" ? (ok ? "match" : "mismatch") : a.status;
    const stepCell = RLV.el("td", { className: "num" }, RLV.el("b", { text: String(a.step) }));
    const mb = microBatchLabel(a);
    if (mb) stepCell.appendChild(RLV.el("div", { className: "muted micro-batch", text: mb }));
    const statusCell = RLV.el("td", {}, RLV.el("span", {
      className: "badge " + (ok === false ? "critical" : ok ? "healthy" : ""), text: statusText,
    }));
    stepCell.rowSpan = rows;
    statusCell.rowSpan = rows;
    return [stepCell, statusCell];
  }

  function render() {
    const onlyBad = RLV.$("only-mismatch").checked;
    const list = ordered();
    const tbody = RLV.clear(RLV.$("audits-body"));
    let bad = 0;
    let restShown = false;
    for (const a of list) {
      const ok = auditOk(a);
      if (ok === false) bad += 1;
      if (onlyBad && ok !== false) continue;
      if (ok !== false && !restShown && bad > 0) {
        restShown = true;
        const td = RLV.el("td", { text: "The other audits" });
        td.colSpan = 8;
        tbody.appendChild(RLV.el("tr", { className: "divider" }, td));
      }
      const isSelected = String(a.id) === String(selected);
      if (ok === true && !expanded.has(String(a.id))) {
        // a matching audit: one row, unfolded on click
        const worst = worstRelErr(a);
        const n = Object.keys(a.verdicts || {}).length;
        const tr = RLV.el("tr", { className: "clickable folded" + (isSelected ? " selected" : ""), dataset: { auditId: String(a.id), metric: "" } });
        for (const td of stepCells(a, ok, 1)) tr.appendChild(td);
        const cell = RLV.el("td", { className: "muted", text: n + " metrics agree" + (worst !== null ? " (largest relative error " + RLV.fmtNum(worst) + ")" : "") + " · show" });
        cell.colSpan = 6;
        tr.appendChild(cell);
        tr.addEventListener("click", function () { expanded.add(String(a.id)); select(a.id); });
        tbody.appendChild(tr);
        continue;
      }
      const metrics = metricsOf(a);
      const rows = Math.max(1, metrics.length);
      const rowsNodes = [];
      for (let i = 0; i < rows; i++) {
        const row = metrics[i];
        const m = row ? row.metric : null;
        const shownAs = row ? row.reportedAs : undefined;
        const v = m ? (a.verdicts || {})[m] : null;
        const tr = RLV.el("tr", {
          className: "clickable" + (v && !verdictOk(v) ? " mismatch" : "") + (isSelected ? " selected" : ""),
          dataset: { auditId: String(a.id), metric: m || "" },
        });
        if (i === 0) for (const td of stepCells(a, ok, rows)) tr.appendChild(td);
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
    renderLead(list);
  }

  // The line above the table: how many audits disagree, and a link to each (they lead the table too).
  function renderLead(list) {
    const lead = RLV.clear(RLV.$("audits-lead"));
    const badList = list.filter(function (a) { return auditOk(a) === false; });
    lead.className = "audits-lead " + (badList.length ? "bad" : "good");
    if (!list.length) { lead.hidden = true; return; }
    lead.hidden = false;
    if (!badList.length) {
      lead.appendChild(document.createTextNode("All " + list.length + " audits match the recomputation."));
      return;
    }
    lead.appendChild(RLV.el("b", { text: badList.length + (badList.length === 1 ? " audit disagrees" : " audits disagree") }));
    lead.appendChild(document.createTextNode(" with the recomputation: "));
    badList.forEach(function (a, i) {
      if (i) lead.appendChild(document.createTextNode(", "));
      const link = RLV.el("a", { href: RLV.runPath(runId) + "/audits?audit=" + encodeURIComponent(a.id), text: "step " + a.step + (microBatchLabel(a) ? " (" + microBatchLabel(a) + ")" : "") });
      link.addEventListener("click", function (e) { e.preventDefault(); select(a.id); RLV.$("audit-detail").scrollIntoView(); });
      lead.appendChild(link);
    });
    lead.appendChild(document.createTextNode(". They lead the table below."));
  }

  // ---- counterfactuals: the same batch under other settings, as tables --------------------------------
  // Readable headings for the audit's keys (others: "_by_" read as " by ", as the key says).
  const CF_TITLES = {
    pg_loss_by_agg_mode: "pg_loss by loss_agg_mode",
    pg_clipfrac: "pg_clipfrac by clip setting",
    pg_loss_by_clip: "pg_loss by clip setting",
    pg_clipfrac_lower_by_clip_ratio_c: "pg_clipfrac_lower by clip_ratio_c (dual clip)",
    kl_loss_by_type: "kl_loss by kl_loss_type",
    policy_loss: "policy_loss with and without its terms",
    by_loss_mode: "Every loss metric by loss_mode",
    pg_loss_by_loss_mode_and_agg_mode: "pg_loss by loss_mode (rows) and loss_agg_mode (columns)",
    tokens: "Batch size",
  };
  function cfTitle(key) { return CF_TITLES[key] || String(key).replace(/_by_/g, " by "); }
  // The metric a counterfactual table is about: the longest audited metric its key starts with.
  function metricOfKey(a, key) {
    let best = null;
    for (const m of Object.keys(a.verdicts || {})) {
      if ((key === m || key.startsWith(m + "_")) && (!best || m.length > best.length)) best = m;
    }
    return best;
  }
  // What the trainer reported for a metric that disagrees (under its own name or the alias it used):
  // the number a counterfactual setting may reproduce. null for metrics that agree (nothing to find).
  function reportedValue(a, metric) {
    if (!metric) return null;
    const verdict = (a.verdicts || {})[metric];
    if (!verdict || verdictOk(verdict)) return null;
    const reported = a.reported || {};
    const name = Object.prototype.hasOwnProperty.call(reported, metric) ? metric : (a.reported_as || {})[metric];
    const v = name === undefined ? null : RLV.num(reported[name]);
    return v === null || !Number.isFinite(v) ? null : v;
  }
  // Whether a counterfactual value reproduces the reported one (the audit's own tolerance is tighter;
  // this only has to pick the one setting out of a table whose values differ by far more).
  function reproduces(value, reported) {
    const v = RLV.num(value);
    if (v === null || reported === null || !Number.isFinite(v)) return false;
    return Math.abs(v - reported) <= 1e-4 * Math.max(1e-6, Math.abs(reported));
  }

  function isScalar(v) { return v === null || typeof v !== "object"; }
  function valueCell(v, reported, label) {
    const hit = reproduces(v, reported);
    const td = RLV.el("td", { className: "num" + (hit ? " reproduces" : ""),
      text: isScalar(v) ? RLV.fmtNum(v) : Array.isArray(v) ? v.map(RLV.fmtNum).join(" – ") : JSON.stringify(v) });
    if (hit) td.title = "reproduces the reported " + label;
    return td;
  }
  // rowMetric(rowKey, colKey) -> the metric a cell is about (for the highlight).
  function cfTable(a, key, obj) {
    const wrap = RLV.el("div", { className: "cf-block", dataset: { cf: key } });
    wrap.appendChild(RLV.el("h4", { text: cfTitle(key) }));
    const tableMetric = metricOfKey(a, key);
    const rowsKeys = Object.keys(obj);
    const nested = rowsKeys.some(function (k) { return !isScalar(obj[k]) && !Array.isArray(obj[k]); });
    const table = RLV.el("table", { className: "grid cf" });
    let hits = 0;
    if (nested) {
      wrap.classList.add("wide");
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
        const row = RLV.el("tr", {}, RLV.el("th", { text: k }));
        const v = obj[k];
        for (const c of cols) {
          const metric = tableMetric || (Object.prototype.hasOwnProperty.call(a.verdicts || {}, c) ? c : null);
          const td = valueCell(isScalar(v) || Array.isArray(v) ? "" : v[c], reportedValue(a, metric), metric);
          if (td.classList.contains("reproduces")) hits += 1;
          row.appendChild(td);
        }
        body.appendChild(row);
      }
      table.appendChild(body);
    } else {
      const body = RLV.el("tbody", {});
      const reported = reportedValue(a, tableMetric);
      for (const k of rowsKeys) {
        const td = valueCell(obj[k], reported, tableMetric);
        if (td.classList.contains("reproduces")) hits += 1;
        body.appendChild(RLV.el("tr", { className: td.classList.contains("reproduces") ? "reproduces" : "" }, RLV.el("th", { text: k }), td));
      }
      table.appendChild(body);
    }
    if (hits) wrap.classList.add("has-hit");
    const scroll = RLV.el("div", { className: "cf-scroll" }, table);
    wrap.appendChild(scroll);
    return wrap;
  }
  function renderCounterfactuals(a) {
    const cf = a.counterfactuals;
    const box = RLV.clear(RLV.$("counterfactuals"));
    if (!cf || typeof cf !== "object" || !Object.keys(cf).length) {
      box.appendChild(RLV.el("p", { className: "muted", text: "No counterfactuals for this audit." }));
      return;
    }
    const scalars = {};
    for (const k of Object.keys(cf)) {
      const v = cf[k];
      if (isScalar(v) || Array.isArray(v)) scalars[k] = v;
      else box.appendChild(cfTable(a, k, v));
    }
    if (Object.keys(scalars).length) box.appendChild(cfTable(a, "other", scalars));
    RLV.$("cf-legend").hidden = !box.querySelector(".reproduces");
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
    RLV.$("detail-title").textContent = "Audit " + a.id + " · step " + a.step + (microBatchLabel(a) ? " · " + microBatchLabel(a) : "");
    RLV.$("detail-explanation").textContent = a.explanation || (auditOk(a) ? "Reported metrics match the recomputation." : a.status);
    renderCounterfactuals(a);
    renderHistograms(a);
  }

  function upsert(a) {
    audits.set(String(a.id), a);
  }

  RLV.auditsPage = { cfTitle: cfTitle, reproduces: reproduces }; // for tests

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

// rlvitals dashboard: rollout-vs-training mismatch of a run (/runs/{id}/mismatch) or of several runs
// overlaid (/mismatch?runs=1,2). Everything comes from GET /api/v1/runs/{id}/mismatch and the run's alerts.
(function () {
  "use strict";
  const RLV = window.RLV;
  const params = new URLSearchParams(window.location.search);
  const single = RLV.runIdFromPath();
  const ids = single !== null ? [single] : (params.get("runs") || "").split(",").filter(function (s) { return /^\d+$/.test(s); });
  const S = "rlvitals/mismatch/";
  const COLORS = ["#2563eb", "#dc2626", "#0f766e", "#7c3aed", "#ea580c", "#0891b2"];
  const layout = function (extra) {
    return Object.assign({ margin: { l: 55, r: 10, t: 10, b: 40 }, height: 260, showlegend: true,
      legend: { orientation: "h", y: -0.25 } }, extra || {});
  };
  const config = { displayModeBar: false, responsive: true };
  const views = {};
  const names = {};

  function plot(id, traces, extra) {
    return Plotly.react(RLV.$(id), traces, layout(extra), config);
  }
  function seriesTrace(view, name, label, color, dash) {
    const s = view.series[S + name];
    if (!s) return null;
    return { x: s.steps, y: s.values, name: label, mode: "lines+markers", line: { color: color, dash: dash || "solid" } };
  }
  function bars(id, labels, values, color, ytitle) {
    return plot(id, [{ type: "bar", x: labels, y: values, marker: { color: color }, showlegend: false }],
      { yaxis: { title: ytitle || "mean |gap|" }, xaxis: { type: "category" } });
  }
  function fmt(v) { return v === null || v === undefined ? "—" : RLV.fmtNum(v); }

  function drawSteps() {
    const gap = [];
    const tmpe = [];
    ids.forEach(function (id, i) {
      const v = views[id];
      const label = ids.length > 1 ? names[id] + " (#" + id + ")" : "";
      const color = COLORS[i % COLORS.length];
      const mean = seriesTrace(v, "abs_gap_mean", (label ? label + " " : "") + "mean |gap|", color);
      const p99 = seriesTrace(v, "abs_gap_p99", (label ? label + " " : "") + "p99 |gap|", color, "dot");
      const t = seriesTrace(v, "token_mult_prob_error", label || "token_mult_prob_error", color);
      if (mean) gap.push(mean);
      if (p99) gap.push(p99);
      if (t) tmpe.push(t);
    });
    plot("mm-gap", gap, { xaxis: { title: "step" }, yaxis: { title: "|log-prob gap|", type: "log" } });
    plot("mm-tmpe", tmpe, { xaxis: { title: "step" }, yaxis: { type: "log" } });
    if (single !== null) {
      RLV.$("mm-gap").on("plotly_click", function (ev) {
        const step = ev.points[0].x;
        const a = views[single].audits.find(function (x) { return x.step === step; });
        if (a) select(a.id);
      });
    }
  }

  function drawDetail(id, report) {
    const rows = [
      ["token_mult_prob_error (NeMo-RL)", report.token_mult_prob_error],
      ["gen_kl_error (NeMo-RL, k3)", report.gen_kl_error],
      ["|gap| mean / p50 / p99 / max", [report.abs_gap.mean, report.abs_gap.p50, report.abs_gap.p99, report.abs_gap.max].map(fmt).join(" / ")],
      ["Pearson of log-probs", report.pearson],
      ["verl IS mean / ESS", fmt(report.verl.rollout_is_mean) + " / " + fmt(report.verl.rollout_is_eff_sample_size)],
      ["verl kl / k3_kl / χ²_token", [report.verl.kl, report.verl.k3_kl, report.verl.chi2_token].map(fmt).join(" / ")],
      ["ratio outside [" + fmt(report.bounds.lower) + ", " + fmt(report.bounds.upper) + "]", report.bounds.beyond],
      ["sequences vetoed (a token with ratio < 1e-4)", report.veto_fraction],
      ["growth with position (last third / first)", report.shape.position_growth],
      ["low-probability tokens' gap / the others'", report.shape.low_prob_ratio],
      ["tokens / sequences", report.tokens + " / " + report.sequences],
    ];
    const body = RLV.clear(RLV.$("mm-summary-body"));
    for (const r of rows) {
      body.appendChild(RLV.el("tr", {}, RLV.el("th", { text: r[0] }),
        RLV.el("td", { className: "num", text: typeof r[1] === "string" ? r[1] : fmt(r[1]) })));
    }
    bars("mm-position", report.position_buckets.map(function (b) { return b.start + "–" + b.end; }), report.by_position, "#2563eb");
    bars("mm-prob", report.by_prob.map(function (b) { return b.low + "–" + b.high; }), report.by_prob.map(function (b) { return b.mean; }), "#0f766e");
    bars("mm-length", report.by_length.map(function (b) { return b.min_length + "–" + b.max_length; }), report.by_length.map(function (b) { return b.mean; }), "#7c3aed");
    const groups = (report.by_group && report.by_group.worst) || [];
    bars("mm-group", groups.map(function (g) { return "group " + g.group; }), groups.map(function (g) { return g.mean; }), "#ea580c");
    const worst = RLV.clear(RLV.$("mm-worst-body"));
    const traces = [];
    report.worst.forEach(function (w, i) {
      worst.appendChild(RLV.el("tr", {},
        RLV.el("td", { className: "num", text: String(w.index) }),
        RLV.el("td", { className: "num", text: w.group === null ? "—" : String(w.group) }),
        RLV.el("td", { className: "num", text: String(w.length) }),
        RLV.el("td", { className: "num", text: fmt(w.mean) }),
        RLV.el("td", { className: "num", text: fmt(w.max) }),
        RLV.el("td", { className: "num", text: String(w.max_at) })));
      traces.push({ y: w.gaps, name: "row " + w.index, mode: "lines", line: { color: COLORS[i % COLORS.length] } });
    });
    plot("mm-tokens", traces, { xaxis: { title: "token (valid tokens of the row, in order)" }, yaxis: { title: "gap" } });
  }

  async function select(auditId) {
    const id = ids[0];
    const body = await RLV.api(RLV.apiRun(id) + "/mismatch?audit_id=" + encodeURIComponent(auditId));
    show(id, body.selected);
  }

  function show(id, selected) {
    if (!selected) return;
    RLV.$("mm-detail").hidden = false;
    RLV.$("mm-detail-title").textContent = "Batch of step " + selected.step + " (audit " + selected.id + ")";
    RLV.$("mm-audit").value = String(selected.id);
    if (single !== null) {
      const u = new URLSearchParams(window.location.search);
      u.set("audit", selected.id);
      window.history.replaceState(null, "", "?" + u.toString());
    }
    drawDetail(id, selected.mismatch);
    RLV.timing.detail = performance.now();
  }

  async function alerts() {
    const list = RLV.clear(RLV.$("mm-alerts"));
    for (const id of ids) {
      const body = await RLV.api(RLV.apiRun(id) + "/alerts");
      for (const a of body.data || []) {
        if (a.rule !== "mismatch_trend" && a.rule !== "rollout_mismatch") continue;
        list.appendChild(RLV.el("li", { className: "alert " + a.severity },
          RLV.el("span", { className: "badge " + a.severity, text: a.severity }), " ",
          (ids.length > 1 ? names[id] + ": " : ""), "step " + a.first_step + " · " + a.message));
      }
    }
  }

  async function main() {
    if (!ids.length) {
      RLV.$("mm-runs").textContent = "pick runs with ?runs=1,2";
      RLV.$("mm-empty").hidden = false;
      return;
    }
    const wanted = params.get("audit");
    await Promise.all(ids.map(async function (id) {
      const [run, view] = await Promise.all([
        RLV.api(RLV.apiRun(id)),
        RLV.api(RLV.apiRun(id) + "/mismatch" + (single !== null && wanted ? "?audit_id=" + encodeURIComponent(wanted) : "")),
      ]);
      names[id] = run.name;
      views[id] = view;
    }));
    const head = RLV.clear(RLV.$("mm-runs"));
    ids.forEach(function (id, i) {
      if (i) head.appendChild(document.createTextNode(" vs "));
      head.appendChild(RLV.el("a", { href: RLV.safeHref(RLV.runPath(id)), text: names[id] }));
    });
    document.title = ids.map(function (id) { return names[id]; }).join(" vs ") + " · mismatch · rlvitals";
    const total = ids.reduce(function (n, id) { return n + views[id].audits.length; }, 0);
    RLV.$("mm-facts").textContent = total + " batch" + (total === 1 ? "" : "es") + " measured";
    if (!total) RLV.$("mm-empty").hidden = false;
    drawSteps();
    await alerts();
    if (single !== null) {
      const pick = RLV.clear(RLV.$("mm-audit"));
      for (const a of views[single].audits) pick.appendChild(RLV.el("option", { value: String(a.id), text: "step " + a.step + " · audit " + a.id }));
      pick.addEventListener("change", function () { select(pick.value).catch(RLV.fail); });
      show(single, views[single].selected);
    } else {
      // compare: the latest batch of each run, by position, on one chart
      RLV.$("mm-detail").hidden = true;
      const traces = ids.filter(function (id) { return views[id].selected; }).map(function (id, i) {
        const r = views[id].selected.mismatch;
        return { x: r.position_buckets.map(function (b) { return b.start; }), y: r.by_position, name: names[id] + " (#" + id + ") step " + views[id].selected.step,
          mode: "lines+markers", line: { color: COLORS[i % COLORS.length] } };
      });
      const box = RLV.el("div", { className: "plot" });
      box.id = "mm-compare-position";
      const panel = RLV.el("div", { className: "panel" }, RLV.el("div", { className: "panel-title", text: "latest batch: mean |gap| by position (bucket start)" }), box);
      RLV.$("mm-detail").parentNode.insertBefore(panel, RLV.$("mm-detail"));
      plot("mm-compare-position", traces, { xaxis: { title: "position" }, yaxis: { title: "mean |gap|" } });
    }
    RLV.timing.drawn = performance.now();
  }
  main().catch(RLV.fail);
})();

// rlvitals dashboard: one run. Panels for the health signals first, then every other metric; alert
// spans and onset markers on the charts; EMA smoothing, log y, x by step or wall time; zooming fetches
// full resolution for the visible range; new points, alerts and audits arrive over the SSE stream and
// are appended with Plotly.extendTraces (no reload, no refetch).
(function () {
  "use strict";
  const RLV = window.RLV;
  const C = RLV.charts;
  const pre = RLV.pre;
  const runId = pre.runId;
  const base = RLV.apiRun(runId);

  const state = {
    run: null,
    maxPoints: pre.maxPoints,
    overview: new Map(), // name -> {step, value, wall, bad}: downsampled history + live appends
    viewData: new Map(), // name -> series for the zoomed range (full resolution)
    view: null, // null (everything) or {start, end} in steps
    panels: new Map(), // name -> {node, div, drawn, ema}
    alerts: new Map(), // id -> alert
    incidents: new Map(), // id -> incident
    audits: new Map(), // id -> audit
    latestStep: -Infinity,
    smoothing: 0,
    logy: false,
    xmode: "step",
    focusStep: null,
    hasWall: false,
    health: null, // {marks, signals, step}: the rules' thresholds, the forecast, current values
  };
  RLV.state = state; // for tests and the curious

  // ---- series bookkeeping --------------------------------------------------------------------------
  function seriesFor(name) {
    return state.view ? state.viewData.get(name) || emptySeries() : state.overview.get(name);
  }
  function emptySeries() { return { step: [], value: [], wall: null, bad: [] }; }

  // A fresh array: plotly's traces must never share arrays with our series (extendTraces appends
  // to the trace's arrays in place).
  function xOf(series) {
    if (state.xmode === "wall" && series.wall) return series.wall.map(function (w) { return w === null ? null : w * 1000; });
    return series.step.slice();
  }
  // Map a step to the x axis (for shapes): in wall mode, the wall time of the nearest logged step.
  function stepToX(name) {
    const s = state.overview.get(name);
    if (state.xmode !== "wall" || !s || !s.wall || !s.wall.length) return function (step) { return step; };
    return function (step) {
      const i = Math.min(s.step.length - 1, C.lowerBound(s.step, step));
      return s.wall[i] * 1000;
    };
  }
  function xToStep(name, x) {
    const s = state.overview.get(name);
    if (state.xmode !== "wall" || !s || !s.wall || !s.wall.length) return x;
    const t = (typeof x === "number" ? x : Date.parse(String(x).replace(" ", "T") + "Z")) / 1000;
    const i = Math.min(s.wall.length - 1, C.lowerBound(s.wall, t));
    return s.step[i];
  }

  // ---- panels --------------------------------------------------------------------------------------
  // Panels live in collapsible sections (sections.js): the health signals first, then one per prefix.
  const sections = RLV.sections.create(RLV.$("panels"), function (body) {
    for (const plot of body.querySelectorAll(".plot")) if (plot.data) Plotly.Plots.resize(plot);
  });

  function ensurePanel(name) {
    let p = state.panels.get(name);
    if (p) return p;
    const signal = C.signalOf(name);
    const title = RLV.el("div", { className: "panel-title" }, name);
    if (signal && signal !== name) title.appendChild(RLV.el("span", { className: "signal", text: signal }));
    const div = RLV.el("div", { className: "plot" }, RLV.el("span", { className: "muted", text: "loading…" }));
    const node = RLV.el("div", { className: "panel", dataset: { metric: name } }, title, div);
    // keep the panel order within its section: health signals in signal order, then by name
    const key = RLV.sections.keyOf(name);
    const order = C.orderMetrics(Array.from(state.panels.keys()).filter(function (n) { return RLV.sections.keyOf(n) === key; }).concat([name]));
    const next = order[order.indexOf(name) + 1];
    sections.place(name, node, function () { return next ? state.panels.get(next).node : null; });
    p = { name: name, node: node, div: div, drawn: false, ema: C.emaState(), signal: signal };
    state.panels.set(name, p);
    RLV.$("panels-empty").hidden = true;
    return p;
  }

  // The alerts drawn on a panel: those on its signal (or naming its metric, like non_finite's
  // evidence), and run-wide ones on the health-signal panels (on every panel when there are few).
  function alertsFor(p) {
    return Array.from(state.alerts.values()).filter(function (a) {
      const named = a.evidence && a.evidence.non_finite && typeof a.evidence.non_finite === "object"
        ? Object.keys(a.evidence.non_finite) : [];
      if (named.length) return named.indexOf(p.name) >= 0;
      const target = a.signal || C.RULE_SIGNAL[a.rule];
      return target ? target === p.signal : !!p.signal || state.panels.size <= 6;
    });
  }

  // Whether a panel's y axis is logarithmic (the "log y" box, or its series spanning decades).
  function panelLog(p) { return C.isLog(state.overview.get(p.name), state.logy); }

  function shapesFor(p) {
    const shapes = [];
    const annotations = [];
    const x = stepToX(p.name);
    const series = state.overview.get(p.name);
    const first = series && series.step.length ? series.step[0] : NaN;
    const marked = RLV.marks.decorate(state.health, p.signal, x, panelLog(p), first, state.latestStep);
    if (marked.shapes.length) Array.prototype.push.apply(shapes, marked.shapes);
    else if (p.signal === C.BAND.signal) shapes.push(C.bandShape(panelLog(p)));
    Array.prototype.push.apply(annotations, marked.annotations);
    for (const a of alertsFor(p)) {
      for (const s of C.alertShapes(a, x, state.latestStep)) shapes.push(s);
      annotations.push(C.alertAnnotation(a, x));
    }
    for (const m of auditMarks(p, x)) {
      shapes.push(m.shape);
      annotations.push(m.annotation);
    }
    if (series && series.bad.length) {
      for (const step of series.bad.slice(-100)) {
        shapes.push({
          name: "non-finite", type: "line", xref: "x", yref: "paper", x0: x(step), x1: x(step), y0: 0, y1: 0.08,
          line: { color: "#dc2626", width: 2 },
        });
      }
    }
    if (state.focusStep !== null) {
      shapes.push({
        name: "focus-step", type: "line", xref: "x", yref: "paper", x0: x(state.focusStep), x1: x(state.focusStep),
        y0: 0, y1: 1, line: { color: "#111827", width: 1, dash: "dash" },
      });
    }
    return { shapes: shapes, annotations: annotations };
  }

  // Audits whose recomputation disagrees with what the trainer reported for this panel's metric: a red
  // line at the audited step, labelled, and a click on the label opens that audit.
  function auditMarks(p, x) {
    const out = [];
    for (const a of state.audits.values()) {
      if (RLV.auditOk(a) !== false) continue;
      const verdicts = a.verdicts || {};
      const failing = Object.keys(verdicts).filter(function (m) { return verdicts[m] && verdicts[m].ok === false; });
      const here = failing.filter(function (m) {
        const as = (a.reported_as || {})[m];
        return m === p.signal || m === p.name || (as !== undefined && as === p.name);
      });
      if (!here.length) continue;
      const step = Number(a.step);
      out.push({
        shape: {
          name: "audit-mismatch:" + a.id, type: "line", xref: "x", yref: "paper", x0: x(step), x1: x(step), y0: 0, y1: 1,
          line: { color: "#dc2626", width: 2 },
        },
        annotation: {
          name: "audit-mismatch:" + a.id, x: x(step), xref: "x", y: 0.9, yref: "paper", xanchor: "left", showarrow: false,
          text: RLV.ptext("✗ audit: reported " + here[0] + " disagrees"), font: { size: 10, color: "#b91c1c" },
          bgcolor: "rgba(254,226,226,0.9)", captureevents: true, hovertext: RLV.ptext("open audit " + a.id),
        },
      });
    }
    return out;
  }

  function traces(p, series) {
    const x = xOf(series);
    p.ema = C.emaState();
    const smooth = state.smoothing > 0;
    return [
      {
        type: "scatter", mode: "lines", name: RLV.ptext(p.name), x: x, y: series.value.slice(),
        line: { width: 1.2, color: "#2563eb" }, opacity: smooth ? 0.3 : 1, connectgaps: false,
        hovertemplate: "%{y:.6g}<extra>" + RLV.ptext(p.name) + "</extra>",
      },
      {
        type: "scatter", mode: "lines", name: "EMA", x: x.slice(),
        y: smooth ? C.emaExtend(p.ema, series.value, state.smoothing) : [],
        line: { width: 1.8, color: "#1e3a8a" }, visible: smooth, connectgaps: true,
        hovertemplate: "EMA %{y:.6g}<extra></extra>",
      },
    ];
  }

  function layoutFor(p) {
    const deco = shapesFor(p);
    const layout = C.layout({
      logy: state.logy, xdate: state.xmode === "wall" && state.hasWall, shapes: deco.shapes, annotations: deco.annotations,
    });
    C.axes(layout, state.overview.get(p.name), {
      name: p.name, logy: state.logy, xtitle: state.xmode === "wall" && state.hasWall ? "wall time" : "step",
    });
    if (state.view) {
      const x = stepToX(p.name);
      layout.xaxis.range = [x(state.view.start), x(state.view.end)];
      layout.xaxis.autorange = false;
    } else {
      layout.xaxis.autorange = true;
    }
    layout.uirevision = state.xmode + (state.view ? ":" + state.view.start + "-" + state.view.end : ":all");
    return layout;
  }

  function preview(p) {
    const spans = alertsFor(p).map(function (a) {
      const last = a.state === "firing" ? Math.max(Number(a.last_step), state.latestStep) : Number(a.last_step);
      return { x0: Number(a.first_step), x1: last, color: C.SEVERITY_COLOR[a.severity] || "#d97706" };
    });
    C.preview(p.div, state.overview.get(p.name) || emptySeries(), {
      band: p.signal === C.BAND.signal, spans: spans, logy: panelLog(p),
    });
  }

  function draw(p) {
    const series = seriesFor(p.name) || emptySeries();
    const first = !p.drawn;
    p.drawn = true;
    if (first) RLV.clear(p.div); // drop the preview
    p.yst = C.yStats(state.overview.get(p.name)); // the extremes the y scale was decided on
    p.log = C.isLogStats(p.yst, state.logy);
    const done = Plotly.react(p.div, traces(p, series), layoutFor(p), C.PLOT_CONFIG);
    if (first) {
      p.div.on("plotly_relayout", function (ev) { onRelayout(p, ev); });
      p.div.on("plotly_clickannotation", function (ev) {
        const name = String((ev && ev.annotation && ev.annotation.name) || "");
        if (name.startsWith("audit-mismatch:")) {
          window.location.href = RLV.safeHref(RLV.runPath(runId) + "/audits?audit=" + encodeURIComponent(name.slice(15)));
        }
      });
    }
    return done;
  }
  // New marks or alerts: the decorations and the y range they decide (C.fitY), the traces untouched.
  function redecorate(p) {
    if (!p.drawn) return;
    const l = layoutFor(p);
    const y = l.yaxis;
    const update = { shapes: l.shapes, annotations: l.annotations };
    const now = p.div.layout.yaxis || {};
    const same = function (a, b) { return JSON.stringify(a || null) === JSON.stringify(b || null); };
    if (!same(now.range, y.range) || !same(now.tickvals, y.tickvals)) { // the axis only when it changed
      Object.assign(update, {
        "yaxis.range": y.range, "yaxis.autorange": !!y.autorange, "yaxis.tickmode": y.tickmode || "auto",
        "yaxis.tickvals": y.tickvals || null, "yaxis.ticktext": y.ticktext || null,
      });
    }
    Plotly.relayout(p.div, update);
  }
  function redecorateAll() { for (const p of state.panels.values()) redecorate(p); }

  // Draw panels one per task so the first chart shows at once and the page stays responsive.
  function drawAll(onlyNew) {
    const list = Array.from(state.panels.values()).filter(function (p) {
      return state.overview.has(p.name) && !(onlyNew && p.drawn);
    });
    return new Promise(function (resolve) {
      let i = 0;
      function nextPanel() {
        if (i >= list.length) { resolve(); return; }
        const p = list[i++];
        Promise.resolve(draw(p)).then(function () { setTimeout(nextPanel, 0); });
      }
      nextPanel();
    });
  }

  // ---- zoom: full resolution for the visible range -------------------------------------------------
  // (Plotly.react never emits plotly_relayout, and our own Plotly.relayout calls carry no axis
  // range, so only the user's zooms and double-clicks get here.)
  let zoomTimer = null;
  function onRelayout(p, ev) {
    if (ev["xaxis.autorange"]) { setView(null); return; }
    let r0 = ev["xaxis.range[0]"], r1 = ev["xaxis.range[1]"];
    if (r0 === undefined && Array.isArray(ev["xaxis.range"])) { r0 = ev["xaxis.range"][0]; r1 = ev["xaxis.range"][1]; }
    if (r0 === undefined || r1 === undefined) return;
    const s0 = xToStep(p.name, r0), s1 = xToStep(p.name, r1);
    setView({ start: Math.floor(Math.min(s0, s1)), end: Math.ceil(Math.max(s0, s1)) });
  }

  function setView(view) {
    state.view = view;
    clearTimeout(zoomTimer);
    if (!view) {
      state.viewData.clear();
      RLV.$("view-info").textContent = "";
      redrawAll();
      return;
    }
    zoomTimer = setTimeout(fetchView, 120);
  }

  async function fetchView() {
    const view = state.view;
    if (!view) return;
    const names = Array.from(state.panels.keys());
    const fetched = new Map();
    try {
      for (let i = 0; i < names.length; i += 40) {
        const chunk = names.slice(i, i + 40);
        const body = await RLV.api(RLV.seriesUrl(runId, { names: chunk, start: view.start, end: view.end, max_points: state.maxPoints }));
        // (kept to the range here too, in case a server ignores start/end)
        for (const name of Object.keys(body.series || {})) fetched.set(name, C.slice(C.fromApi(body.series[name]), view.start, view.end));
      }
    } catch (err) { RLV.fail(err); return; }
    if (state.view !== view) return; // superseded by a newer zoom
    state.viewData = fetched;
    let shown = 0;
    for (const s of fetched.values()) shown = Math.max(shown, s.step.length);
    RLV.$("view-info").textContent = "steps " + view.start + "–" + view.end + " · " + shown + " points per series" +
      (shown < state.maxPoints ? " (full resolution)" : " (downsampled, extremes kept)");
    await redrawAll();
  }

  // Redraw every panel; calls during a redraw coalesce into one more pass.
  let redrawing = null;
  let redrawAgain = false;
  function redrawAll() {
    if (redrawing) {
      redrawAgain = true;
      return redrawing;
    }
    redrawing = (async function () {
      try {
        do {
          redrawAgain = false;
          await drawAll();
        } while (redrawAgain);
      } finally {
        redrawing = null;
      }
    })();
    return redrawing;
  }

  // ---- header, alerts, audits (drawn by runhead.js) ---------------------------------------------------
  const H = RLV.runHead;
  function renderRun(run) {
    state.run = run;
    if (typeof run.last_step === "number") state.latestStep = Math.max(state.latestStep, run.last_step);
    H.renderRun(run);
    renderLastStep();
  }
  function renderLastStep() { H.renderLastStep(state.latestStep); }
  function renderAlerts() { H.renderAlerts(runId, state.alerts.values(), focusOn, state.health, firstStep(), state.latestStep); }
  // The run's first logged step (over the series loaded so far; NaN before any).
  function firstStep() {
    let first = Infinity;
    for (const s of state.overview.values()) if (s.step.length && s.step[0] < first) first = s.step[0];
    return Number.isFinite(first) ? first : NaN;
  }
  // The rules' marks and the signals' current values: at load, on every alert, and every few seconds
  // while an alert fires (a forecast moves with the data).
  let healthTimer = null;
  async function refreshHealth() {
    clearTimeout(healthTimer);
    try {
      state.health = await RLV.api(RLV.marks.url(runId));
      renderAlerts();
      redecorateAll();
    } catch (err) { RLV.fail(err); }
    const firing = Array.from(state.alerts.values()).some(function (a) { return a.state === "firing"; });
    healthTimer = setTimeout(refreshHealth, firing ? 5000 : 30000);
  }
  let markedMismatches = 0;
  function renderAudits() {
    H.renderAudits(runId, state.audits.values());
    // a mismatch is marked on its metric's chart: redecorate when the set of mismatches grew
    let bad = 0;
    for (const a of state.audits.values()) if (RLV.auditOk(a) === false) bad += 1;
    if (bad !== markedMismatches) {
      markedMismatches = bad;
      redecorateAll();
    }
  }

  function focusOn(step) {
    state.focusStep = step;
    const first = firstStep();
    const span = Math.max(50, Math.round(((Number.isFinite(state.latestStep) ? state.latestStep : step) - (Number.isFinite(first) ? first : 0)) / 20));
    setView({ start: Math.max(0, step - span), end: step + span });
  }

  // ---- live events -----------------------------------------------------------------------------------
  let decoTimer = null;
  function scheduleRedecorate() {
    if (decoTimer) return;
    decoTimer = setTimeout(function () { decoTimer = null; redecorateAll(); }, 250);
  }

  // Whether appended points moved the panel's extremes: the y range comes from the data (C.fitY) and
  // extendTraces keeps the layout, so the range (and the log/linear scale) chosen on the first points
  // would stay and hide what arrives beyond them.
  function rescaled(p, add) {
    const st = C.yStats(add);
    if (!st.n || !p.yst || (st.min >= p.yst.min && st.max <= p.yst.max)) return false;
    p.yst = { min: Math.min(st.min, p.yst.min), max: Math.max(st.max, p.yst.max), n: st.n + p.yst.n };
    return true;
  }

  function appendPoints(payload) {
    const fresh = new Map(); // name -> {step, value, wall}
    for (const item of payload.steps || []) {
      const step = Number(item.step);
      const wall = typeof item.wall_time === "number" ? item.wall_time : null;
      const metrics = item.metrics || {};
      for (const name of Object.keys(metrics)) {
        let f = fresh.get(name);
        if (!f) { f = { step: [], value: [], wall: [], bad: [] }; fresh.set(name, f); }
        const v = RLV.num(metrics[name]);
        f.step.push(step);
        f.wall.push(wall);
        if (v !== null && !Number.isFinite(v)) { f.value.push(null); f.bad.push(step); } else f.value.push(v);
      }
      if (step > state.latestStep) state.latestStep = step;
    }
    let structural = false;
    for (const [name, f] of fresh) {
      let s = state.overview.get(name);
      const isNew = !s;
      if (isNew) { s = { step: [], value: [], wall: state.hasWall ? [] : null, bad: [] }; state.overview.set(name, s); }
      // only what the panel does not have yet (a resend or an event that raced the first fetch)
      const last = s.step.length ? s.step[s.step.length - 1] : -Infinity;
      const keep = [];
      for (let i = 0; i < f.step.length; i++) if (f.step[i] > last) keep.push(i);
      if (!keep.length) continue;
      const add = {
        step: keep.map(function (i) { return f.step[i]; }),
        value: keep.map(function (i) { return f.value[i]; }),
        wall: keep.map(function (i) { return f.wall[i]; }),
      };
      Array.prototype.push.apply(s.step, add.step);
      Array.prototype.push.apply(s.value, add.value);
      if (s.wall) Array.prototype.push.apply(s.wall, add.wall);
      for (const b of f.bad) if (b > last) { s.bad.push(b); structural = true; }
      const p = ensurePanel(name);
      if (isNew || !p.drawn) { draw(p); continue; }
      if (s.step.length > 3 * state.maxPoints) {
        state.overview.set(name, C.decimate(s, state.maxPoints));
        if (!state.view) draw(p);
        continue;
      }
      if (state.view && add.step[0] > state.view.end) continue; // looking at the past: keep the view
      if (state.view) {
        const v = state.viewData.get(name);
        if (!v) continue;
        Array.prototype.push.apply(v.step, add.step);
        Array.prototype.push.apply(v.value, add.value);
        if (v.wall) Array.prototype.push.apply(v.wall, add.wall);
      }
      if (rescaled(p, add)) { draw(p); continue; } // e.g. a 1e-45 arrived: a log axis would show only it
      const x = state.xmode === "wall" && s.wall ? add.wall.map(function (w) { return w === null ? null : w * 1000; }) : add.step;
      const ema = state.smoothing > 0 ? C.emaExtend(p.ema, add.value, state.smoothing) : [];
      Plotly.extendTraces(p.div, { x: [x, state.smoothing > 0 ? x : []], y: [add.value, ema] }, [0, 1]);
    }
    renderLastStep();
    const firing = Array.from(state.alerts.values()).some(function (a) { return a.state === "firing"; });
    if (structural || firing) scheduleRedecorate();
    RLV.timing.lastLivePoint = performance.now();
  }

  function onAlert(alert) {
    state.alerts.set(alert.id, alert);
    renderAlerts();
    redecorateAll();
    refreshHealth();
  }
  function renderIncidents() { H.renderIncidents(runId, state.incidents.values(), focusOn); }
  function onIncident(incident) {
    state.incidents.set(incident.id, incident);
    renderIncidents();
  }
  function onAudit(audit) {
    state.audits.set(audit.id, audit);
    renderAudits();
  }

  async function catchUp() {
    // The stream dropped and came back: fetch what was logged meanwhile (steps after the last seen).
    if (!Number.isFinite(state.latestStep)) return;
    try {
      const body = await RLV.api(RLV.seriesUrl(runId, { start: state.latestStep + 1, max_points: 0 }));
      const steps = new Map();
      for (const name of Object.keys(body.series || {})) {
        const s = body.series[name];
        (s.step || []).forEach(function (step, i) {
          let item = steps.get(step);
          if (!item) { item = { step: step, metrics: {}, wall_time: s.wall_time ? s.wall_time[i] : null }; steps.set(step, item); }
          item.metrics[name] = s.value[i];
        });
      }
      appendPoints({ steps: Array.from(steps.values()).sort(function (a, b) { return a.step - b.step; }) });
      const alerts = await RLV.api(base + "/alerts");
      for (const a of alerts.data || []) state.alerts.set(a.id, a);
      renderAlerts();
      redecorateAll();
      const incidents = await RLV.api(base + "/incidents");
      for (const i of incidents.data || []) state.incidents.set(i.id, i);
      renderIncidents();
    } catch (err) { RLV.fail(err); }
  }

  function onEvent(type, data) {
    if (type === "points") appendPoints(data);
    else if (type === "alert") onAlert(data);
    else if (type === "audit") onAudit(data);
    else if (type === "incident") onIncident(data);
    else if (type === "_state" && data === "reopen") catchUp();
  }

  // ---- controls --------------------------------------------------------------------------------------
  function wireControls() {
    const slider = RLV.$("smoothing");
    let smoothTimer = null;
    slider.addEventListener("input", function () {
      state.smoothing = Number(slider.value);
      RLV.$("smoothing-value").textContent = slider.value;
      clearTimeout(smoothTimer);
      smoothTimer = setTimeout(redrawAll, 60);
    });
    RLV.$("logy").addEventListener("change", function (e) { state.logy = e.target.checked; redrawAll(); });
    RLV.$("xmode").addEventListener("change", function (e) { state.xmode = e.target.value; redrawAll(); });
    RLV.$("reset-zoom").addEventListener("click", function () { state.focusStep = null; setView(null); });
    RLV.$("audits-link").setAttribute("href", RLV.safeHref(RLV.runPath(runId) + "/audits"));
    RLV.$("compare-link").setAttribute("href", RLV.safeHref("/compare?runs=" + encodeURIComponent(runId)));
  }

  function nextFrame() {
    return new Promise(function (resolve) { requestAnimationFrame(function () { setTimeout(resolve, 0); }); });
  }

  // ---- start -----------------------------------------------------------------------------------------
  // Series from the API into the overview; the names taken (empty series skipped when asked).
  function acceptSeries(series, skipEmpty) {
    const taken = [];
    for (const name of Object.keys(series || {})) {
      const s = C.fromApi(series[name]);
      if (skipEmpty && !s.step.length) continue;
      if (s.wall) state.hasWall = true;
      state.overview.set(name, s);
      if (s.step.length) state.latestStep = Math.max(state.latestStep, s.step[s.step.length - 1]);
      taken.push(name);
    }
    return taken;
  }

  async function firstChartDrawn() {
    if (RLV.timing.firstChart) return;
    await nextFrame();
    RLV.timing.firstChart = performance.now();
  }

  // Draw (or, before plotly.js is ready, preview) the panels whose series just arrived.
  let plotlyReady = false;
  function show(names) {
    for (const name of names) {
      const p = ensurePanel(name);
      if (plotlyReady) draw(p);
      else preview(p);
    }
  }

  // The rest of the series, a few per request (two requests in flight): panels fill in order
  // instead of all waiting for the slowest read.
  const CHUNK = 3;
  async function loadRest(names) {
    const todo = names.filter(function (n) { return !state.overview.has(n); });
    const chunks = [];
    for (let i = 0; i < todo.length; i += CHUNK) chunks.push(todo.slice(i, i + CHUNK));
    async function worker() {
      for (let chunk = chunks.shift(); chunk; chunk = chunks.shift()) {
        const body = await RLV.api(RLV.seriesUrl(runId, { names: chunk, max_points: state.maxPoints }));
        const got = acceptSeries(body.series, false);
        show(C.orderMetrics(got));
        if (got.length) await firstChartDrawn();
      }
    }
    await Promise.all([worker(), worker()]);
    RLV.timing.dataFetched = performance.now();
  }

  async function main() {
    wireControls();
    pre.run.then(renderRun, RLV.fail);
    try {
      for (const a of (await pre.alerts).data || []) state.alerts.set(a.id, a);
    } catch (err) {
      RLV.fail(err);
      return;
    }
    renderAlerts();
    pre.incidents.then(function (body) {
      for (const i of (body && body.data) || []) state.incidents.set(i.id, i);
      renderIncidents();
    }, RLV.fail);
    refreshHealth();
    // The first panel as soon as its own series is here: this is the "open" time the tests measure.
    const firstBody = await pre.firstMetrics.catch(function () { return null; });
    const early = firstBody ? C.orderMetrics(acceptSeries(firstBody.series, true)) : [];
    if (early.length) {
      show(early.slice(0, 1));
      await firstChartDrawn();
      show(early.slice(1));
    }
    loadAudits(); // small, and its box is already in place: the charts below never move
    // plotly.js boots (1-2 s of main thread when the machine is busy) while the server reads the rest
    const plotly = RLV.loadScript(document.querySelector("meta[name=rlv-plotly]").content).then(function () {
      plotlyReady = true;
      RLV.timing.plotlyReady = performance.now();
      return drawAll(false); // the panels previewed so far; later ones are drawn as they arrive
    });
    plotly.catch(function () { /* reported below */ });
    try {
      const names = C.orderMetrics((await pre.names).names || []);
      for (const name of names) ensurePanel(name); // every panel in place, in order
      RLV.$("panels-empty").hidden = names.length > 0;
      await loadRest(names);
    } catch (err) {
      RLV.fail(err);
      return;
    }
    const xsel = RLV.$("xmode");
    xsel.options[1].disabled = !state.hasWall;
    if (!state.hasWall) xsel.title = "this server does not send wall times";
    renderLastStep();
    // Then the interactive charts everywhere.
    try {
      await plotly;
    } catch (err) {
      RLV.fail(err);
      return;
    }
    await drawAll(true);
    RLV.timing.allCharts = performance.now();
    pre.events.attach(onEvent);
    const focus = new URLSearchParams(window.location.search).get("step");
    if (focus !== null && Number.isFinite(Number(focus))) focusOn(Number(focus));
    loadAudits();
  }

  let auditsLoading = null;
  function loadAudits() {
    if (!auditsLoading) {
      auditsLoading = RLV.api(base + "/audits").then(function (body) {
        for (const a of body.data || []) if (!state.audits.has(a.id)) state.audits.set(a.id, a);
        renderAudits();
        if (RLV.timing) RLV.timing.audits = performance.now();
      }, RLV.fail);
    }
    return auditsLoading;
  }

  main();
})();

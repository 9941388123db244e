// rlvitals dashboard: overlay chosen runs on the same metrics. Metrics are matched by health signal
// (a verl run's actor/ppo_kl and an OpenRLHF run's ppo_kl share a panel), other metrics by name.
(function () {
  "use strict";
  const RLV = window.RLV;
  const C = RLV.charts;
  const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#4b5563", "#ea580c"];
  const MAX_LIVE = 4; // browsers allow 6 connections per host; keep some for requests
  const params = new URLSearchParams(window.location.search);
  const state = {
    runs: [],
    chosen: (params.get("runs") || "").split(",").filter(Boolean),
    metrics: (params.get("metrics") || "").split(",").filter(Boolean),
    data: new Map(), // run id -> Map(panel key -> {name, series})
    panels: new Map(), // key -> {div, runs: [run id per trace], ema: [state per trace]}
    streams: new Map(),
    smoothing: 0,
    logy: false,
  };
  RLV.state = state;

  function keyOf(name) { return C.signalOf(name) || name; }
  function runName(id) {
    const r = state.runs.find(function (x) { return String(x.id) === String(id); });
    return r ? r.name : "run " + id;
  }
  function color(id) { return PALETTE[state.chosen.indexOf(String(id)) % PALETTE.length]; }

  function syncUrl() {
    const u = new URLSearchParams();
    if (state.chosen.length) u.set("runs", state.chosen.join(","));
    if (state.metrics.length) u.set("metrics", state.metrics.join(","));
    window.history.replaceState(null, "", "?" + u.toString());
  }

  function renderRunPicker() {
    const q = RLV.$("run-search").value.trim().toLowerCase();
    const ul = RLV.clear(RLV.$("run-picker"));
    for (const r of state.runs) {
      const id = String(r.id);
      const on = state.chosen.indexOf(id) >= 0;
      if (q && !on && (r.name + "\n" + r.project).toLowerCase().indexOf(q) < 0) continue;
      const box = RLV.el("input", { type: "checkbox", checked: on, dataset: { runId: id } });
      box.addEventListener("change", function () {
        if (box.checked) state.chosen.push(id);
        else state.chosen = state.chosen.filter(function (x) { return x !== id; });
        syncUrl();
        load();
      });
      ul.appendChild(RLV.el("li", {}, RLV.el("label", {}, box, " ", RLV.badge(r.status), " ", r.name,
        RLV.el("span", { className: "muted", text: " " + (r.project || "") }))));
    }
  }

  function availableKeys() {
    const keys = new Set();
    for (const id of state.chosen) {
      const m = state.data.get(id);
      if (m) for (const k of m.keys()) keys.add(k);
    }
    return C.orderMetrics(Array.from(keys));
  }

  function renderMetricPicker() {
    const keys = availableKeys();
    if (!state.metrics.length) {
      state.metrics = keys.filter(function (k) { return C.signalOf(k); });
      if (!state.metrics.length) state.metrics = keys.slice(0, 6);
    }
    const ul = RLV.clear(RLV.$("metric-picker"));
    for (const k of keys) {
      const box = RLV.el("input", { type: "checkbox", checked: state.metrics.indexOf(k) >= 0, dataset: { metric: k } });
      box.addEventListener("change", function () {
        if (box.checked) state.metrics.push(k);
        else state.metrics = state.metrics.filter(function (x) { return x !== k; });
        syncUrl();
        drawPanels();
      });
      ul.appendChild(RLV.el("li", {}, RLV.el("label", {}, box, " ", k)));
    }
  }

  function traceFor(id, key, t) {
    const entry = state.data.get(id).get(key);
    const series = entry ? entry.series : { step: [], value: [] };
    const ema = C.emaState();
    const y = state.smoothing > 0 ? C.emaExtend(ema, series.value, state.smoothing) : series.value;
    t.ema.push(ema);
    return {
      type: "scatter", mode: "lines", name: RLV.ptext(runName(id) + " (#" + id + ")"), x: series.step.slice(), y: y.slice(),
      line: { width: 1.4, color: color(id) }, connectgaps: state.smoothing > 0,
    };
  }

  async function drawPanels() {
    const node = RLV.clear(RLV.$("panels"));
    state.panels.clear();
    const ids = state.chosen.filter(function (id) { return state.data.has(id); });
    RLV.$("compare-empty").hidden = ids.length >= 2;
    if (!ids.length) return;
    const keys = C.orderMetrics(state.metrics.filter(function (k) { return availableKeys().indexOf(k) >= 0; }));
    for (const key of keys) {
      const div = RLV.el("div", { className: "plot tall" });
      node.appendChild(RLV.el("div", { className: "panel", dataset: { metric: key } }, RLV.el("div", { className: "panel-title", text: key }), div));
      const t = { div: div, runs: ids.slice(), ema: [] };
      state.panels.set(key, t);
      const data = ids.map(function (id) { return traceFor(id, key, t); });
      const shapes = key === C.BAND.signal ? [C.bandShape(state.logy)] : [];
      const layout = C.layout({ logy: state.logy, legend: true, shapes: shapes });
      layout.height = 300;
      await Plotly.newPlot(div, data, layout, C.PLOT_CONFIG);
    }
    RLV.timing.drawn = performance.now();
  }

  function onPoints(id, payload) {
    const m = state.data.get(id);
    if (!m) return;
    const fresh = new Map();
    for (const item of payload.steps || []) {
      for (const name of Object.keys(item.metrics || {})) {
        const key = keyOf(name);
        let entry = m.get(key);
        if (!entry) { entry = { name: name, series: { step: [], value: [], wall: null, bad: [] } }; m.set(key, entry); }
        if (entry.name !== name) continue;
        const s = entry.series;
        const step = Number(item.step);
        if (s.step.length && step <= s.step[s.step.length - 1]) continue;
        let v = RLV.num(item.metrics[name]);
        if (v !== null && !Number.isFinite(v)) v = null;
        s.step.push(step);
        s.value.push(v);
        let f = fresh.get(key);
        if (!f) { f = { x: [], y: [] }; fresh.set(key, f); }
        f.x.push(step);
        f.y.push(v);
      }
    }
    for (const [key, f] of fresh) {
      const t = state.panels.get(key);
      if (!t) continue;
      const idx = t.runs.indexOf(id);
      if (idx < 0) continue;
      const y = state.smoothing > 0 ? C.emaExtend(t.ema[idx], f.y, state.smoothing) : f.y;
      Plotly.extendTraces(t.div, { x: [f.x], y: [y] }, [idx]);
    }
    RLV.timing.lastLivePoint = performance.now();
  }

  function syncStreams() {
    for (const [id, s] of state.streams) {
      if (state.chosen.indexOf(id) < 0) { s.close(); state.streams.delete(id); }
    }
    for (const id of state.chosen.slice(0, MAX_LIVE)) {
      if (state.streams.has(id)) continue;
      state.streams.set(id, RLV.stream(id, function (type, data) { if (type === "points") onPoints(id, data); }, RLV.setLive));
    }
  }

  async function load() {
    renderRunPicker();
    const maxPoints = RLV.overviewPoints();
    try {
      await Promise.all(state.chosen.filter(function (id) { return !state.data.has(id); }).map(async function (id) {
        const body = await RLV.api(RLV.seriesUrl(id, { max_points: maxPoints }));
        const m = new Map();
        for (const name of C.orderMetrics(Object.keys(body.series || {}))) {
          const key = keyOf(name);
          if (!m.has(key)) m.set(key, { name: name, series: C.fromApi(body.series[name]) });
        }
        state.data.set(id, m);
      }));
    } catch (err) { RLV.fail(err); }
    renderMetricPicker();
    syncStreams();
    await drawPanels();
  }

  RLV.$("run-search").addEventListener("input", renderRunPicker);
  RLV.$("compare-logy").addEventListener("change", function (e) { state.logy = e.target.checked; drawPanels(); });
  RLV.$("compare-smoothing").addEventListener("change", function (e) { state.smoothing = Number(e.target.value); drawPanels(); });
  RLV.pre.runs.then(function (body) {
    state.runs = body.data || [];
    state.chosen = state.chosen.filter(function (id) { return state.runs.some(function (r) { return String(r.id) === id; }); });
    return load();
  }).catch(RLV.fail);
})();

// rlvitals dashboard: chart helpers shared by the run, audits and compare pages (plotly.js is only
// called once loaded; the SVG preview needs nothing).
(function () {
  "use strict";
  const RLV = window.RLV;
  const C = (RLV.charts = {});

  // The health signals in panel order and the names verl, TRL and OpenRLHF log them under: the
  // analyzers' own alias tables, served as /static/js/signals.js (window.RLV_SIGNALS).
  const TABLE = window.RLV_SIGNALS || { order: [], aliases: {}, prefixes: [] };
  const ALIAS = new Map(); // raw name -> [signal rank, alias rank]
  TABLE.order.forEach(function (signal, si) {
    (TABLE.aliases[signal] || []).forEach(function (alias, ai) { if (!ALIAS.has(alias)) ALIAS.set(alias, [si, ai]); });
  });

  function lookup(name) {
    const n = String(name);
    if (ALIAS.has(n)) return ALIAS.get(n);
    for (const p of TABLE.prefixes) if (n.startsWith(p) && ALIAS.has(n.slice(p.length))) return ALIAS.get(n.slice(p.length));
    return null;
  }
  C.signalOf = function (name) {
    const hit = lookup(name);
    if (hit) return TABLE.order[hit[0]];
    return TABLE.order.indexOf(String(name)) >= 0 ? String(name) : null; // a panel keyed by its signal
  };
  // Health-signal panels first (in signal order, the preferred alias first), then every other metric by name.
  C.orderMetrics = function (names) {
    const rank = function (n) {
      const hit = lookup(n);
      if (hit) return hit[0] * 100 + hit[1];
      const si = TABLE.order.indexOf(String(n));
      return si >= 0 ? si * 100 : 1e9;
    };
    return names.slice().sort(function (a, b) {
      const d = rank(a) - rank(b);
      return d !== 0 ? d : a < b ? -1 : a > b ? 1 : 0;
    });
  };

  // Which chart an alert belongs on; rules without a chart of their own are drawn on every panel.
  C.RULE_SIGNAL = {
    pg_clipfrac_range: "pg_clipfrac",
    ppo_kl_drift: "ppo_kl",
    pg_clipfrac_lower_high: "pg_clipfrac_lower",
    kl_loss_runaway: "kl_loss",
    entropy_collapse: "entropy",
  };
  C.BAND = { signal: "pg_clipfrac", low: 0.1, high: 0.3 };
  C.SEVERITY_COLOR = { critical: "#dc2626", warning: "#d97706", info: "#0e7490" };

  // Debiased exponential moving average (TensorBoard's smoothing); nulls and non-finite values pass.
  C.emaState = function () { return { last: 0, n: 0 }; };
  C.emaExtend = function (state, values, weight) {
    const out = new Array(values.length);
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v === null || !Number.isFinite(v)) { out[i] = null; continue; }
      state.last = state.last * weight + (1 - weight) * v;
      state.n += 1;
      out[i] = weight > 0 ? state.last / (1 - Math.pow(weight, state.n)) : v;
    }
    return out;
  };

  // Series as the API sends them -> {step, value, wall} plain arrays; non-finite values become null
  // (a gap in the line) and their steps are kept in .bad for markers.
  C.fromApi = function (s) {
    const step = s.step || [];
    const raw = s.value || [];
    const wall = s.wall_time || null;
    const value = new Array(raw.length);
    const bad = [];
    for (let i = 0; i < raw.length; i++) {
      const v = RLV.num(raw[i]);
      if (v !== null && !Number.isFinite(v)) { value[i] = null; bad.push(step[i]); } else value[i] = v;
    }
    return { step: step.slice(), value: value, wall: wall ? wall.slice() : null, bad: bad };
  };

  // Keep each bucket's minimum and maximum (as the server does) when live appends grow a series.
  C.decimate = function (series, maxPoints) {
    const n = series.step.length;
    if (n <= maxPoints) return series;
    const buckets = Math.max(1, Math.floor(maxPoints / 2));
    const size = n / buckets;
    const out = { step: [], value: [], wall: series.wall ? [] : null, bad: series.bad };
    for (let b = 0; b < buckets; b++) {
      const lo = Math.floor(b * size);
      const hi = Math.min(n, Math.floor((b + 1) * size));
      let imin = -1, imax = -1;
      for (let i = lo; i < hi; i++) {
        const v = series.value[i];
        if (v === null) continue;
        if (imin < 0 || v < series.value[imin]) imin = i;
        if (imax < 0 || v > series.value[imax]) imax = i;
      }
      const picks = imin < 0 ? [lo] : imin === imax ? [imin] : [Math.min(imin, imax), Math.max(imin, imax)];
      for (const i of picks) {
        out.step.push(series.step[i]);
        out.value.push(series.value[i]);
        if (out.wall) out.wall.push(series.wall[i]);
      }
    }
    return out;
  };

  // The part of a series with start <= step <= end.
  C.slice = function (series, start, end) {
    const i = C.lowerBound(series.step, start);
    let j = C.lowerBound(series.step, end + 1);
    if (i === 0 && j === series.step.length) return series;
    return {
      step: series.step.slice(i, j), value: series.value.slice(i, j), wall: series.wall ? series.wall.slice(i, j) : null,
      bad: series.bad.filter(function (s) { return s >= start && s <= end; }),
    };
  };

  // First index with step >= target (steps ascending).
  C.lowerBound = function (arr, target) {
    let lo = 0, hi = arr.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (arr[mid] < target) lo = mid + 1; else hi = mid;
    }
    return lo;
  };

  C.PLOT_CONFIG = {
    responsive: true,
    displaylogo: false,
    scrollZoom: false,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines"],
  };

  C.layout = function (opts) {
    const o = opts || {};
    return {
      margin: { l: 56, r: 12, t: 18, b: 32 },
      height: 260,
      showlegend: !!o.legend,
      legend: { orientation: "h", y: -0.18, font: { size: 11 } },
      hovermode: "x unified",
      uirevision: "keep",
      dragmode: "zoom",
      xaxis: { type: o.xdate ? "date" : "linear", zeroline: false, automargin: true },
      yaxis: { type: o.logy ? "log" : "linear", fixedrange: true, automargin: true, exponentformat: "e" },
      shapes: o.shapes || [],
      annotations: o.annotations || [],
      paper_bgcolor: "#fff",
      plot_bgcolor: "#fff",
      font: { family: "system-ui, sans-serif", size: 11 },
    };
  };

  // The healthy clip-fraction band, shaded across the whole chart.
  C.bandShape = function (logy) {
    const y = function (v) { return logy ? Math.log10(v) : v; };
    return {
      name: "healthy-band",
      type: "rect", xref: "paper", yref: "y", x0: 0, x1: 1, y0: y(C.BAND.low), y1: y(C.BAND.high),
      fillcolor: "#22c55e", opacity: 0.12, line: { width: 0 }, layer: "below",
    };
  };

  // Alert span (first_step..last_step) plus an onset marker; x() maps a step to the axis.
  C.alertShapes = function (alert, x, latestStep) {
    const color = C.SEVERITY_COLOR[alert.severity] || "#d97706";
    const first = Number(alert.first_step);
    let last = Number(alert.last_step);
    if (alert.state === "firing" && Number.isFinite(latestStep)) last = Math.max(last, latestStep);
    if (!Number.isFinite(last) || last < first) last = first;
    return [
      {
        name: "alert-span:" + alert.id,
        type: "rect", xref: "x", yref: "paper", x0: x(first), x1: x(last), y0: 0, y1: 1,
        fillcolor: color, opacity: alert.state === "firing" ? 0.13 : 0.07, line: { width: 0 }, layer: "below",
      },
      {
        name: "alert-onset:" + alert.id,
        type: "line", xref: "x", yref: "paper", x0: x(first), x1: x(first), y0: 0, y1: 1,
        line: { color: color, width: 1.5, dash: "dot" },
      },
    ];
  };
  C.alertAnnotation = function (alert, x) {
    return {
      name: "alert-label:" + alert.id,
      x: x(Number(alert.first_step)), xref: "x", y: 1, yref: "paper", yanchor: "bottom", showarrow: false,
      text: RLV.ptext(alert.rule), font: { size: 10, color: C.SEVERITY_COLOR[alert.severity] || "#d97706" },
    };
  };

  // A light, non-interactive SVG drawing of a series, shown until plotly.js has booted (the same data,
  // band and alert spans; plotly replaces it). opts: {band: bool, spans: [{x0, x1, color}], x: "step"}.
  const SVG = "http://www.w3.org/2000/svg";
  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const k of Object.keys(attrs)) node.setAttribute(k, String(attrs[k]));
    return node;
  }
  C.preview = function (div, series, opts) {
    const o = opts || {};
    const log = !!o.logy;
    const ty = function (v) { return log ? Math.log10(v) : v; }; // value -> drawn coordinate
    const m = { l: 56, r: 12, t: 18, b: 32 };
    const w = Math.max(200, div.clientWidth || 600);
    const h = 260;
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (let i = 0; i < series.step.length; i++) {
      const v = series.value[i] === null ? null : ty(series.value[i]);
      if (v === null || !Number.isFinite(v)) continue;
      const x = series.step[i];
      if (x < x0) x0 = x;
      if (x > x1) x1 = x;
      if (v < y0) y0 = v;
      if (v > y1) y1 = v;
    }
    if (o.band) { y0 = Math.min(y0, ty(C.BAND.low)); y1 = Math.max(y1, ty(C.BAND.high)); }
    if (!Number.isFinite(x0)) { x0 = 0; x1 = 1; y0 = 0; y1 = 1; }
    if (x1 === x0) x1 = x0 + 1;
    const constant = y1 === y0;
    if (constant) { const d = log ? 0.5 : y0 === 0 ? 1 : Math.abs(y0) * 0.5; y0 -= d; y1 += d; } // as C.axes
    const pad = (y1 - y0) * 0.05;
    y0 -= pad; y1 += pad;
    const px = function (x) { return m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r); };
    const py = function (y) { return h - m.b - ((y - y0) / (y1 - y0)) * (h - m.t - m.b); };
    const svg = svgEl("svg", { width: w, height: h, class: "preview", "data-points": series.step.length });
    // Tick labels: the value's own for a constant series; the left margin grows to the widest label
    // and the last x label ends at the edge, so nothing is clipped.
    const yticks = (constant ? [(y0 + y1) / 2] : [y0 + pad, (y0 + y1) / 2, y1 - pad]).map(function (v) {
      return { v: v, text: RLV.fmtNum(log ? Math.pow(10, v) : v) };
    });
    const widest = Math.max.apply(null, yticks.map(function (t) { return t.text.length; }));
    m.l = Math.max(m.l, Math.ceil(widest * 6.6) + 12);
    if (o.band) {
      svg.appendChild(svgEl("rect", {
        class: "band", x: m.l, width: w - m.l - m.r, y: py(ty(C.BAND.high)), height: Math.max(0, py(ty(C.BAND.low)) - py(ty(C.BAND.high))),
        fill: "#22c55e", "fill-opacity": 0.12,
      }));
    }
    for (const sp of o.spans || []) {
      const a = px(Math.max(x0, sp.x0)), b = px(Math.min(x1, sp.x1));
      if (b < a) continue;
      svg.appendChild(svgEl("rect", { x: a, width: Math.max(1, b - a), y: m.t, height: h - m.t - m.b, fill: sp.color, "fill-opacity": 0.12 }));
    }
    svg.appendChild(svgEl("line", { x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b, stroke: "#9ca3af" }));
    svg.appendChild(svgEl("line", { x1: m.l, x2: m.l, y1: m.t, y2: h - m.b, stroke: "#9ca3af" }));
    const label = function (text, x, y, anchor) {
      const t = svgEl("text", { x: x, y: y, "text-anchor": anchor, "font-size": 11, fill: "#6b7280" });
      t.textContent = text;
      svg.appendChild(t);
    };
    yticks.forEach(function (t) { label(t.text, m.l - 6, py(t.v) + 4, "end"); });
    [[x0, "start"], [(x0 + x1) / 2, "middle"], [x1, "end"]].forEach(function (t) {
      label(RLV.fmtNum(Math.round(t[0])), px(t[0]), h - m.b + 16, t[1]);
    });
    let d = "";
    let pen = false;
    for (let i = 0; i < series.step.length; i++) {
      const v = series.value[i] === null ? null : ty(series.value[i]);
      if (v === null || !Number.isFinite(v)) { pen = false; continue; }
      d += (pen ? "L" : "M") + px(series.step[i]).toFixed(1) + " " + py(v).toFixed(1);
      pen = true;
    }
    svg.appendChild(svgEl("path", { d: d || "M0 0", fill: "none", stroke: "#2563eb", "stroke-width": 1.2 }));
    RLV.clear(div).appendChild(svg);
  };

  // ---- axes that explain: titles, automatic log-y, a readable constant series ----------------------
  // A panel goes log-y by itself when its finite values are all positive and span LOG_DECADES
  // decades or more (a kl_loss growing 1e-4 -> 0.5 is a flat line on a linear axis); the "log y"
  // box forces it everywhere. The whole run's series decides, so zooming never flips the scale.
  // Past LOG_MAX_DECADES the smallest values are zero in all but name (an on-policy ppo_kl of 1e-45
  // from float rounding): a log axis would spend most of its height on them, so the panel stays linear.
  C.LOG_DECADES = 2;
  C.LOG_MAX_DECADES = 8;
  C.yStats = function (series) {
    let min = Infinity, max = -Infinity, n = 0;
    const values = (series && series.value) || [];
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v === null || !Number.isFinite(v)) continue;
      if (v < min) min = v;
      if (v > max) max = v;
      n++;
    }
    return { min: min, max: max, n: n };
  };
  // The scale from a series' stats (C.yStats), so a live append can re-decide from its new extremes.
  C.isLogStats = function (st, forced) {
    if (forced) return st.n === 0 || st.min > 0; // a log axis cannot show zero or negative values
    const span = st.max / st.min;
    return st.n > 1 && st.min > 0 && span >= Math.pow(10, C.LOG_DECADES) && span <= Math.pow(10, C.LOG_MAX_DECADES);
  };
  C.autoLog = function (series) { return C.isLogStats(C.yStats(series), false); };
  C.isLog = function (series, forced) { return C.isLogStats(C.yStats(series), forced); };
  // The metric's short name for the y title ("actor/pg_clipfrac" -> "pg_clipfrac").
  C.shortName = function (name) {
    const parts = String(name).split("/");
    return parts[parts.length - 1] || String(name);
  };
  // Titles, the y scale, and for a constant series a narrow range with its value as the one tick
  // (autorange would pad it to +-1 and print ticks that never name the value).
  C.axes = function (layout, series, opts) {
    const o = opts || {};
    const log = C.isLog(series, o.logy);
    const st = C.yStats(series);
    layout.xaxis.title = { text: o.xtitle || "step", standoff: 4, font: { size: 11, color: "#6b7280" } };
    layout.yaxis.title = {
      text: RLV.ptext(C.shortName(o.name || "")) + (log && !o.logy ? " (log, auto)" : log ? " (log)" : ""),
      standoff: 4, font: { size: 11, color: "#6b7280" },
    };
    layout.yaxis.type = log ? "log" : "linear";
    if (log && st.n > 0 && st.min !== st.max) {
      // A log axis gets its range from the data and the threshold lines (in log units, as plotly wants
      // them on a log axis): plotly's autorange pads for the lines' labels in a way that, on a log axis,
      // reached 1e-40 for data spanning 1e-3..1.3. A band reaching 0 (drawn from 1e-12) does not count.
      let lo = Math.log10(st.min), hi = Math.log10(st.max);
      for (const s of layout.shapes || []) {
        if (s.yref !== "y") continue;
        for (const v of [s.y0, s.y1]) {
          if (Number.isFinite(v) && v > -12) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
        }
      }
      const pad = (hi - lo) * 0.05;
      layout.yaxis.range = [lo - pad, hi + pad];
      layout.yaxis.autorange = false;
    }
    if (st.n > 0 && st.min === st.max) {
      const v = st.min;
      if (log) layout.yaxis.range = [Math.log10(v) - 0.5, Math.log10(v) + 0.5];
      else {
        const d = v === 0 ? 1 : Math.abs(v) * 0.5;
        layout.yaxis.range = [v - d, v + d];
      }
      layout.yaxis.autorange = false;
      layout.yaxis.tickmode = "array";
      layout.yaxis.tickvals = [v];
      layout.yaxis.ticktext = [RLV.fmtNum(v)];
    }
    return layout;
  };

  C.histogram = function (div, hist, opts) {
    const o = opts || {};
    const edges = hist.edges || [];
    const counts = hist.counts || [];
    const centers = [];
    const widths = [];
    for (let i = 0; i < counts.length; i++) {
      centers.push((edges[i] + edges[i + 1]) / 2);
      widths.push(edges[i + 1] - edges[i]);
    }
    const shapes = (o.lines || []).map(function (l) {
      return {
        name: l.name, type: "line", xref: "x", yref: "paper", x0: l.x, x1: l.x, y0: 0, y1: 1,
        line: { color: l.color || "#dc2626", width: 1.5, dash: "dash" },
      };
    });
    const layout = C.layout({ shapes: shapes });
    layout.hovermode = "closest";
    layout.bargap = 0;
    layout.yaxis.type = o.logy ? "log" : "linear";
    layout.yaxis.title = { text: "tokens" };
    return Plotly.newPlot(div, [{
      type: "bar", name: RLV.ptext(o.name || "count"), x: centers, y: counts, width: widths,
      marker: { color: o.color || "#2563eb" },
    }], layout, C.PLOT_CONFIG);
  };
})();

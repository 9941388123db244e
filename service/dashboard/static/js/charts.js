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
  // The y title: the metric's full name ("response_length/mean", not "mean"), its head cut with "…"
  // when it is too long for the axis (the tail is the part that differs between panels).
  C.TITLE_CHARS = 44;
  C.yTitle = function (name) {
    const n = String(name);
    return n.length <= C.TITLE_CHARS ? n : "…" + n.slice(n.length - C.TITLE_CHARS + 1);
  };
  // Titles, the y scale and the y range (C.fitY).
  C.axes = function (layout, series, opts) {
    const o = opts || {};
    const log = C.isLog(series, o.logy);
    const st = C.yStats(series);
    layout.xaxis.title = { text: o.xtitle || "step", standoff: 4, font: { size: 11, color: "#6b7280" } };
    layout.yaxis.title = {
      text: RLV.ptext(C.yTitle(o.name || "")) + (log && !o.logy ? " (log, auto)" : log ? " (log)" : ""),
      standoff: 4, font: { size: 11, color: "#6b7280" },
    };
    layout.yaxis.type = log ? "log" : "linear";
    C.fitY(layout, st, log);
    return layout;
  };

  // ---- the y range comes from the data ---------------------------------------------------------------
  // The range is the data's, padded. A threshold line or band edge close to the data (within MARK_REACH
  // of its span) widens it, so it is drawn in place; one further away would squash the series into a
  // flat line (a ppo_kl of 2.5e-5 under its 0.05 ceiling), so its line is dropped and its label is
  // written at the top or bottom edge with an arrow. A constant series gets a narrow range with its value
  // as the one tick (autorange would pad it to +-1 with ticks that never name the value), widened to its
  // marks when they are near (a pg_clipfrac of exactly 0 beside its 0.1-0.3 band: the band and the ticks
  // 0..0.3). Labels of lines drawn in place never overlap (C.spreadLabels).
  C.MARK_REACH = 0.25;
  C.PAD = 0.05;
  function isMarkLine(s) { return s.yref === "y" && s.type === "line" && String(s.name || "").startsWith("mark:"); }
  function isBand(s) { return s.yref === "y" && s.type === "rect" && s.name === "healthy-band"; }
  C.fitY = function (layout, st, log) {
    if (!st.n || (log && !(st.min > 0))) return layout;
    const ax = function (v) { return log ? Math.log10(v) : v; };
    const lo0 = ax(st.min), hi0 = ax(st.max);
    const constant = lo0 === hi0;
    // how far beyond the data a mark may lie and still be drawn in place (in axis units)
    const reach = constant ? (log ? 1 : lo0 === 0 ? 1 : 2 * Math.abs(lo0)) : C.MARK_REACH * (hi0 - lo0);
    const near = function (v) { return Number.isFinite(v) && v > -12 && v >= lo0 - reach && v <= hi0 + reach; };
    const shapes = layout.shapes || [];
    let lo = lo0, hi = hi0;
    for (const s of shapes) {
      if (!isMarkLine(s) && !isBand(s)) continue;
      for (const v of isBand(s) ? [s.y0, s.y1] : [s.y0]) {
        if (near(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
      }
    }
    if (lo === hi) {
      const d = log ? 0.5 : lo === 0 ? 1 : Math.abs(lo) * 0.5;
      layout.yaxis.range = [lo - d, hi + d];
      layout.yaxis.tickmode = "array";
      layout.yaxis.tickvals = [st.min];
      layout.yaxis.ticktext = [RLV.fmtNum(st.min)];
    } else {
      const pad = (hi - lo) * C.PAD;
      layout.yaxis.range = [lo - pad, hi + pad];
    }
    layout.yaxis.autorange = false;
    const range = layout.yaxis.range;
    // marks outside the range: named at the edge instead of drawn
    const edge = { above: [], below: [] };
    const byName = new Map();
    for (const a of layout.annotations || []) if (a.name && a.yref === "y") byName.set(a.name, a);
    const kept = [];
    for (const s of shapes) {
      if (isMarkLine(s) && (s.y0 > range[1] || s.y0 < range[0])) {
        const side = s.y0 > range[1] ? "above" : "below";
        const label = byName.get(s.name);
        edge[side].push({ name: s.name, text: label ? label.text : "", color: (label && label.font && label.font.color) || s.line.color });
        if (label) label.drop = true;
        continue;
      }
      if (isBand(s) && (Math.min(s.y0, s.y1) > range[1] || Math.max(s.y0, s.y1) < range[0])) {
        const side = Math.min(s.y0, s.y1) > range[1] ? "above" : "below";
        const txt = "healthy band " + RLV.fmtNum(log ? Math.pow(10, s.y0) : s.y0) + "–" + RLV.fmtNum(log ? Math.pow(10, s.y1) : s.y1);
        edge[side].push({ name: "healthy-band", text: RLV.ptext(txt), color: "#15803d" });
      }
      kept.push(s);
    }
    layout.shapes = kept;
    const annotations = (layout.annotations || []).filter(function (a) { return !a.drop; });
    ["above", "below"].forEach(function (side) {
      edge[side].forEach(function (m, i) {
        annotations.push({
          name: "edge:" + m.name, edge: side, x: 1, xref: "paper", xanchor: "right",
          y: side === "above" ? 1 : 0, yref: "paper", yanchor: side === "above" ? "top" : "bottom",
          yshift: side === "above" ? -12 * i : 12 * i, showarrow: false,
          text: (side === "above" ? "↑ " : "↓ ") + m.text + (side === "above" ? " (above the data)" : " (below the data)"),
          font: { size: 9, color: m.color }, bgcolor: "rgba(255,255,255,0.8)",
        });
      });
    });
    layout.annotations = annotations;
    C.spreadLabels(layout);
    return layout;
  };

  // Threshold labels drawn in place sit on their line at the right edge; two lines closer than a label's
  // height (entropy's floor 0.02 and its 0.1× early level 0.023) would print one label over the other, so
  // the next one moves to the left edge, then below its line.
  C.LABEL_PX = 12;
  C.spreadLabels = function (layout) {
    const range = layout.yaxis.range;
    if (!range) return layout;
    const plotPx = Math.max(60, (layout.height || 260) - (layout.margin ? layout.margin.t + layout.margin.b : 50));
    const px = function (y) { return ((y - range[0]) / (range[1] - range[0])) * plotPx; };
    const labels = (layout.annotations || []).filter(function (a) { return a.yref === "y" && String(a.name || "").startsWith("mark:"); });
    labels.sort(function (a, b) { return a.y - b.y; });
    const placed = []; // {side, anchor, px}
    for (const a of labels) {
      const y = px(a.y);
      const slots = [["right", "bottom"], ["left", "bottom"], ["right", "top"], ["left", "top"]];
      let chosen = slots[0];
      for (const slot of slots) {
        const top = slot[1] === "bottom" ? y + C.LABEL_PX : y;
        const bottom = slot[1] === "bottom" ? y : y - C.LABEL_PX;
        const clash = placed.some(function (p) { return p.side === slot[0] && !(bottom >= p.top || top <= p.bottom); });
        if (!clash) { chosen = slot; break; }
      }
      a.x = chosen[0] === "right" ? 1 : 0;
      a.xanchor = chosen[0];
      a.yanchor = chosen[1];
      placed.push({ side: chosen[0], top: chosen[1] === "bottom" ? y + C.LABEL_PX : y, bottom: chosen[1] === "bottom" ? y : y - C.LABEL_PX });
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

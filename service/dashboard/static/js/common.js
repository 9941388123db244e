// rlvitals dashboard: shared helpers. Loaded first and synchronously on every page, so it can start
// the page's data requests (and its live event stream) while the browser still parses plotly.js.
//
// Safety rule for every script here: data from the server (run names, tags, config, messages, metric
// names) is only ever written with textContent / createTextNode, or passed to plotly escaped with
// RLV.ptext. Never innerHTML with data.
(function () {
  "use strict";
  const RLV = (window.RLV = window.RLV || {});
  const KEY_STORAGE = "rlvitals.apiKey";
  RLV.timing = { start: performance.now() };

  // ---- API key (only needed when the server requires one) ----------------------------------------
  RLV.getKey = function () {
    try { return window.localStorage.getItem(KEY_STORAGE) || ""; } catch (e) { return ""; }
  };
  RLV.setKey = function (key) {
    try {
      if (key) window.localStorage.setItem(KEY_STORAGE, key);
      else window.localStorage.removeItem(KEY_STORAGE);
    } catch (e) { /* storage disabled: the key lasts for this page only */ }
  };

  // ---- JSON API ----------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }
  RLV.ApiError = ApiError;

  RLV.api = async function (path) {
    const headers = { Accept: "application/json" };
    const key = RLV.getKey();
    if (key) headers.Authorization = "Bearer " + key;
    const resp = await fetch(path, { headers: headers, credentials: "same-origin" });
    if (!resp.ok) {
      let err = {};
      try { err = ((await resp.json()) || {}).error || {}; } catch (e) { /* not our JSON */ }
      if (resp.status === 401 || resp.status === 403) RLV.askForKey(err.message || "this server needs an API key");
      throw new ApiError(resp.status, err.code || "http_" + resp.status, err.message || resp.statusText);
    }
    return resp.json();
  };

  // A value as the API sends it: a number, null, or "NaN" / "Infinity" / "-Infinity".
  RLV.num = function (v) {
    if (typeof v === "number") return v;
    if (v === null || v === undefined) return null;
    if (v === "NaN") return NaN;
    if (v === "Infinity") return Infinity;
    if (v === "-Infinity") return -Infinity;
    const n = Number(v);
    return Number.isNaN(n) ? null : n;
  };

  // ---- DOM helpers (text only) -------------------------------------------------------------------
  // el("td", {className: "num", text: v, title: t, href: "/runs/1", dataset: {...}}, child, "text", …)
  RLV.el = function (tag, props) {
    const node = document.createElement(tag);
    const p = props || {};
    for (const k of Object.keys(p)) {
      const v = p[k];
      if (v === undefined || v === null) continue;
      if (k === "text") node.textContent = String(v);
      else if (k === "className") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k === "href") node.setAttribute("href", RLV.safeHref(v));
      else if (k === "title") node.title = String(v);
      else if (k === "type" || k === "value" || k === "checked" || k === "hidden") node[k] = v;
      else throw new Error("RLV.el: unsupported property " + k);
    }
    for (let i = 2; i < arguments.length; i++) {
      const c = arguments[i];
      if (c === null || c === undefined || c === false) continue;
      node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  };
  // Links are only ever built to our own pages.
  RLV.safeHref = function (href) {
    const s = String(href);
    return s.charAt(0) === "/" && s.charAt(1) !== "/" && s.charAt(1) !== "\\" ? s : "#";
  };
  RLV.clear = function (node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  };
  RLV.$ = function (id) { return document.getElementById(id); };

  // plotly renders a small HTML subset in trace names and annotations; entities show as literal text.
  RLV.ptext = function (s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  };

  RLV.fmtNum = function (v) {
    const n = RLV.num(v);
    if (n === null) return "–";
    if (Number.isNaN(n)) return "NaN";
    if (!Number.isFinite(n)) return n > 0 ? "+inf" : "-inf";
    if (Number.isInteger(n) && Math.abs(n) < 1e15) return String(n);
    const a = Math.abs(n);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return n.toExponential(3);
    return String(Number(n.toPrecision(5)));
  };
  RLV.fmtAgo = function (unixSeconds) {
    if (typeof unixSeconds !== "number") return "";
    const s = Math.max(0, Date.now() / 1000 - unixSeconds);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return Math.round(s / 3600) + " h ago";
    return Math.round(s / 86400) + " d ago";
  };

  RLV.badge = function (status) {
    const s = ["healthy", "warning", "critical"].indexOf(status) >= 0 ? status : "unknown";
    return RLV.el("span", { className: "badge " + s, text: s });
  };
  RLV.setBadge = function (node, status) {
    const s = ["healthy", "warning", "critical"].indexOf(status) >= 0 ? status : "unknown";
    node.className = "badge " + s;
    node.textContent = s;
  };
  RLV.SEVERITY_RANK = { critical: 2, warning: 1, info: 0, healthy: 0 }; // info never changes a run's status

  // An audit's verdict: true (every reported metric matches), false (a mismatch), null (not done).
  RLV.auditOk = function (a) {
    if (a.status !== "done") return null;
    if (typeof a.ok === "boolean") return a.ok;
    const v = a.verdicts || {};
    return Object.keys(v).every(function (k) { return v[k] && v[k].ok === true; });
  };

  RLV.showError = function (message) {
    const bar = RLV.$("errorbar");
    if (!bar) return;
    if (!message) { bar.hidden = true; return; }
    bar.textContent = String(message);
    bar.hidden = false;
  };
  RLV.fail = function (err) {
    RLV.showError(err && err.message ? err.message : String(err));
    if (window.console) console.warn("rlvitals:", err); // eslint-disable-line no-console
  };

  RLV.askForKey = function (message) {
    const bar = RLV.$("keybar");
    if (!bar) return;
    bar.hidden = false;
    RLV.$("key-message").textContent = message || "";
  };

  // The run id from /runs/{id}[/audits].
  RLV.runIdFromPath = function () {
    const m = /^\/runs\/([^/]+)/.exec(window.location.pathname);
    return m ? decodeURIComponent(m[1]) : null;
  };
  RLV.runPath = function (id) { return "/runs/" + encodeURIComponent(id); };
  RLV.apiRun = function (id) { return "/api/v1/runs/" + encodeURIComponent(id); };
  // Metric series from API v1 (GET /api/v1/runs/{id}/metrics), with wall_time and a step range
  // (start/end) for zooming; answers carry an ETag, so the browser's cache revalidates them.
  RLV.seriesUrl = function (id, params) {
    const q = [];
    for (const k of Object.keys(params)) {
      const v = params[k];
      if (v === undefined || v === null) continue;
      q.push(k + "=" + (Array.isArray(v) ? v.map(encodeURIComponent).join(",") : encodeURIComponent(v)));
    }
    q.push("wall_time=true");
    return RLV.apiRun(id) + "/metrics?" + q.join("&");
  };

  // Points per series the server should send for an overview: about two per horizontal pixel of a
  // panel (the server keeps each bucket's minimum and maximum).
  RLV.overviewPoints = function () {
    return Math.max(400, Math.min(2000, Math.round(window.innerWidth || 1200)));
  };

  // Load a script (same origin, so the CSP allows it) once; resolves when it has run.
  const loading = new Map();
  RLV.loadScript = function (src) {
    if (!loading.has(src)) {
      loading.set(src, new Promise(function (resolve, reject) {
        const s = document.createElement("script");
        s.src = RLV.safeHref(src);
        s.onload = resolve;
        s.onerror = function () { reject(new Error("could not load " + src)); };
        document.head.appendChild(s);
      }));
    }
    return loading.get(src);
  };

  // ---- live events -------------------------------------------------------------------------------
  // RLV.stream(runId, onEvent(type, data), onState("open"|"reconnecting")) -> {close()}.
  // EventSource when no key is set; with a key, fetch() streaming so the Authorization header travels.
  RLV.stream = function (runId, onEvent, onState) {
    const url = RLV.apiRun(runId) + "/events";
    const types = ["points", "alert", "audit", "incident"];
    let closed = false;
    let everOpen = false;
    let retry = 500;
    let es = null;
    let abort = null;

    function opened() {
      retry = 500;
      onState(everOpen ? "reopen" : "open");
      everOpen = true;
    }
    function dispatch(type, raw) {
      if (types.indexOf(type) < 0) return;
      let data;
      try { data = JSON.parse(raw); } catch (e) { return; }
      onEvent(type, data);
    }
    function later() {
      if (closed) return;
      onState("reconnecting");
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 10000);
    }
    function connectEventSource() {
      es = new EventSource(url);
      es.onopen = opened;
      for (const t of types) es.addEventListener(t, function (e) { dispatch(t, e.data); });
      es.onerror = function () {
        if (closed) return;
        if (es.readyState === EventSource.CLOSED) later(); // the browser gave up; we do not
        else onState("reconnecting");
      };
    }
    async function connectFetch(key) {
      abort = new AbortController();
      try {
        const resp = await fetch(url, {
          headers: { Accept: "text/event-stream", Authorization: "Bearer " + key },
          signal: abort.signal,
        });
        if (!resp.ok || !resp.body) throw new Error("events: HTTP " + resp.status);
        opened();
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        for (;;) {
          const chunk = await reader.read();
          if (chunk.done) break;
          buf += decoder.decode(chunk.value, { stream: true }).replace(/\r\n?/g, "\n");
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            let type = "message";
            const data = [];
            for (const line of block.split("\n")) {
              if (line.startsWith("event:")) type = line.slice(6).trim();
              else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
            }
            if (data.length) dispatch(type, data.join("\n"));
          }
        }
      } catch (e) {
        if (closed) return;
      }
      later();
    }
    function connect() {
      if (closed) return;
      const key = RLV.getKey();
      if (key) connectFetch(key);
      else connectEventSource();
    }
    connect();
    return {
      close: function () {
        closed = true;
        if (es) es.close();
        if (abort) abort.abort();
      },
    };
  };

  // A queue in front of a stream: events that arrive before the page is ready to draw wait here.
  RLV.eventQueue = function () {
    const q = { pending: [], handler: null };
    q.push = function (type, data) {
      if (q.handler) q.handler(type, data);
      else q.pending.push([type, data]);
    };
    q.attach = function (handler) {
      q.handler = handler;
      const pending = q.pending;
      q.pending = [];
      for (const item of pending) handler(item[0], item[1]);
    };
    return q;
  };

  // The stream opens from <head> (see the prefetch below) and may open before the parser reaches
  // the header's badge: keep the latest state and draw it once the badge exists.
  let liveState = null;
  RLV.setLive = function (state) {
    liveState = state;
    const live = RLV.$("live");
    if (!live) return; // DOMContentLoaded draws liveState
    live.hidden = false;
    live.className = "live " + (state === "open" || state === "reopen" ? "on" : "off");
    live.textContent = state === "open" || state === "reopen" ? "live" : "reconnecting…";
  };

  // ---- prefetch: start the page's requests now, before plotly.js is parsed -----------------------
  RLV.pre = {};
  const script = document.currentScript;
  const mode = script && script.dataset ? script.dataset.prefetch : "";
  function guard(p) {
    p.catch(function () { /* each page reports its own errors when it awaits the promise */ });
    return p;
  }
  if (mode === "run") {
    const id = RLV.runIdFromPath();
    const base = RLV.apiRun(id);
    RLV.pre.runId = id;
    RLV.pre.maxPoints = RLV.overviewPoints();
    RLV.pre.run = guard(RLV.api(base));
    // Two requests: the first panel's metric alone (preloaded by the page itself: the aliases of the
    // first health signal; it comes back fast even for a long run), and every series.
    const firstLink = document.getElementById("first-series");
    RLV.pre.firstMetrics = firstLink
      // (with a key, a URL of its own: the preload went without the Authorization header)
      ? guard(RLV.api(firstLink.getAttribute("href") + (RLV.getKey() ? "&keyed=1" : "")).then(function (body) {
        RLV.timing.firstFetched = performance.now();
        return body;
      }))
      : Promise.resolve({ series: {} });
    // then the run's metric names (the page fetches the rest of the series a few at a time); it
    // waits for the first: on a busy server they would only slow each other down
    RLV.pre.names = guard(
      RLV.pre.firstMetrics.catch(function () { return null; }).then(function () {
        return RLV.api(RLV.apiRun(id) + "/metric-names");
      })
    );
    RLV.pre.alerts = guard(RLV.api(base + "/alerts"));
    RLV.pre.incidents = guard(RLV.api(base + "/incidents"));
    RLV.pre.events = RLV.eventQueue();
    RLV.pre.stream = RLV.stream(id, RLV.pre.events.push, function (state) {
      RLV.setLive(state);
      RLV.pre.events.push("_state", state);
    });
  } else if (mode === "audits") {
    const id = RLV.runIdFromPath();
    RLV.pre.runId = id;
    RLV.pre.run = guard(RLV.api(RLV.apiRun(id)));
    RLV.pre.audits = guard(RLV.api(RLV.apiRun(id) + "/audits"));
  } else if (mode === "runs" || mode === "compare") {
    RLV.pre.runs = guard(RLV.api("/api/v1/runs"));
  } else if (mode === "alerts") {
    RLV.pre.runs = guard(RLV.api("/api/v1/runs"));
  }

  // ---- page chrome ---------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", function () {
    const page = document.body.dataset.page;
    if (liveState) RLV.setLive(liveState);
    for (const a of document.querySelectorAll("[data-nav]")) {
      if (a.dataset.nav === page || (page === "run" && a.dataset.nav === "runs")) a.classList.add("on");
    }
    const bar = RLV.$("keybar");
    const input = RLV.$("key-input");
    RLV.$("key-button").addEventListener("click", function () {
      bar.hidden = !bar.hidden;
      RLV.$("key-message").textContent = RLV.getKey() ? "a key is saved in this browser" : "";
    });
    bar.addEventListener("submit", function (e) {
      e.preventDefault();
      RLV.setKey(input.value.trim());
      window.location.reload();
    });
    RLV.$("key-clear").addEventListener("click", function () {
      RLV.setKey("");
      window.location.reload();
    });
  });
})();

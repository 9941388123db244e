// rlvitals dashboard: alerts across all runs, firing or resolved, with advice and a link to the step.
(function () {
  "use strict";
  const RLV = window.RLV;
  const REFRESH_MS = 5000;
  const params = new URLSearchParams(window.location.search);
  let stateFilter = params.has("state") ? params.get("state") : "firing";
  let runNames = new Map();

  function setTab() {
    for (const b of document.querySelectorAll("#state-tabs button")) b.classList.toggle("on", b.dataset.state === stateFilter);
  }

  function render(alerts) {
    alerts.sort(function (a, b) {
      if (a.state !== b.state) return a.state === "firing" ? -1 : 1;
      const d = (RLV.SEVERITY_RANK[b.severity] || 0) - (RLV.SEVERITY_RANK[a.severity] || 0);
      return d || (b.last_step || 0) - (a.last_step || 0);
    });
    const tbody = RLV.clear(RLV.$("alerts-body"));
    for (const a of alerts) {
      const runHref = RLV.runPath(a.run_id);
      const name = runNames.has(String(a.run_id)) ? runNames.get(String(a.run_id)) : "run " + a.run_id;
      const steps = a.first_step === a.last_step ? String(a.first_step) : a.first_step + "–" + a.last_step;
      tbody.appendChild(RLV.el("tr", { dataset: { alertId: String(a.id), state: a.state } },
        RLV.el("td", {}, RLV.el("span", { className: "chip " + a.severity, text: a.severity })),
        RLV.el("td", {}, RLV.el("span", { className: "badge " + (a.state === "firing" ? "firing" : "resolved"), text: a.state })),
        RLV.el("td", {}, RLV.el("a", { className: "run-name", href: runHref, text: name })),
        RLV.el("td", {}, RLV.el("code", { text: a.rule })),
        RLV.el("td", { className: "num", text: steps }),
        RLV.el("td", { className: "num", text: RLV.fmtNum(a.value) }),
        RLV.el("td", {}, a.message || "", RLV.el("span", { className: "advice", text: a.advice || "" })),
        RLV.el("td", {}, RLV.el("a", { className: "step-link", href: runHref + "?step=" + encodeURIComponent(a.first_step), text: "show on chart" }))));
    }
    RLV.$("alerts-empty").hidden = alerts.length > 0;
    RLV.$("alerts-count").textContent = alerts.length + (stateFilter ? " " + stateFilter : "") + " alert" + (alerts.length === 1 ? "" : "s");
  }

  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const q = stateFilter ? "?state=" + encodeURIComponent(stateFilter) : "";
      const body = await RLV.api("/api/v1/alerts" + q);
      render(body.data || []);
      RLV.showError("");
      RLV.timing.rendered = performance.now();
    } catch (err) { RLV.fail(err); }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  for (const b of document.querySelectorAll("#state-tabs button")) {
    b.addEventListener("click", function () {
      stateFilter = b.dataset.state;
      const u = new URLSearchParams();
      if (stateFilter !== "firing") u.set("state", stateFilter);
      window.history.replaceState(null, "", u.toString() ? "?" + u : window.location.pathname);
      setTab();
      refresh();
    });
  }
  setTab();
  RLV.pre.runs.then(function (body) {
    runNames = new Map((body.data || []).map(function (r) { return [String(r.id), r.name]; }));
  }, RLV.fail).then(refresh);
})();

// rlvitals dashboard: the run page's panels in collapsible sections, as W&B, TensorBoard and trackio
// group them: the health signals first (whatever their trainer calls them), then one section per name
// prefix ("actor/…", "critic/…", "response_length/…"), names without one last under "other".
(function () {
  "use strict";
  const RLV = window.RLV;
  const C = RLV.charts;
  const S = (RLV.sections = {});
  S.HEALTH = "health";
  S.OTHER = "other";
  const TITLES = { health: "Health signals", other: "other" };

  // The section a metric's panel belongs to.
  S.keyOf = function (name) {
    if (C.signalOf(name)) return S.HEALTH;
    const n = String(name);
    const i = n.indexOf("/");
    return i > 0 ? n.slice(0, i) : S.OTHER;
  };
  // Sections in page order: health first, "other" last, the prefixes by name between.
  S.rank = function (key) { return key === S.HEALTH ? "0" : key === S.OTHER ? "2" : "1" + key; };

  // container: the element the sections live in; onOpen(body) runs when a closed section is opened (its
  // charts were drawn hidden and must be resized to the width they now have).
  S.create = function (container, onOpen) {
    const byKey = new Map(); // key -> {node, body, count}
    function ensure(key) {
      let sec = byKey.get(key);
      if (sec) return sec;
      const count = RLV.el("span", { className: "muted section-count" });
      const summary = RLV.el("summary", {}, RLV.el("h2", { text: TITLES[key] || key }), " ", count);
      const body = RLV.el("div", { className: "panels" });
      const node = RLV.el("details", { className: "section", dataset: { section: key } }, summary, body);
      node.open = true;
      node.addEventListener("toggle", function () { if (node.open && onOpen) onOpen(body); });
      const later = Array.from(byKey.keys()).filter(function (k) { return S.rank(k) > S.rank(key); })
        .sort(function (a, b) { return S.rank(a) < S.rank(b) ? -1 : 1; });
      container.insertBefore(node, later.length ? byKey.get(later[0]).node : null);
      sec = { key: key, node: node, body: body, count: count };
      byKey.set(key, sec);
      return sec;
    }
    // Put a panel's node in its section, before `next` (the following panel of the same section) or last.
    function place(name, node, nextOf) {
      const sec = ensure(S.keyOf(name));
      const next = nextOf(sec.key);
      sec.body.insertBefore(node, next && next.parentNode === sec.body ? next : null);
      const n = sec.body.children.length;
      sec.count.textContent = n + (n === 1 ? " panel" : " panels");
      return sec;
    }
    return { ensure: ensure, place: place, sections: byKey };
  };
})();

// The alerts banner: the alerts on now (GET /v1/cache/stats `alerts`, raised from the
// diagnosis by proxy/cache_api/alerts.py), each with its message and its fix: the setting
// as TOML to paste where a setting fixes it, else the fix's words. Hidden while none is on.
"use strict";

const Alerts = (() => {
  const { $, el, clock, toml } = Dash;

  function render(s) {
    const alerts = Array.isArray(s.alerts) ? s.alerts : [];
    $("alerts").hidden = alerts.length === 0;
    $("alerts-list").replaceChildren(...alerts.map(alertItem));
  }

  function alertItem(a) {
    const li = el("li");
    li.dataset.key = a.key;
    const since = el("span", `since ${clock(a.since)}`, "since");
    since.title = new Date(a.since * 1000).toLocaleString();
    const head = el("div", null, "head");
    head.append(el("span", `⚠ ${a.message}`, "message"), since);
    li.append(head);
    const fix = a.fix || {};
    if (fix.key) li.append(el("code", `${fix.key} = ${toml(fix.value)}`, "setting"));
    else if (fix.text) li.append(el("div", fix.text, "fix"));
    return li;
  }

  return { render };
})();

// The "Lost tokens" card: the prompt tokens computed again in the server's window
// (GET /v1/cache/diagnosis), by cause, most first, each with its share and its fix. The
// headline is what the cache could have given: every cause but new content.
"use strict";

const LostTokens = (() => {
  const { $, el, count, pct, toml, showNote, problem } = Dash;
  const CAUSES = {
    new_content: "new content",
    evicted: "evicted from RAM",
    evicted_ssd: "evicted from SSD",
    expired: "expired",
    client_rewrote: "client rewrote earlier messages",
    template_dropped_reasoning: "template dropped earlier reasoning",
    template_changed: "template changed",
    checkpoint_spacing: "checkpoint spacing",
    other_tenant_or_model: "another tenant's or model's",
    tier_fault: "SSD or shared tier late or down",
    bypass: "bypass",
    unexplained: "unexplained",
  };

  function within(s) {
    if (s === 3600) return "last hour";
    if (s % 3600 === 0) return `last ${s / 3600} h`;
    return s % 60 === 0 ? `last ${s / 60} min` : `last ${s} s`;
  }

  function render(res) {
    const list = $("lost-causes");
    if (res.status !== 200) {
      showNote("lost-note", problem(res, "/v1/cache/diagnosis"));
      $("lost").textContent = "–";
      $("lost-window").textContent = $("lost-detail").textContent = "";
      list.replaceChildren();
      return;
    }
    showNote("lost-note", "");
    const d = res.body;
    const causes = d.causes || [];
    const fresh = causes.filter((c) => c.cause === "new_content").reduce((a, c) => a + c.tokens, 0);
    $("lost-window").textContent = `(${within(d.window_s)})`;
    $("lost").textContent = d.requests ? count(d.computed_tokens - fresh) : "–";
    $("lost-detail").textContent = d.requests
      ? `of ${count(d.computed_tokens)} prompt tokens computed (${count(fresh)} new) ` +
        `in ${count(d.requests)} requests; ${pct(d.hit_ratio)} came from the cache`
      : "no requests in this window";
    list.replaceChildren(...causes.map(causeItem));
  }

  function causeItem(c) {
    const li = el("li", null, c.actionable ? "" : "quiet");
    li.dataset.cause = c.cause;
    const head = el("div", null, "head");
    head.append(
      el("span", CAUSES[c.cause] || c.cause, "name"),
      el("span", `${count(c.tokens)} tokens`, "tokens"),
      el("span", pct(c.share), "share"),
    );
    const bar = document.createElement("meter");
    bar.min = 0;
    bar.max = 1;
    bar.value = c.share;
    li.append(head, bar);
    const fix = c.fix || {};
    if (fix.text) li.append(el("div", fix.text, "fix"));
    if (fix.key) li.append(el("code", `${fix.key} = ${toml(fix.value)}`, "setting"));
    return li;
  }

  return { render };
})();

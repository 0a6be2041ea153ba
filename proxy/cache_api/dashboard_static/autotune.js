// The "Autotune" card (GET /v1/cache/stats `autotune`, engine_bridge/ops/autotune.py): the
// RAM budget the tuner set, between the configured budget and `ram_max`; protect_frequent
// against its ceiling; whether periodic checkpoints are kept, and how far apart; the evicted entries that came
// back (what moves the budget); and its last changes, newest first, each with its reason.
"use strict";

const Autotune = (() => {
  const { $, el, bytes, count, ago, clock, toml } = Dash;
  const CHANGES_SHOWN = 10;
  const BUDGET = "cache.ram.budget";

  // A setting's value as the card writes it: the budget as a size, the others as TOML.
  const value = (setting, v) => (setting === BUDGET ? bytes(v) : toml(v));

  function render(s) {
    const a = s.autotune;
    $("autotune-card").hidden = a == null; // a server from before the tuner says nothing
    if (a == null) return;
    $("autotune").textContent = a.enabled ? "on" : "off";
    $("autotune-settings").hidden = !a.enabled;
    if (!a.enabled) {
      $("autotune-detail").textContent = "fixed settings ([autotune] enabled = false)";
      $("autotune-changes").replaceChildren();
      return;
    }
    const b = a.bounds;
    gauge("budget", a.ram_budget_bytes, b.ram_min_bytes, b.ram_max_bytes,
      `${bytes(a.ram_budget_bytes)} (bounds ${bytes(b.ram_min_bytes)} – ${bytes(b.ram_max_bytes)})`);
    gauge("protect", a.protect_frequent, 0, b.protect_frequent_max,
      `${toml(a.protect_frequent)} (0 – ${toml(b.protect_frequent_max)})`);
    $("autotune-periodic").textContent = toml(a.keep_periodic);
    // null on a model split across ranks, whose interval is not tuned
    $("autotune-interval").textContent = a.checkpoint_interval == null
      ? "fixed (split across ranks)"
      : `${count(a.checkpoint_interval)} tokens (least ${count(b.checkpoint_interval_min)})`;
    const g = a.ghost_hits;
    $("autotune-ghosts").textContent =
      `${bytes(g.came_back_bytes)}: ${count(g.frequent)} entries read before, ${count(g.recent)} never read`;
    const changes = a.changes || [];
    const last = changes[changes.length - 1];
    $("autotune-detail").textContent = last
      ? `tuned by load; last change ${ago(last.time)}`
      : "tuned by load; no change yet";
    $("autotune-changes").replaceChildren(...changes.slice(-CHANGES_SHOWN).reverse().map(changeItem));
  }

  // A bar from `low` to `high`; the tuner's bounds are the meter's.
  function gauge(name, now, low, high, text) {
    const meter = $(`autotune-${name}-meter`);
    meter.min = low;
    meter.max = high;
    meter.value = now;
    $(`autotune-${name}`).textContent = text;
  }

  function changeItem(c) {
    const li = el("li");
    li.dataset.setting = c.setting;
    li.dataset.time = c.time;
    const when = el("span", clock(c.time), "when");
    when.title = new Date(c.time * 1000).toLocaleString();
    const head = el("div", null, "head");
    head.append(
      when,
      el("span", c.setting, "setting"),
      el("span", `${value(c.setting, c.from)} → ${value(c.setting, c.to)}`, "change"),
    );
    li.append(head, el("div", c.reason, "why"));
    return li;
  }

  return { render };
})();

// The cache dashboard: polls the /v1/cache/* routes every 2 s and keeps the history for
// its charts in this page. Plain DOM, no framework; every server string goes in through
// textContent, since session ids and prompt snippets are whatever clients sent. The
// helpers are format.js's; the Lost tokens card is lost.js's, the Autotune card
// autotune.js's and the banner of alerts on now alerts.js's.
"use strict";

(() => {
  const POLL_MS = 2000;
  const HISTORY_S = 60 * 60; // chart points older than an hour are dropped
  const RECENT_LIMIT = 100;
  const TABLE_ROWS = 50;
  const ALERT_WINDOW = 20; // the alert's window: the last 20 cacheable requests
  const KEY_STORE = "mlx-prompt-cache.api-key";
  const CONFIRM_MS = 4000;
  const FLASH_MS = 10000; // how long the outcome of a button stays up
  const REASONS = {
    hit: "hit",
    new_session: "new session",
    evicted_ram: "evicted from RAM",
    evicted_ssd: "evicted from SSD",
    expired: "expired",
    history_edited: "history edited",
    system_or_tools_changed: "system or tools changed",
    template_changed: "template changed",
    history_rewritten: "history rewritten by the template",
    bypass: "bypass",
    partial: "partial hit",
    tier_late: "SSD or shared tier too slow",
  };

  const { $, el, bytes, pct, count, seconds, ago, clock, showNote, problem } = Dash;
  const hitHistory = { t: [], overall: [], recent: [] };
  const seenRequests = new Map(); // request id -> {time, ttft_s, source}
  let hitChart = null;
  let ttftChart = null;
  let armed = null; // {id, until}: a Delete clicked once, waiting for its confirmation
  let sessionsKey = "";
  let lastSessions = [];
  let inflight = null; // the poll under way, so a button's refresh waits for it

  // ---------------------------------------------------------------------------------
  // Talking to the server (same origin; the key, when there is one, as a bearer token)

  function authHeaders() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  async function call(method, path) {
    let r;
    try {
      r = await fetch(path, { method, headers: authHeaders(), cache: "no-store" });
    } catch (e) {
      return { status: 0, body: null, error: String(e) };
    }
    let body = null;
    try {
      body = await r.json();
    } catch (_) {
      body = null;
    }
    return { status: r.status, body };
  }

  // ---------------------------------------------------------------------------------
  // Rendering

  function renderStatus(stats) {
    const status = $("status");
    if (stats.status === 200) {
      status.textContent = `updated ${clock(Date.now() / 1000)}`;
      status.className = "status";
    } else {
      status.textContent = problem(stats, "/v1/cache/stats");
      status.className = "status error";
    }
  }

  function renderKeyForm(results) {
    const refused = results.some((r) => r.status === 401);
    const stored = sessionStorage.getItem(KEY_STORE);
    $("keyform").hidden = !refused && !stored;
    $("forget").hidden = !stored;
    $("keynote").textContent = refused
      ? stored
        ? "The server refused this API key; enter one of [tenants] api_keys."
        : "This server wants an API key (one of [tenants] api_keys)."
      : "Using the API key kept for this tab.";
  }

  function renderAlert(stats, recent) {
    const alert = (stats.body && stats.body.alert) || (recent.body && recent.body.alert) || null;
    const banner = $("alert");
    banner.hidden = !alert;
    if (!alert) return;
    banner.textContent = `⚠ ${
      alert.message ||
      `hit ratio ${pct(alert.hit_ratio)} over the last ${alert.window} requests, ` +
        `below ${pct(alert.threshold)}`
    }`;
  }

  function renderCards(s) {
    const req = s.requests || {};
    $("hit-ratio").textContent = req.prompt_tokens === 0 ? "–" : pct(s.hit_ratio);
    $("hit-detail").textContent =
      req.prompt_tokens === 0
        ? "no prompt tokens through the cache yet"
        : req.prompt_tokens != null
          ? `${count(req.cached_tokens)} of ${count(req.prompt_tokens)} prompt tokens from cache`
          : "";
    $("requests").textContent = count(req.total != null ? req.total : s.requests);
    $("requests-detail").textContent = `${count(s.hits)} hits, ${count(s.misses)} misses` +
      (req.bypassed ? `, ${count(req.bypassed)} bypassed` : "");
    if (Array.isArray(s.models)) $("models").textContent = s.models.join(" · ");
    const sched = s.scheduler || {};
    $("spec").textContent = sched.decode_steps ? sched.tokens_per_step.toFixed(2) : "–";
    $("spec-detail").textContent = sched.spec_drafted
      ? `speculative: ${count(sched.spec_accepted)} of ${count(sched.spec_drafted)} drafts ` +
        `kept (${pct(sched.spec_acceptance)})`
      : "no speculative drafts yet";
    const warm = s.warm_ahead || {};
    $("warmed").textContent = warm.enabled ? `${count(warm.tokens)} tokens` : "off";
    $("warmed-detail").textContent = warm.enabled
      ? `next questions' prefixes: ${count(warm.warmed)} warmed, ` +
        `${count(warm.already_cached)} already cached, ${count(warm.preempted)} preempted`
      : "[cache.warm_ahead] enabled = false";
    tier("ram", s.ram && s.ram.bytes, s.ram && s.ram.budget_bytes, "budget",
      s.ram ? `${count(s.ram.blocks)} blocks, ${count(s.ram.checkpoints)} checkpoints` : "");
    if (s.ssd) {
      const off = s.ssd.disabled ? ` · writes off: ${s.ssd.disabled_reason}` : "";
      tier("ssd", s.ssd.bytes, s.ssd.max_bytes, "max", `${count(s.ssd.entries)} files${off}`);
    } else {
      tier("ssd", null, null, "", "no SSD tier");
    }
    // A model split across ranks: what each rank's slices hold (RAM + SSD, live K/V).
    const ranks = Array.isArray(s.ranks) ? s.ranks : [];
    $("ranks-card").hidden = ranks.length === 0;
    if (ranks.length) {
      $("ranks").textContent = `${ranks.length} × ${ranks[0].layout.split(" ")[0]}`;
      $("ranks-detail").textContent = ranks.map((r) =>
        `rank ${r.rank}: ${bytes(r.ram_bytes)} RAM, ${bytes(r.ssd_bytes)} SSD, ` +
        `${bytes(r.kv_bytes)} K/V`).join(" · ");
    }
  }

  function tier(name, used, limit, word, detail) {
    $(name).textContent = used == null ? "off" : bytes(used);
    const meter = $(`${name}-meter`);
    meter.value = used != null && limit ? Math.min(1, used / limit) : 0;
    const of = used != null && limit ? `${pct(used / limit)} of ${bytes(limit)} ${word}` : "";
    $(`${name}-detail`).textContent = [of, detail].filter(Boolean).join(" · ");
  }

  // The recent token hit ratio over the alert's window, from the requests the server lists.
  function recentHitRatio(requests) {
    const cacheable = requests.filter((r) => r.reason !== "bypass").slice(0, ALERT_WINDOW);
    const prompt = cacheable.reduce((a, r) => a + (r.prompt_tokens || 0), 0);
    const hit = cacheable.reduce((a, r) => a + (r.hit_tokens || 0), 0);
    return prompt ? hit / prompt : null;
  }

  function recordHistory(stats, recent) {
    const now = Date.now() / 1000;
    const requests = recent.status === 200 ? recent.body.requests || [] : [];
    hitHistory.t.push(now);
    const seen = stats.status === 200 && (stats.body.requests || {}).prompt_tokens !== 0;
    hitHistory.overall.push(seen ? stats.body.hit_ratio : null);
    hitHistory.recent.push(recent.status === 200 ? recentHitRatio(requests) : null);
    while (hitHistory.t.length && hitHistory.t[0] < now - HISTORY_S) {
      hitHistory.t.shift();
      hitHistory.overall.shift();
      hitHistory.recent.shift();
    }
    for (const r of requests) {
      if (r.ttft_s != null && !seenRequests.has(r.id)) {
        seenRequests.set(r.id, { time: r.time, ttft_s: r.ttft_s, source: r.source });
      }
    }
    for (const [id, r] of seenRequests) {
      if (r.time < now - HISTORY_S) seenRequests.delete(id);
    }
  }

  function chartWidth(id) {
    return Math.max(300, $(id).clientWidth - 4);
  }

  function renderCharts(recent) {
    if (typeof uPlot === "undefined") return;
    if (!hitChart) {
      hitChart = new uPlot(
        {
          width: chartWidth("hit-chart"),
          height: 220,
          scales: { x: { time: true }, y: { range: [0, 1] } },
          axes: [{}, { size: 50, values: (u, vals) => vals.map((v) => `${Math.round(v * 100)}%`) }],
          series: [
            {},
            { label: "since start", stroke: "#3b6fd8", width: 2, value: (u, v) => pct(v) },
            {
              label: `last ${ALERT_WINDOW} requests`,
              stroke: "#e07a10",
              width: 2,
              spanGaps: true,
              value: (u, v) => pct(v),
            },
          ],
        },
        [[], [], []],
        $("hit-chart"),
      );
      const point = (stroke) => ({
        stroke,
        fill: stroke,
        width: 0,
        paths: () => null,
        points: { show: true, size: 7, fill: stroke },
        value: (u, v) => seconds(v),
      });
      ttftChart = new uPlot(
        {
          width: chartWidth("ttft-chart"),
          height: 220,
          scales: { x: { time: true } },
          axes: [{}, { size: 64, values: (u, vals) => vals.map((v) => seconds(v)) }],
          series: [
            {},
            { label: "from RAM", ...point("#1f9d55") },
            { label: "from SSD", ...point("#3b6fd8") },
            { label: "from shared store", ...point("#8a4fd8") },
            { label: "no hit", ...point("#c0641a") },
          ],
        },
        [[], [], [], [], []],
        $("ttft-chart"),
      );
    }
    hitChart.setData([hitHistory.t, hitHistory.overall, hitHistory.recent]);
    const points = [...seenRequests.values()].sort((a, b) => a.time - b.time);
    const column = (source) => points.map((p) => (p.source === source ? p.ttft_s : null));
    ttftChart.setData([
      points.map((p) => p.time),
      column("ram"),
      column("ssd"),
      column("shared"),
      points.map((p) => (["ram", "ssd", "shared"].includes(p.source) ? null : p.ttft_s)),
    ]);
    const missing = recent.status === 200 ? "" : problem(recent, "/v1/cache/requests");
    showNote("hit-note", missing && `Only the since-start line: ${missing}.`);
    showNote("ttft-note", missing ? `${missing}.` : points.length ? "" : "No requests yet.");
  }

  function renderSessions(res) {
    const body = $("sessions").tBodies[0];
    if (res.status !== 200) {
      showNote("sessions-note", problem(res, "/v1/cache/sessions"));
      $("sessions-count").textContent = "";
      body.replaceChildren();
      sessionsKey = "";
      return;
    }
    showNote("sessions-note", "");
    const sessions = res.body.sessions || [];
    lastSessions = sessions;
    $("sessions-count").textContent = `(${sessions.length})`;
    if (armed && Date.now() > armed.until) armed = null;
    const key = JSON.stringify([sessions, armed && armed.id]);
    if (key !== sessionsKey) {
      sessionsKey = key;
      body.replaceChildren(...(sessions.length ? sessions.map(sessionRow) : [emptyRow(10, "no cached sessions")]));
    }
    for (const cell of body.querySelectorAll("td[data-t]")) {
      cell.textContent = ago(Number(cell.dataset.t));
    }
  }

  function sessionRow(s) {
    const tr = document.createElement("tr");
    tr.dataset.id = s.id;
    const id = el("td", s.id, "id");
    id.title = s.id;
    const used = el("td", ago(s.last_used));
    used.dataset.t = s.last_used;
    used.title = new Date(s.last_used * 1000).toLocaleString();
    tr.append(
      id,
      el("td", s.tenant),
      el("td", s.model),
      used,
      el("td", count(s.tokens), "num"),
      el("td", bytes(s.ram_bytes), "num"),
      el("td", bytes(s.ssd_bytes), "num"),
      el("td", bytes(s.shared_bytes), "num"),
      el("td", s.pinned ? "pinned" : "", s.pinned ? "pinned" : ""),
    );
    const actions = el("td", null, "actions");
    const pin = el("button", s.pinned ? "Unpin" : "Pin");
    pin.dataset.action = s.pinned ? "unpin" : "pin";
    pin.dataset.id = s.id;
    const confirming = armed && armed.id === s.id;
    const del = el("button", confirming ? "Confirm delete" : "Delete", confirming ? "danger armed" : "danger");
    del.dataset.action = "delete";
    del.dataset.id = s.id;
    actions.append(pin, del);
    tr.append(actions);
    return tr;
  }

  function emptyRow(span, text) {
    const tr = document.createElement("tr");
    const td = el("td", text, "empty");
    td.colSpan = span;
    tr.append(td);
    return tr;
  }

  function renderRecent(res) {
    const body = $("recent").tBodies[0];
    if (res.status !== 200) {
      showNote("recent-note", problem(res, "/v1/cache/requests"));
      body.replaceChildren();
      return;
    }
    showNote("recent-note", "");
    const rows = (res.body.requests || []).slice(0, TABLE_ROWS).map(requestRow);
    body.replaceChildren(...(rows.length ? rows : [emptyRow(10, "no requests yet")]));
  }

  function requestRow(r) {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    const session = el("td", r.session, "id");
    session.title = r.session || "";
    const reason = el("td");
    const label = el("span", REASONS[r.reason] || r.reason, r.reason === "hit" ? "reason hit" : "reason");
    label.dataset.reason = r.reason;
    reason.append(label);
    tr.append(
      el("td", clock(r.time)),
      el("td", r.model),
      session,
      el("td", count(r.prompt_tokens), "num"),
      el("td", count(r.hit_tokens), "num"),
      el("td", r.source),
      el("td", seconds(r.ttft_s), "num"),
      el("td", r.prefill_tok_s == null ? "–" : count(Math.round(r.prefill_tok_s)), "num"),
      reason,
      divergence(r),
    );
    return tr;
  }

  function divergence(r) {
    const td = el("td", null, "diverged");
    if (r.diverged_at == null) {
      td.textContent = "–";
      return td;
    }
    const where = r.diverged_message != null ? ` (message ${r.diverged_message})` : "";
    td.append(el("span", `token ${count(r.diverged_at)}${where} `));
    if (r.before || r.after) {
      const code = el("code");
      code.append(el("span", r.before || ""), el("span", "", "cut"), el("span", r.after || ""));
      td.title = `up to token ${r.diverged_at}: …${r.before || ""}\nthen this prompt: ${r.after || ""}…`;
      td.append(code);
    }
    return td;
  }

  // ---------------------------------------------------------------------------------
  // The loop and the buttons

  function poll() {
    if (!inflight) inflight = pollOnce().finally(() => (inflight = null));
    return inflight;
  }

  async function pollOnce() {
    const [stats, sessions, recent, lost] = await Promise.all([
      call("GET", "/v1/cache/stats"),
      call("GET", "/v1/cache/sessions"),
      call("GET", `/v1/cache/requests?limit=${RECENT_LIMIT}`),
      call("GET", "/v1/cache/diagnosis"),
    ]);
    renderStatus(stats);
    renderKeyForm([stats, sessions, recent, lost]);
    if (stats.status === 200) {
      renderCards(stats.body);
      Autotune.render(stats.body);
      Alerts.render(stats.body);
    }
    renderAlert(stats, recent);
    recordHistory(stats, recent);
    renderCharts(recent);
    renderSessions(sessions);
    renderRecent(recent);
    LostTokens.render(lost);
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  }

  let flashTimer = null;
  function flash(text, error = false) {
    const note = $("flash");
    note.textContent = text;
    note.className = error ? "flash error" : "flash";
    clearTimeout(flashTimer);
    flashTimer = setTimeout(() => (note.textContent = ""), FLASH_MS);
  }

  async function sessionAction(button) {
    const { id, action } = button.dataset;
    if (action === "delete" && !(armed && armed.id === id && Date.now() < armed.until)) {
      armed = { id, until: Date.now() + CONFIRM_MS };
      renderSessions({ status: 200, body: { sessions: lastSessions } });
      return;
    }
    armed = null;
    const path = `/v1/cache/sessions/${encodeURIComponent(id)}${action === "delete" ? "" : `/${action}`}`;
    button.disabled = true;
    const res = await call(action === "delete" ? "DELETE" : "POST", path);
    if (res.status === 200) {
      flash(
        action === "delete"
          ? `deleted ${id} (${bytes(res.body.freed_bytes)} freed)`
          : `${id} ${res.body.pinned ? "pinned" : "unpinned"}`,
      );
    } else {
      flash(`${action} ${id}: ${problem(res, path)}`, true);
    }
    sessionsKey = "";
    if (inflight) await inflight;
    await poll();
  }

  function start() {
    $("sessions").addEventListener("click", (ev) => {
      const button = ev.target.closest("button[data-action]");
      if (button) sessionAction(button);
    });
    $("keyform").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("key").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      $("key").value = "";
      poll();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      poll();
    });
    window.addEventListener("resize", () => {
      if (hitChart) hitChart.setSize({ width: chartWidth("hit-chart"), height: 220 });
      if (ttftChart) ttftChart.setSize({ width: chartWidth("ttft-chart"), height: 220 });
    });
    poll();
    setInterval(poll, POLL_MS);
  }

  start();
})();

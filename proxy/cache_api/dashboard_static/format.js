// What the dashboard's scripts share: numbers, sizes and times as the page writes them, a
// setting's value as TOML, DOM helpers, and the words for a call that failed. Loaded first;
// the others read `Dash`. Every server string goes in through textContent.
"use strict";

const Dash = (() => {
  const $ = (id) => document.getElementById(id);

  function bytes(n) {
    if (n == null) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) {
      n /= 1000;
      i++;
    }
    return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
  }
  const pct = (r) => (r == null ? "–" : `${(r * 100).toFixed(r > 0 && r < 0.1 ? 1 : 0)}%`);
  const count = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  function seconds(s) {
    if (s == null) return "–";
    return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
  }
  function ago(t) {
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

  // A fix's value as TOML writes it inline (proxy/config/tomltext.inline), to paste.
  function toml(v) {
    if (typeof v === "string") return JSON.stringify(v).replace(/\x7f/g, "\\u007f");
    if (Array.isArray(v)) return `[${v.map(toml).join(", ")}]`;
    if (v !== null && typeof v === "object") {
      const key = (k) => (/^[A-Za-z0-9_-]+$/.test(k) ? k : toml(k));
      const items = Object.entries(v).map(([k, x]) => `${key(k)} = ${toml(x)}`);
      return items.length ? `{ ${items.join(", ")} }` : "{}";
    }
    return String(v);
  }

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text != null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function showNote(id, text) {
    const note = $(id);
    note.hidden = !text;
    note.textContent = text || "";
  }

  // A route this server does not have falls through to the upstream: a 404, or a 502 when
  // LM Studio is not running. Either way the panel says so instead of breaking the page.
  function problem(res, path) {
    if (res.status === 0) return `cannot reach the server (${res.error})`;
    let message = (res.body && res.body.error && res.body.error.message) || "";
    if (message.length > 160) message = `${message.slice(0, 157)}…`;
    const detail = `HTTP ${res.status}${message ? `: ${message}` : ""}`;
    if ([404, 405, 501, 502, 504].includes(res.status)) {
      return `${path} is not available on this server (${detail})`;
    }
    return `${path} failed (${detail})`;
  }

  return { $, el, bytes, pct, count, seconds, ago, clock, toml, showNote, problem };
})();

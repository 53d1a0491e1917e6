// collectives dashboard: renders /api/cluster (the collectives.v1.Cluster message
// as proto3 JSON: 64-bit integers arrive as strings, enums as their names).
// Live updates come from the server-sent events of /api/events; when that stream
// fails, the page polls /api/cluster until the stream works again.
// Every value is written with textContent: nothing from the server is parsed as HTML.
"use strict";

(function () {
  const POLL_MS = 2000;
  const RETRY_STREAM_MS = 15000;
  const STALE_MS = 10000;
  const MAX_ERRORS = 50;

  // ---- small helpers -------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null) continue;
      if (key === "className") node.className = value;
      else if (key === "title") node.title = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setText(id, text) {
    const node = document.getElementById(id);
    if (node && node.textContent !== String(text)) node.textContent = String(text);
  }

  function num(value) {
    const n = Number(value);
    return Number.isFinite(n) ? n : 0;
  }

  function bytes(value) {
    let n = num(value);
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0)} ${units[i]}`;
  }

  function duration(seconds) {
    let s = Math.max(0, Math.floor(num(seconds)));
    const d = Math.floor(s / 86400);
    s -= d * 86400;
    const h = Math.floor(s / 3600);
    s -= h * 3600;
    const m = Math.floor(s / 60);
    s -= m * 60;
    if (d) return `${d}d ${h}h`;
    if (h) return `${h}h ${m}m`;
    if (m) return `${m}m ${s}s`;
    return `${s}s`;
  }

  function latency(seconds) {
    const s = num(seconds);
    if (s <= 0) return "";
    if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
    if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`;
    return `${s.toFixed(2)} s`;
  }

  function clock(unixSeconds) {
    const t = num(unixSeconds);
    if (!t) return "";
    const d = new Date(t * 1000);
    const pad = (v, n = 2) => String(v).padStart(n, "0");
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function dateTime(unixSeconds) {
    const t = num(unixSeconds);
    return t ? new Date(t * 1000).toLocaleString() : "";
  }

  function stateName(value) {
    // "WORKER_STATE_READY" -> "ready"; a number (unknown to this page) -> "unknown".
    const text = String(value || "");
    return text.startsWith("WORKER_STATE_")
      ? text.slice("WORKER_STATE_".length).toLowerCase()
      : "unknown";
  }

  function replaceRows(tbodyId, rows, emptyText, columns) {
    const tbody = document.getElementById(tbodyId);
    if (!rows.length) rows = [el("tr", { className: "empty" }, el("td", { colspan: columns }, emptyText))];
    tbody.replaceChildren(...rows);
  }

  // ---- rendering -----------------------------------------------------------

  function renderSummary(c) {
    const workers = c.workers || [];
    setText("generation", num(c.generation));
    setText("world-size", num(c.world_size));
    setText("bounds", `min ${num(c.min_workers)} · max ${num(c.max_workers)} workers`);
    const formed = document.getElementById("formed");
    const ok = c.formed ? (c.ready ? "true" : "partial") : "false";
    formed.dataset.ok = ok;
    setText("formed", c.formed ? (c.ready ? "formed · ready" : "formed · joining") : "not formed");
    setText("version", `op timeout ${num(c.op_timeout_s)} s`);
    formed.title = `membership version ${c.version}`;
    setText("status-text", c.status || "");
    const counts = {};
    for (const w of workers) {
      const s = stateName(w.state);
      counts[s] = (counts[s] || 0) + 1;
    }
    const order = ["ready", "busy", "joining", "draining", "lost", "unknown"];
    const parts = order.filter((s) => counts[s]).map((s) => `${counts[s]} ${s}`);
    setText("counts", `${workers.length} workers listed${parts.length ? ": " + parts.join(", ") : ""}`);
  }

  function devicesCell(w) {
    const status = w.status || {};
    const devices = status.devices || [];
    if (!devices.length) {
      return el("td", {}, el("span", { className: "mono" }, (w.devices || []).join(", ")));
    }
    return el(
      "td",
      {},
      devices.map((d) => {
        const used = num(d.memory_used_bytes);
        const total = num(d.memory_total_bytes);
        const pct = total > 0 ? Math.min(100, (100 * used) / total) : 0;
        const fill = el("span");
        fill.style.width = `${pct.toFixed(1)}%`;
        return el(
          "div",
          { className: "device", title: `${d.device}: ${used} of ${total} bytes` },
          el("span", { className: "mono" }, d.device),
          " ",
          el("span", { className: "bar" }, fill),
          el("span", { className: "small" }, total > 0 ? `${bytes(used)} / ${bytes(total)}` : bytes(used)),
        );
      }),
    );
  }

  function opsCell(status) {
    const ops = status.ops || [];
    let done = 0;
    let failed = 0;
    for (const op of ops) {
      done += num(op.completed);
      failed += num(op.failed);
    }
    const detail = ops
      .filter((op) => num(op.completed) || num(op.failed))
      .map((op) => `${op.kind} ${num(op.completed)}${num(op.failed) ? "/" + num(op.failed) : ""}`);
    return el(
      "td",
      { className: "num", title: detail.join("\n") },
      el("span", {}, done),
      " / ",
      el("span", { className: failed ? "failed" : "" }, failed),
      detail.length ? el("div", { className: "small detail" }, detail.slice(0, 4).join(", ") + (detail.length > 4 ? ", …" : "")) : null,
    );
  }

  function versionsCell(w, status) {
    const lines = [];
    if (status.package_version || w.version) lines.push(`collectives ${status.package_version || w.version}`);
    if (status.torch_version) lines.push(`torch ${status.torch_version}`);
    const backend = [w.backend, status.backend_version].filter(Boolean).join(" ");
    if (backend) lines.push(backend);
    return el("td", { className: "small" }, lines.map((line) => el("div", {}, line)));
  }

  function workerRow(w) {
    const status = w.status || {};
    const state = stateName(w.state);
    const rank = num(w.rank);
    const models = status.models || [];
    const completed = (status.ops || []).reduce((sum, op) => sum + num(op.completed), 0);
    return el(
      "tr",
      {
        "data-worker-id": w.worker_id,
        "data-state": state,
        "data-rank": rank,
        "data-tensors-held": num(status.tensors_held),
        "data-ops-completed": completed,
      },
      el("td", { className: "num" }, rank >= 0 ? rank : "–"),
      el("td", {}, el("span", { className: `state state-${state}` }, state)),
      el(
        "td",
        { className: "wrap worker" },
        el("div", { className: "mono" }, w.address),
        el("div", { className: "small" }, `${w.hostname} · pid ${w.pid} · ${w.worker_id}`),
      ),
      devicesCell(w),
      el("td", { className: "num" }, duration(w.uptime_s)),
      el("td", { className: "num" }, `${num(w.last_heartbeat_age_s).toFixed(1)} s`),
      el(
        "td",
        { className: "num" },
        num(status.tensors_held),
        el("div", { className: "small" }, bytes(status.bytes_held)),
      ),
      el("td", { className: "small wrap" }, models.length ? models.join(", ") : "–"),
      opsCell(status),
      el(
        "td",
        { className: "wrap" },
        status.last_op || "–",
        status.last_op ? el("div", { className: "small" }, latency(status.last_op_latency_s)) : null,
      ),
      el("td", { className: "num" }, num(status.queue_depth)),
      el(
        "td",
        { className: "num small" },
        el("div", {}, `↓ ${bytes(status.bytes_received)}`),
        el("div", {}, `↑ ${bytes(status.bytes_sent)}`),
      ),
      versionsCell(w, status),
    );
  }

  function renderWorkers(c) {
    const rows = (c.workers || []).map(workerRow);
    replaceRows("worker-rows", rows, "no worker registered yet", 13);
  }

  function renderHistory(c) {
    const history = (c.history || []).slice().reverse(); // newest first
    const rows = history.map((g) =>
      el(
        "tr",
        { "data-generation": num(g.generation) },
        el("td", { className: "num" }, num(g.generation)),
        el("td", { title: dateTime(g.sealed_unix_time_s) }, clock(g.sealed_unix_time_s)),
        el("td", { className: "num" }, num(g.world_size)),
        el("td", { className: "mono wrap" }, (g.members || []).join(", ")),
        el("td", { className: "wrap" }, g.reason || ""),
      ),
    );
    replaceRows("history-rows", rows, "no generation sealed yet", 5);
  }

  function renderErrors(c) {
    const errors = [];
    for (const w of c.workers || []) {
      for (const e of (w.status || {}).recent_errors || []) {
        errors.push({ worker: w, error: e });
      }
    }
    errors.sort((a, b) => num(b.error.unix_time_s) - num(a.error.unix_time_s));
    const rows = errors.slice(0, MAX_ERRORS).map(({ worker, error }) =>
      el(
        "tr",
        { "data-worker-id": worker.worker_id },
        el("td", { title: dateTime(error.unix_time_s) }, clock(error.unix_time_s)),
        el("td", {}, num(worker.rank) >= 0 ? `rank ${num(worker.rank)}` : "–", el("div", { className: "small mono" }, worker.address)),
        el("td", {}, error.kind || "", el("div", { className: "small" }, `op ${error.op_id} · gen ${error.generation}`)),
        el("td", { className: "mono" }, error.code || ""),
        el("td", { className: "wrap" }, error.message || ""),
      ),
    );
    replaceRows("error-rows", rows, "no errors reported", 5);
  }

  let lastUpdate = 0;

  function render(c) {
    renderSummary(c);
    renderWorkers(c);
    renderHistory(c);
    renderErrors(c);
    lastUpdate = Date.now();
    document.body.dataset.version = String(c.version);
    setText("updated", `updated ${new Date(lastUpdate).toLocaleTimeString()}`);
  }

  // ---- transport: server-sent events, polling as the fallback -------------

  const connection = document.getElementById("connection");
  let pollTimer = null;
  let stream = null;

  function setMode(mode, text) {
    connection.dataset.mode = mode;
    setText("connection-text", text);
  }

  async function pollOnce() {
    try {
      const response = await fetch("api/cluster", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
      if (!stream || stream.readyState !== EventSource.OPEN) setMode("polling", "polling");
    } catch (err) {
      setMode("disconnected", `coordinator unreachable (${err.message})`);
    }
  }

  function startPolling() {
    if (pollTimer !== null) return;
    pollOnce();
    pollTimer = setInterval(pollOnce, POLL_MS);
  }

  function stopPolling() {
    if (pollTimer === null) return;
    clearInterval(pollTimer);
    pollTimer = null;
  }

  function openStream() {
    if (typeof EventSource === "undefined") {
      startPolling();
      return;
    }
    stream = new EventSource("api/events");
    stream.addEventListener("cluster", (event) => {
      stopPolling();
      setMode("live", "live");
      try {
        render(JSON.parse(event.data));
      } catch (err) {
        console.error("bad cluster event", err);
      }
    });
    stream.addEventListener("error", () => {
      // CONNECTING: the browser retries by itself; poll meanwhile.
      // CLOSED: the server refused the stream; poll, and try the stream again later.
      startPolling();
      if (stream.readyState === EventSource.CLOSED) {
        stream = null;
        setTimeout(openStream, RETRY_STREAM_MS);
      }
    });
  }

  setInterval(() => {
    if (lastUpdate && Date.now() - lastUpdate > STALE_MS) {
      setMode("disconnected", `no update for ${duration((Date.now() - lastUpdate) / 1000)}`);
    }
  }, 1000);

  openStream();
})();

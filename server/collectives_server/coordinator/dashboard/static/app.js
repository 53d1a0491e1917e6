// collectives dashboard: renders /api/cluster (the schema of `collectives status
// --json`: plain numbers, worker states as "ready", "lost", ...) and what
// model.js derives from the stream of snapshots (rates, timeline, failures):
// the workers, the ops by kind (the cluster's, and each worker's in its
// details), the failed ops aggregated by kind, code and message, the clients.
// Live updates come from the server-sent events of /api/events; when that stream
// fails, the page polls /api/cluster until the stream works again.
// Every value is written with textContent: nothing from the server is parsed as HTML.
"use strict";

(function () {
  const POLL_MS = 2000;
  const RETRY_STREAM_MS = 15000;
  const STALE_MS = 10000;
  const SVG = "http://www.w3.org/2000/svg";
  const { ClusterModel, groupFailures, kindRows, newestModelVersions, workerModels, clock, dateTime, zone, num,
    opTimeline, stuckWorkers } = window.CollectivesModel;
  const TIMELINE_OPS = 30; // the last ops the op timeline draws
  const MODELS_SHOWN = 2; // in a worker's row; the details list every one
  const COLUMNS = 11; // of the workers table
  const model = new ClusterModel();
  const expanded = new Set(); // worker ids whose details are open

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
    if (s <= 0) return "–";
    if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
    if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`;
    return `${s.toFixed(2)} s`;
  }

  function rateText(rate) {
    if (rate === null || rate === undefined) return "–";
    return rate >= 100 ? rate.toFixed(0) : rate >= 10 ? rate.toFixed(1) : rate.toFixed(2);
  }

  function sparkline(values, width = 64, height = 18) {
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("preserveAspectRatio", "none"); // stretches to the width CSS gives it
    svg.setAttribute("aria-hidden", "true");
    if (values.length >= 2) {
      const max = Math.max(...values, 1e-9);
      const step = width / (values.length - 1);
      const points = values.map((v, i) => `${(i * step).toFixed(1)},${(height - 1 - (v / max) * (height - 2)).toFixed(1)}`);
      const area = document.createElementNS(SVG, "polygon");
      area.setAttribute("points", `0,${height} ${points.join(" ")} ${width},${height}`);
      area.setAttribute("class", "spark-area");
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", points.join(" "));
      line.setAttribute("class", "spark-line");
      svg.append(area, line);
    }
    return svg;
  }

  function replaceRows(tbodyId, rows, emptyText, columns) {
    const tbody = document.getElementById(tbodyId);
    if (!rows.length) rows = [el("tr", { className: "empty" }, el("td", { colspan: columns }, emptyText))];
    tbody.replaceChildren(...rows);
  }

  // ---- summary -------------------------------------------------------------

  function renderSummary(c) {
    const workers = c.workers || [];
    setText("generation", num(c.generation));
    setText("world-size", num(c.world_size));
    setText("bounds", `min ${num(c.min_workers)} · max ${num(c.max_workers)} workers`);
    const formed = document.getElementById("formed");
    formed.dataset.ok = c.formed ? (c.ready ? "true" : "partial") : "false";
    setText("formed", c.formed ? (c.ready ? "formed · ready" : "formed · joining") : "not formed");
    // An HA set on etcd: which coordinator leads (none during a failover).
    const lead = c.store === "etcd" ? ` · leader ${c.coordinator_leader || "none (electing)"}` : "";
    setText("version", `op timeout ${num(c.op_timeout_s)} s${lead}`);
    formed.dataset.leader = c.coordinator_leader || "";
    formed.title = `membership version ${c.version}`;
    setText("status-text", c.status || "");
    const counts = {};
    for (const w of workers) counts[w.state] = (counts[w.state] || 0) + 1;
    const order = ["ready", "busy", "joining", "spare", "draining", "lost"];
    const parts = order.filter((s) => counts[s]).map((s) => `${counts[s]} ${s}`);
    setText("counts", `${workers.length} workers listed${parts.length ? ": " + parts.join(", ") : ""}`);
    renderDrain(c);
    setText("cluster-rate", rateText(model.clusterRate()));
    document.getElementById("cluster-spark").replaceChildren(sparkline(model.clusterRates, 90, 24));
  }

  // A drain in progress: who hands its rank to whom, and the bytes copied of the total.
  function renderDrain(c) {
    const box = document.getElementById("drain");
    const d = c.drain;
    box.hidden = !d;
    if (!d) return;
    const total = num(d.total_bytes);
    const copied = num(d.bytes_copied);
    const onto = d.successor ? `onto ${d.successor_id}` : "shrinking";
    const doing = d.preparing ? `preparing generation ${num(d.generation_after)}, ` : "";
    setText("drain-text", `draining ${d.worker_id} (rank ${num(d.rank)}) ${onto}: ${doing}` +
      `${bytes(copied)} of ${bytes(total)} copied`);
    const pct = total > 0 ? Math.min(100, (100 * copied) / total) : 0;
    document.getElementById("drain-bar").style.width = `${pct.toFixed(1)}%`;
  }

  // ---- workers: a row of what matters, details on a click ------------------

  function memoryCell(w) {
    const dev = (w.device_memory || [])[0];
    if (!dev) return el("td", { className: "small" }, w.process_rss_bytes ? `RSS ${bytes(w.process_rss_bytes)}` : "–");
    const used = num(dev.used_bytes);
    const total = num(dev.total_bytes);
    const pct = total > 0 ? Math.min(100, (100 * used) / total) : 0;
    const fill = el("span");
    fill.style.width = `${pct.toFixed(1)}%`;
    const more = (w.device_memory || []).length - 1;
    return el(
      "td",
      { className: "memory", title: `${dev.device}: ${used} of ${total} bytes` },
      el("span", { className: "mono" }, dev.device),
      " ",
      el("span", { className: "bar" }, fill),
      el("span", { className: "small" }, total > 0 ? `${bytes(used)} / ${bytes(total)}` : bytes(used)),
      more > 0 ? el("span", { className: "small" }, ` +${more}`) : null,
    );
  }

  function modelText(m) {
    return m.version === null ? m.name : `${m.name} v${m.version}`;
  }

  function modelTitle(m) {
    if (m.version === null) return `${m.name}: version not reported`;
    return m.lagging
      ? `${m.name} v${m.version}: behind v${m.newest}, the newest another worker serves (lagging)`
      : `${m.name} v${m.version}`;
  }

  // One line per model, "mlp v3", lagging ones first (highlighted), then "+N more":
  // the first few only; the details list every one.
  function modelsCell(w, models) {
    const shown = [...models.filter((m) => m.lagging), ...models.filter((m) => !m.lagging)]
      .slice(0, MODELS_SHOWN);
    const hidden = models.length - shown.length;
    const lines = shown.map((m) =>
      el("div", { className: `model ellipsis${m.lagging ? " lagging" : ""}`, title: modelTitle(m),
        "data-model": m.name, "data-version": m.version === null ? "" : m.version }, modelText(m)));
    return el(
      "td",
      { className: "models" },
      lines.length ? lines : "–",
      hidden > 0 ? el("div", { className: "small", title: "click for details" }, `+${hidden} more`) : null,
    );
  }

  function workerRow(w, colspan, newest) {
    const rank = num(w.rank);
    const stale = model.staleSince.get(w.worker_id);
    const r = model.ratesOf(w.worker_id);
    const rate = r ? r.rate : null;
    const open = expanded.has(w.worker_id);
    const models = workerModels(w, newest);
    const lagging = models.filter((m) => m.lagging).map((m) => m.name);
    const rateCell = stale !== undefined
      ? el("td", { className: "num rate", colspan: 2 }, el("span", { className: "stale-note" }, `stale since ${clock(stale)}`))
      : [
          el("td", { className: "num rate" }, el("span", { className: "rate-num" }, rateText(rate)), sparkline(r ? r.rates : [])),
          latencyCell(w, r),
        ];
    const row = el(
      "tr",
      {
        className: `worker-row${stale !== undefined ? " stale" : ""}${lagging.length ? " lagging" : ""}`,
        "data-worker-id": w.worker_id,
        "data-state": w.state,
        "data-rank": rank,
        "data-tensors-held": num(w.tensors_held),
        "data-ops-completed": num(w.ops_completed),
        "data-ops-rate": rate === null ? "" : rate.toFixed(3),
        "data-lagging": lagging.join(" "),
        "aria-expanded": open ? "true" : "false",
        title: "click for details",
      },
      el("td", { className: "num" }, el("span", { className: "caret" }, open ? "▾" : "▸"), " ", rank >= 0 ? rank : "–"),
      el("td", {}, el("span", { className: `state state-${w.state}` }, w.state)),
      el("td", { className: "worker", title: `${w.address}\n${w.hostname} · pid ${num(w.pid)}` }, el("div", { className: "mono ellipsis" }, w.address),
        el("div", { className: "small ellipsis" }, `${w.hostname} · pid ${num(w.pid)}`)),
      rateCell,
      el("td", { className: "num" }, num(w.ops_completed), " / ",
        el("span", { className: num(w.ops_failed) ? "failed" : "" }, num(w.ops_failed))),
      el("td", { className: "num" }, num(w.tensors_held), el("div", { className: "small" }, bytes(w.bytes_held))),
      modelsCell(w, models),
      el("td", { className: "num" }, num(w.queue_depth)),
      memoryCell(w),
      el("td", { className: "num small" }, `${num(w.last_heartbeat_age_s).toFixed(1)} s`),
    );
    return open ? [row, detailsRow(w, colspan, models)] : [row];
  }

  // p50 · p99 of the worker's busiest kind, as the worker reports it (its last
  // 512 ops of that kind); sampled last-op latencies for a worker without rates.
  function latencyCell(w, r) {
    const busiest = kindRows(w.ops).find((k) => k.p99 > 0);
    if (busiest) {
      return el("td", { className: "num small", title: `${busiest.kind}: its last 512 ops (every kind in the details)` },
        `${latency(busiest.p50)} · ${latency(busiest.p99)}`, el("div", { className: "small muted ellipsis" }, busiest.kind));
    }
    return el("td", { className: "num small", title: "sampled at heartbeats, last 50 ops" },
      r && r.p50() !== null ? `${latency(r.p50())} · ${latency(r.p99())}` : "–");
  }

  // A table of ops by kind: rate, p50, p99, ok / failed, collective bytes in / out.
  function kindTable(rows, attrs = {}) {
    const body = rows.map((k) =>
      el("tr", { "data-kind": k.kind, "data-rate": k.rate.toFixed(3), "data-p50": k.p50, "data-p99": k.p99,
        "data-completed": k.completed, "data-failed": k.failed, "data-bytes-in": k.bytesIn, "data-bytes-out": k.bytesOut },
        el("td", { className: "mono" }, k.kind),
        el("td", { className: "num" }, rateText(k.rate)),
        el("td", { className: "num" }, latency(k.p50)),
        el("td", { className: "num" }, latency(k.p99)),
        el("td", { className: "num" }, k.completed, " / ", el("span", { className: k.failed ? "failed" : "" }, k.failed)),
        el("td", { className: "num small" }, k.bytesIn || k.bytesOut ? `↓ ${bytes(k.bytesIn)} · ↑ ${bytes(k.bytesOut)}` : "–"),
      ));
    return el("table", { className: "kinds", ...attrs },
      el("thead", {}, el("tr", {},
        el("th", {}, "Kind"), el("th", { className: "num" }, "Ops/s"), el("th", { className: "num" }, "p50"),
        el("th", { className: "num" }, "p99"), el("th", { className: "num" }, "Ok / failed"),
        el("th", { className: "num", title: "collective payload bytes this rank moved (the algorithm's traffic for the operand size)" },
          "Collective in / out"))),
      el("tbody", {}, body.length ? body : el("tr", { className: "empty" }, el("td", { colspan: 6 }, "no op yet"))));
  }

  function detailsRow(w, colspan, models) {
    const item = (label, ...value) => el("div", { className: "item" }, el("div", { className: "label" }, label), el("div", {}, ...value));
    const wide = (label, ...value) => el("div", { className: "item wide" }, el("div", { className: "label" }, label), el("div", {}, ...value));
    const versions = [
      w.package_version || w.version ? `collectives ${w.package_version || w.version}` : "",
      w.torch_version ? `torch ${w.torch_version}` : "",
      [w.backend, w.backend_version].filter(Boolean).join(" "),
    ].filter(Boolean);
    const devices = (w.device_memory || []).map((d) => `${d.device} ${bytes(d.used_bytes)}${num(d.total_bytes) ? " / " + bytes(d.total_bytes) : ""}`);
    const errors = (w.recent_errors || []).slice(-5).reverse().map((e) =>
      el("div", { className: "wrap" }, `${clock(e.unix_time_s)} ${e.kind} op ${num(e.op_id)} ${e.code}: ${e.message}`));
    return el(
      "tr",
      { className: "details", "data-details-for": w.worker_id },
      el("td", { colspan }, el("div", { className: "detail-grid" },
        item("Host", w.hostname, el("div", { className: "small" }, `pid ${num(w.pid)} · ${w.worker_id}`)),
        item("Devices", (devices.length ? devices : w.devices || []).join(", ") || "–",
          el("div", { className: "small" }, `RSS ${bytes(w.process_rss_bytes)} · host ${bytes(w.host_memory_available_bytes)} free of ${bytes(w.host_memory_total_bytes)}`)),
        item("Uptime", duration(w.uptime_s), el("div", { className: "small" }, `joined generation ${num(w.generation)}`)),
        item("Versions", versions.join(" · ") || "–"),
        wide("Ops by kind", kindTable(kindRows(w.ops), { "data-kinds-for": w.worker_id })),
        item("Last op", w.last_op || "–", w.last_op ? el("div", { className: "small" }, latency(w.last_op_latency_s)) : null),
        item("Data in / out", `↓ ${bytes(w.bytes_received)} · ↑ ${bytes(w.bytes_sent)}`,
          el("div", { className: "small" }, "data plane (put, get)")),
        item("Collectives in / out", `↓ ${bytes(w.collective_bytes_received)} · ↑ ${bytes(w.collective_bytes_sent)}`,
          el("div", { className: "small" }, "the algorithm's traffic for the operand sizes")),
        item("Models", models.length
          ? models.flatMap((m, i) => [i ? ", " : "", el("span", { className: `model${m.lagging ? " lagging" : ""}`, title: modelTitle(m) },
            modelText(m), m.lagging ? ` (behind v${m.newest})` : "")])
          : "–"),
        wide("Recent errors", errors.length ? errors : "–"),
      )),
    );
  }

  function renderWorkers(c) {
    const newest = newestModelVersions(c);
    const rows = (c.workers || []).flatMap((w) => workerRow(w, COLUMNS, newest));
    replaceRows("worker-rows", rows, "no worker registered yet", COLUMNS);
  }

  // ---- timeline and failed ops ---------------------------------------------

  function renderTimeline() {
    const rows = model.events.slice().reverse().map((e) =>
      el(
        "tr",
        { "data-kind": e.kind, "data-generation": e.kind === "sealed" ? e.generation : null },
        el("td", { className: "mono", title: dateTime(e.t) }, clock(e.t)),
        el("td", {}, el("span", { className: `event event-${e.kind}` }, e.title)),
        el("td", { className: "wrap" }, e.detail),
      ),
    );
    replaceRows("timeline-rows", rows, "no event yet", 3);
  }

  // ---- the op timeline: a row per rank, a bar per op and phase --------------

  function renderOps(c) {
    const stuck = stuckWorkers(c);
    const banner = document.getElementById("stuck");
    banner.hidden = stuck.length === 0;
    banner.replaceChildren(...stuck.map((s) =>
      el("div", { className: "stuck-line", "data-rank": s.rank }, `rank ${s.rank} (${s.address}): ${s.stuck}`)));
    const ops = opTimeline(c, TIMELINE_OPS);
    const box = document.getElementById("op-timeline");
    if (!ops.length) {
      box.replaceChildren(el("div", { className: "empty" }, "no op recorded yet"));
      return;
    }
    const ranks = [...new Set(ops.flatMap((op) => Object.keys(op.ranks).map(Number)))].sort((a, b) => a - b);
    // Ops side by side, each in an equal slot, its bars scaled to its own span:
    // a 1 ms op and a 10 s op both stay readable; the title says the real times.
    const slot = 100 / ops.length;
    const rows = ranks.map((rank) => {
      const bars = [];
      ops.forEach((op, i) => {
        const mine = op.ranks[rank];
        if (!mine) return;
        const span = Math.max(op.to - op.from, 1e-6);
        for (const s of mine.segments) {
          const left = i * slot + ((s.from - op.from) / span) * slot * 0.9;
          const width = Math.max(((s.to - s.from) / span) * slot * 0.9, 0.15);
          const slowest = op.slowest === rank && s.phase === "running";
          const names = op.names.map((n) => `'${n}'`).join(" ");
          const bar = el("div", {
            className: `op-bar phase-${s.phase}${slowest ? " slowest" : ""}${mine.inFlight ? " in-flight" : ""}`,
            title: `op ${op.opId} ${op.kind} ${names} (generation ${op.generation})\nrank ${rank}: ${s.phase} ` +
              `${((s.to - s.from) * 1000).toFixed(2)} ms${slowest ? "\nthe rank the others waited for" : ""}`,
            "data-op": op.key, "data-rank": rank, "data-phase": s.phase, "data-slowest": slowest ? "true" : "false",
          });
          // Through the CSSOM: the page's CSP allows no inline style attribute.
          bar.style.left = `${left.toFixed(3)}%`;
          bar.style.width = `${width.toFixed(3)}%`;
          bars.push(bar);
        }
      });
      return el("div", { className: "op-row", "data-rank": rank },
        el("div", { className: "op-rank mono" }, `rank ${rank}`), el("div", { className: "op-track" }, ...bars));
    });
    const first = ops[0];
    const lastOp = ops[ops.length - 1];
    box.replaceChildren(...rows, el("div", { className: "small op-axis" },
      `ops ${first.opId} … ${lastOp.opId} (generation ${lastOp.generation}), oldest left; ` +
      `${clock(first.from)} – ${clock(lastOp.to)}`));
  }

  function renderKinds(c) {
    const rows = kindRows(c.ops_by_kind);
    document.getElementById("kinds").replaceChildren(kindTable(rows, { id: "kind-table" }));
  }

  function renderFailures(c) {
    const rows = groupFailures(c).map((g) => {
      const who = [g.ranks.length ? `rank${g.ranks.length > 1 ? "s" : ""} ${g.ranks.join(", ")}` : "",
        ...(g.ranks.length ? [] : g.reporters)].filter(Boolean);
      return el(
        "tr",
        { "data-count": g.count, "data-kind": g.kind, "data-code": g.code, "data-op-id": g.opId,
          "data-reporters": g.reporters.length, "data-client": g.client },
        el("td", { className: "mono", title: `first ${dateTime(g.first)}\nlast ${dateTime(g.last)}` }, clock(g.last),
          el("div", { className: "small" }, `since ${clock(g.first)}`)),
        el("td", { className: "num" }, el("span", { className: "count" }, `${g.count}×`),
          el("div", { className: "small" }, `${rateText(g.rate)}/s`)),
        el("td", {}, g.kind, el("div", { className: "small mono" }, g.code)),
        el("td", { className: "wrap", title: g.reporters.join("\n") }, who.join(", "),
          g.client ? el("div", { className: "small" }, `client ${g.client}`) : null),
        el("td", { className: "wrap" }, g.message,
          g.opId ? el("div", { className: "small" }, `last op ${g.opId}`) : null),
      );
    });
    replaceRows("error-rows", rows, "no errors reported", 5);
  }

  function renderClients(c) {
    const rows = (c.clients || []).map((k) =>
      el(
        "tr",
        { "data-client-name": k.name || "", "data-host": k.host },
        el("td", { className: "wrap" }, k.name || "–", el("div", { className: "small mono" }, k.host)),
        el("td", { className: "wrap small" }, k.user_agent || "–"),
        el("td", { className: "num" }, (k.workers || []).length),
        el("td", { className: "mono", title: dateTime(k.last_unix_time_s) }, clock(k.last_unix_time_s)),
      ));
    replaceRows("client-rows", rows, "no client in the last 60 s", 4);
  }

  let lastUpdate = 0;
  let lastCluster = null;

  // One listener on the table body, which stays while its rows are replaced on
  // every update: a click across a re-render still lands.
  document.getElementById("worker-rows").addEventListener("click", (event) => {
    const row = event.target.closest("tr[data-worker-id]");
    if (!row) return;
    const id = row.dataset.workerId;
    if (expanded.has(id)) expanded.delete(id);
    else expanded.add(id);
    render(lastCluster);
  });

  function render(c) {
    if (!c) return;
    renderSummary(c);
    renderWorkers(c);
    renderKinds(c);
    renderOps(c);
    renderTimeline();
    renderFailures(c);
    renderClients(c);
  }

  function receive(c) {
    lastUpdate = Date.now();
    model.update(c, lastUpdate / 1000);
    lastCluster = c;
    render(c);
    document.body.dataset.version = String(c.version);
    setText("updated", `updated ${clock(lastUpdate / 1000)}`);
    setText("zone", `· times in ${zone()}`);
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
      receive(await response.json());
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
        receive(JSON.parse(event.data));
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

  setText("zone", `· times in ${zone()}`);
  openStream();
})();

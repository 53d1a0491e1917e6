// collectives dashboard: what the page derives from the stream of cluster
// snapshots (the JSON of /api/cluster, the schema of `collectives status --json`):
// per-worker ops/s (as the workers report it, by op kind, so the first paint
// already has the last known rates) and latency percentiles, the event
// timeline, failed ops aggregated by kind, code and message, which workers serve
// a model behind the newest version, and the one time format of the page. No
// DOM here; app.js renders what this computes.
"use strict";

(function () {
  const RATE_WINDOW_S = 5; // ops/s: ops finished over about the last 5 s
  const SAMPLES_KEPT = 120; // per worker: (time, ops) samples for the rate
  const SPARK_POINTS = 40; // ops/s values a sparkline shows
  const LATENCY_WINDOW = 50; // last-op latencies the percentiles are over
  const MAX_EVENTS = 200;
  const MAX_FAILED = 50;
  const MAX_LOST_ADDRESSES = 256; // remembered to tell a restart from a join

  function num(value) {
    const n = Number(value);
    return Number.isFinite(n) ? n : 0;
  }

  // ---- one time format: 24-hour local time, the zone shown once ------------

  function pad(v, n = 2) {
    return String(v).padStart(n, "0");
  }

  function clock(unixSeconds) {
    const t = num(unixSeconds);
    if (!t) return "";
    const d = new Date(t * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function zone(date = new Date()) {
    const offset = -date.getTimezoneOffset(); // minutes east of UTC
    const sign = offset < 0 ? "-" : "+";
    const abs = Math.abs(offset);
    return `UTC${sign}${pad(Math.floor(abs / 60))}:${pad(abs % 60)}`;
  }

  function dateTime(unixSeconds) {
    const t = num(unixSeconds);
    if (!t) return "";
    const d = new Date(t * 1000);
    const day = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
    return `${day} ${clock(t)} ${zone(d)}`;
  }

  // ---- percentiles ---------------------------------------------------------

  function percentile(values, p) {
    if (!values.length) return null;
    const sorted = values.slice().sort((a, b) => a - b);
    const rank = Math.ceil((p / 100) * sorted.length); // nearest rank
    return sorted[Math.min(sorted.length, Math.max(1, rank)) - 1];
  }

  // ---- per-worker rates ----------------------------------------------------

  class WorkerRates {
    constructor() {
      this.samples = []; // [{t, ops}] oldest first
      this.rates = []; // ops/s after each sample, for the sparkline
      this.latencies = []; // last-op latencies, one per sample whose ops moved
      this.rate = null; // null until two samples span some time
    }

    // `reported`: the ops/s the worker reports (its kinds' rates summed), which
    // wins over the rate between samples: it is known from the first snapshot on.
    add(t, ops, lastLatency, reported = null) {
      const prev = this.samples[this.samples.length - 1];
      if (prev && t <= prev.t) return;
      if (prev && ops > prev.ops && lastLatency > 0) {
        this.latencies.push(lastLatency);
        if (this.latencies.length > LATENCY_WINDOW) this.latencies.shift();
      }
      this.samples.push({ t, ops });
      if (this.samples.length > SAMPLES_KEPT) this.samples.shift();
      // The oldest sample within the window (or the oldest kept, if younger).
      let base = this.samples[0];
      for (const s of this.samples) {
        if (t - s.t <= RATE_WINDOW_S) break;
        base = s;
      }
      if (reported === null && t - base.t < 0.5) return;
      this.rate = reported !== null ? reported : Math.max(0, (ops - base.ops) / (t - base.t));
      this.rates.push(this.rate);
      if (this.rates.length > SPARK_POINTS) this.rates.shift();
    }

    p50() {
      return percentile(this.latencies, 50);
    }

    p99() {
      return percentile(this.latencies, 99);
    }
  }

  // The ops/s a worker reports over every kind; null when its status carries no
  // rates (no status yet).
  function reportedRate(w) {
    if (!w.has_status) return null;
    return Object.values(w.ops || {}).reduce((sum, o) => sum + num(o.rate_per_s), 0);
  }

  // A worker's kinds, busiest first: {kind, rate, p50, p99, completed, failed,
  // bytesIn, bytesOut}, from what it reports.
  function kindRows(ops) {
    return Object.entries(ops || {})
      .map(([kind, o]) => ({
        kind, rate: num(o.rate_per_s), p50: num(o.latency_p50_s), p99: num(o.latency_p99_s),
        completed: num(o.completed), failed: num(o.failed),
        bytesIn: num(o.collective_bytes_received), bytesOut: num(o.collective_bytes_sent),
      }))
      .sort((a, b) => b.rate - a.rate || b.completed - a.completed || a.kind.localeCompare(b.kind));
  }

  function mib(n) {
    return `${(n / 1048576).toFixed(1)} MiB`;
  }

  // ---- the model -----------------------------------------------------------

  class ClusterModel {
    constructor() {
      this.rates = new Map(); // worker_id -> WorkerRates
      this.clusterRates = []; // sum of the members' ops/s, for the summary sparkline
      this.events = []; // timeline, newest last: {t, kind, title, detail, key, generation}
      this.eventKeys = new Set();
      this.workers = new Map(); // worker_id -> {state, address, hostname} last seen
      this.staleSince = new Map(); // worker_id -> unix time its data stopped
      this.lastGeneration = 0; // newest history record already in the timeline
      this.lastMembers = null; // that record's members
      this.lostAddresses = new Map(); // address -> unix time it was lost or left
      this.lostHosts = new Map(); // hostname -> losses no new worker there made up for yet
      this.loaded = false;
    }

    // Folds one snapshot in; `now` is the browser's unix time in seconds.
    update(c, now) {
      this._history(c);
      this._drains(c);
      this._workers(c, now);
      this._rates(c, now);
      this.loaded = true;
      for (const address of this.lostAddresses.keys()) {
        if (this.lostAddresses.size <= MAX_LOST_ADDRESSES) break;
        this.lostAddresses.delete(address); // the oldest first (insertion order)
      }
    }

    _event(key, t, kind, title, detail, extra = {}) {
      if (this.eventKeys.has(key)) return;
      this.eventKeys.add(key);
      this.events.push({ key, t, kind, title, detail, ...extra });
      this.events.sort((a, b) => a.t - b.t);
      while (this.events.length > MAX_EVENTS) this.eventKeys.delete(this.events.shift().key);
    }

    // Sealed generations, and (on page load) the joins, losses and leader
    // changes their member lists show.
    _history(c) {
      const records = (c.history || []).slice().sort((a, b) => num(a.generation) - num(b.generation));
      const lost = new Set((c.workers || []).filter((w) => w.state === "lost").map((w) => w.address));
      for (const g of records) {
        const gen = num(g.generation);
        if (gen <= this.lastGeneration) continue;
        const t = num(g.sealed_unix_time_s);
        const members = g.members || [];
        this._event(`sealed:${gen}`, t, "sealed", `generation ${gen} sealed`,
          `${num(g.world_size)} member${num(g.world_size) === 1 ? "" : "s"}${g.reason ? " · " + g.reason : ""}`, { generation: gen });
        const before = this.lastMembers;
        if (before !== null && before[0] !== undefined && members[0] !== before[0]) {
          this._event(`leader:${gen}`, t, "leader", "leader changed",
            `rank 0 (sequences every collective) is now ${members[0] || "none"}, was ${before[0]}`,
            { generation: gen });
        }
        // Live snapshots report joins and losses as they happen; the history
        // stands in for them only for what happened before the page was opened.
        if (!this.loaded) {
          const old = new Set(before || []);
          members.forEach((address, rank) => {
            if (old.has(address)) return;
            const again = this.lostAddresses.has(address);
            this._event(`member:${gen}:${address}`, t, again ? "restarted" : "joined",
              again ? "restarted" : "joined", `${address} as rank ${rank} of generation ${gen}`);
            this.lostAddresses.delete(address);
          });
          for (const address of before || []) {
            if (members.includes(address)) continue;
            // Lost (not left): listed as lost, or the seal's reason says so.
            const reason = g.reason || "";
            const kind = lost.has(address) || (reason.includes(address) && /\blost\b/.test(reason))
              ? "lost" : "left";
            this._event(`gone:${gen}:${address}`, t, kind, kind,
              `${address} is not in generation ${gen}`);
            this.lostAddresses.set(address, t);
          }
        }
        this.lastGeneration = gen;
        this.lastMembers = members;
      }
    }

    // Every drain that ended (the coordinator keeps the last ones): one event each.
    _drains(c) {
      for (const r of c.drains || []) {
        const onto = r.successor ? `onto ${r.successor_id} at ${r.successor}` : "shrinking the cluster";
        const what = r.error
          ? `failed: ${r.error}`
          : `${num(r.tensors_moved)} tensors, ${mib(num(r.bytes_moved))}, ${num(r.models_moved)} models in ${num(r.seconds).toFixed(2)} s`;
        this._event(`drain:${r.worker_id}:${num(r.generation_before)}`, num(r.finished_unix_time_s),
          r.error ? "drain-failed" : "drained", r.error ? "drain failed" : "drained",
          `${r.worker_id} at ${r.worker} (rank ${num(r.rank)}) ${onto}: ${what}`,
          { generation: num(r.generation_after) });
      }
    }

    _workers(c, now) {
      const seen = new Set();
      for (const w of c.workers || []) {
        const id = w.worker_id;
        seen.add(id);
        const known = this.workers.get(id);
        if (w.state === "lost" && !this.staleSince.has(id)) {
          const t = now - num(w.last_heartbeat_age_s);
          this.staleSince.set(id, t);
          if (this.loaded || !this.lostAddresses.has(w.address)) {
            this._event(`lost:${id}`, t, "lost", "lost",
              `${w.address} (${w.hostname}, pid ${num(w.pid)}) missed its heartbeats`);
          }
          this.lostAddresses.set(w.address, t);
          this.lostHosts.set(w.hostname, (this.lostHosts.get(w.hostname) || 0) + 1);
        }
        if (!known && this.loaded && w.state !== "lost") {
          // A restart: a new worker at the address, or on the host, of a lost one.
          const host = this.lostHosts.get(w.hostname) || 0;
          const again = this.lostAddresses.has(w.address) || host > 0;
          if (!this.lostAddresses.delete(w.address) && host > 0) this.lostHosts.set(w.hostname, host - 1);
          this._event(`joined:${id}`, now, again ? "restarted" : "joined", again ? "restarted" : "joined",
            `${w.address} (${w.hostname}, pid ${num(w.pid)}) registered`);
        }
        this.workers.set(id, { state: w.state, address: w.address, hostname: w.hostname });
      }
      for (const [id, w] of this.workers) {
        if (seen.has(id)) continue;
        if (w.state !== "lost") {
          this._event(`left:${id}`, now, "left", "left", `${w.address} (${w.hostname}) deregistered`);
          this.lostAddresses.set(w.address, now);
        }
        this.workers.delete(id);
        this.rates.delete(id);
        this.staleSince.delete(id);
      }
    }

    _rates(c, now) {
      let total = 0;
      let any = false;
      for (const w of c.workers || []) {
        if (w.state === "lost") continue; // its numbers stopped; keep what it had
        let r = this.rates.get(w.worker_id);
        if (!r) this.rates.set(w.worker_id, (r = new WorkerRates()));
        r.add(now, num(w.ops_completed) + num(w.ops_failed), num(w.last_op_latency_s), reportedRate(w));
        if (r.rate !== null) {
          total += r.rate;
          any = true;
        }
      }
      if (any) {
        this.clusterRates.push(total);
        if (this.clusterRates.length > SPARK_POINTS) this.clusterRates.shift();
      }
    }

    ratesOf(workerId) {
      return this.rates.get(workerId) || null;
    }

    clusterRate() {
      return this.clusterRates.length ? this.clusterRates[this.clusterRates.length - 1] : null;
    }
  }

  // ---- failed ops, aggregated ------------------------------------------------

  // The cluster's error groups (kind, code and message, merged over the workers
  // that reported them, as `collectives status --json` has them), most recent first.
  function groupFailures(c) {
    return (c.error_groups || []).slice(0, MAX_FAILED).map((g) => ({
      kind: g.kind || "", code: g.code || "", message: g.message || "", count: num(g.count),
      first: num(g.first_unix_time_s), last: num(g.last_unix_time_s), rate: num(g.rate_per_s),
      client: g.client || "", opId: num(g.last_op_id), reporters: g.reporters || [],
      ranks: (g.ranks || []).map(num).filter((r) => r >= 0),
    }));
  }

  // ---- model versions: who is behind a publish -----------------------------

  // Model name -> the newest version a live (not lost) worker reports. A lost
  // worker's status is its last before it stopped: it does not count.
  function newestModelVersions(c) {
    const newest = new Map();
    for (const w of c.workers || []) {
      if (w.state === "lost") continue;
      for (const [name, version] of Object.entries(w.model_versions || {})) {
        newest.set(name, Math.max(num(version), newest.get(name) || 0));
      }
    }
    return newest;
  }

  // One worker's models in name order: {name, version (null when the status did
  // not carry it), lagging (behind `newest` on a live worker), newest}.
  function workerModels(w, newest) {
    const versions = w.model_versions || {};
    return (w.models || []).map((name) => {
      const has = Object.prototype.hasOwnProperty.call(versions, name);
      const version = has ? num(versions[name]) : null;
      const top = newest.get(name) || 0;
      return { name, version, newest: top, lagging: w.state !== "lost" && version !== null && version < top };
    });
  }

  // ---- the op timeline: the workers' flight records, merged by op ----------

  // The phases and the bars of an op on one rank ([name, from phase, to phase]), from
  // their one definition (collectives.wire.op_phases, served as phases.js).
  const PHASES = window.COLLECTIVES_OP_PHASES.phases;
  const SEGMENTS = window.COLLECTIVES_OP_PHASES.spans;

  // The last `last` ops the members reported (each worker's status carries its
  // last ops), merged by (generation, op id): {key, opId, generation, kind, names,
  // ranks: {rank: {segments: [{phase, from, to}], inFlight}}, slowest (the rank
  // the others waited for: the last to start it, ties to the last to finish),
  // from, to}, oldest first.
  function opTimeline(c, last = 30, nowS = Date.now() / 1000) {
    const ops = new Map();
    for (const w of c.workers || []) {
      if (w.state === "lost") continue;
      for (const op of w.recent_ops || []) {
        if (op.kind === "noop") continue;
        const key = `${op.generation}:${op.op_id}`;
        let merged = ops.get(key);
        if (!merged) {
          merged = { key, opId: num(op.op_id), generation: num(op.generation), kind: op.kind,
            names: op.names || [], ranks: {} };
          ops.set(key, merged);
        }
        const phases = op.phases || {};
        const inFlight = num(op.code) < 0;
        const segments = [];
        for (const [phase, from, to] of SEGMENTS) {
          if (!(from in phases)) continue;
          const end = to in phases ? phases[to] : (inFlight ? nowS : null);
          if (end === null) continue;
          segments.push({ phase, from: num(phases[from]), to: Math.max(num(phases[from]), num(end)) });
        }
        merged.ranks[op.rank] = { segments, inFlight, started: phases.started, finished: phases.finished };
      }
    }
    const sorted = [...ops.values()].sort((a, b) => a.generation - b.generation || a.opId - b.opId);
    const shown = sorted.slice(-last);
    for (const op of shown) {
      const arrived = Object.entries(op.ranks).filter(([, r]) => r.started !== undefined)
        .map(([rank, r]) => [num(r.started), num(r.finished), Number(rank)]);
      arrived.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
      op.slowest = arrived.length > 1 ? arrived[arrived.length - 1][2] : null;
      const times = Object.values(op.ranks).flatMap((r) => r.segments.flatMap((s) => [s.from, s.to]));
      op.from = Math.min(...times);
      op.to = Math.max(...times);
    }
    return shown.filter((op) => Number.isFinite(op.from));
  }

  // Workers whose own op is stuck (in flight longer than a quarter of the op
  // timeout): [{rank, address, stuck}], by rank.
  function stuckWorkers(c) {
    return (c.workers || []).filter((w) => w.state !== "lost" && w.stuck)
      .map((w) => ({ rank: w.rank, address: w.address, stuck: w.stuck }))
      .sort((a, b) => a.rank - b.rank);
  }

  window.CollectivesModel = {
    ClusterModel, groupFailures, kindRows, newestModelVersions, workerModels, percentile, clock, dateTime,
    zone, num, opTimeline, stuckWorkers, PHASES,
  };
})();

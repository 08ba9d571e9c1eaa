// Ranks by host: the node rows of the rank table and the heat map's row order.
//
// A node's summary is computed here and only here (summarizeNode), and only
// for the hosts whose ranks changed since it was last asked (NodeIndex), so a
// delta about three ranks costs three hosts' worth of work, not the job's.

import { isNumber } from "./format.js";

// Up to this many ranks the table opens every node; above it a node shows
// only its summary row until the operator opens it (README "The dashboard").
export const NODES_OPEN_MAX_RANKS = 64;

// A node with a rank in one of these is highlighted in its summary row.
export const UNHEALTHY = Object.freeze(new Set(["stalled", "dead", "failed", "node_lost", "agent_lost", "straggler"]));

// Ranks that are still stepping: only their step times can name a slowest rank.
const STEPPING = new Set(["healthy", "straggler"]);

// rows: the host's ranks' rows. Returns {host, ranks, first, counts,
// unhealthy, slowest: {rank, step_time_ms} | null, oldest: heartbeat time | null}.
export function summarizeNode(host, rows) {
  const counts = {};
  let first = Infinity;
  let unhealthy = 0;
  let slowest = null;
  let oldest = null;
  for (const row of rows) {
    counts[row.health] = (counts[row.health] || 0) + 1;
    if (UNHEALTHY.has(row.health)) unhealthy += 1;
    if (row.rank < first) first = row.rank;
    // The windowed mean, as the straggler rule and the charts compare.
    const ms = isNumber(row.step_time_mean_ms) ? row.step_time_mean_ms : row.step_time_ms;
    if (STEPPING.has(row.health) && isNumber(ms) && (slowest === null || ms > slowest.step_time_ms)) {
      slowest = { rank: row.rank, step_time_ms: ms };
    }
    if (isNumber(row.time) && (oldest === null || row.time < oldest)) oldest = row.time;
  }
  return { host, ranks: rows.length, first, counts, unhealthy, slowest, oldest };
}

// Which ranks run on which host, and each host's summary, kept current from
// the rows the store merges. A rank without a heartbeat has no host yet: it
// is grouped under null, shown last.
export class NodeIndex {
  constructor() {
    this.clear();
  }

  clear() {
    this.members = new Map(); // host -> Set of ranks
    this.hostOf = new Map(); // rank -> host
    this.dirty = new Set(); // hosts whose summary is out of date
    this.summaries = new Map(); // host -> summarizeNode(...)
    this.hosts = []; // by their lowest rank, null last
    this.ordered = []; // their summaries, in that order
    this.reorder = true;
  }

  // The rank's row changed (host included, perhaps).
  note(rank, host) {
    const key = typeof host === "string" ? host : null;
    const old = this.hostOf.get(rank);
    if (old !== key || !this.hostOf.has(rank)) {
      if (this.hostOf.has(rank)) {
        const set = this.members.get(old);
        set.delete(rank);
        if (!set.size) this.members.delete(old);
        this.dirty.add(old);
      }
      this.hostOf.set(rank, key);
      if (!this.members.has(key)) this.members.set(key, new Set());
      this.members.get(key).add(rank);
      this.reorder = true;
    }
    this.dirty.add(key);
  }

  // Hosts that named themselves (a rank's heartbeat carries its host).
  hostCount() {
    return this.members.size - (this.members.has(null) ? 1 : 0);
  }

  // Brings the dirty hosts' summaries up to date; returns them all, in order.
  nodes(rows) {
    if (!this.dirty.size && !this.reorder) return this.ordered;
    for (const host of this.dirty) {
      const ranks = this.members.get(host);
      if (!ranks) {
        this.summaries.delete(host);
        continue;
      }
      const before = this.summaries.get(host);
      const node = summarizeNode(host, Array.from(ranks, (r) => rows.get(r)));
      if (!before || before.first !== node.first) this.reorder = true;
      this.summaries.set(host, node);
    }
    this.dirty.clear();
    if (this.reorder) {
      this.reorder = false;
      this.hosts = Array.from(this.summaries.values())
        .sort((a, b) => (a.host === null) - (b.host === null) || a.first - b.first)
        .map((node) => node.host);
    }
    this.ordered = this.hosts.map((host) => this.summaries.get(host));
    return this.ordered;
  }

  // items grouped by their rank's host, in node order, keeping their order
  // within a host; ranks of no known host come last. Returns [{host, items}].
  group(items, rankOf, rows) {
    const byHost = new Map();
    for (const item of items) {
      const rank = rankOf(item);
      const host = this.hostOf.has(rank) ? this.hostOf.get(rank) : null;
      let list = byHost.get(host);
      if (!list) byHost.set(host, (list = []));
      list.push(item);
    }
    const groups = [];
    for (const node of this.nodes(rows)) {
      const list = byHost.get(node.host);
      if (list) groups.push({ host: node.host, node, items: list });
      byHost.delete(node.host);
    }
    // Ranks the index has no row for (chart history of a rank since removed).
    for (const [host, list] of byHost) groups.push({ host, node: null, items: list });
    return groups;
  }
}

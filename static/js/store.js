// The page's copy of the rows, kept current from ranks_snapshot and ranks_delta.
// Windowed (a job above PAGE_WINDOW_RANKS, app/ranks/window.py), it holds only
// the rows of the server's window, in the server's order, and the window itself.

import { NodeIndex } from "./nodes.js";

export class RankStore {
  constructor() {
    this.rows = new Map();
    this.worldSize = 0;
    this.summary = null;
    this.run = null;
    // The stop lifecycle as last pushed (GET /api/exit's body): the one copy the stop panel
    // and the header both read, so one cannot say "Stopped" while the other says "Stopping".
    this.stop = null;
    // Server clock minus this clock, in seconds, so ages are right on both.
    this.offset = 0;
    // rank -> seq not yet drawn (read by the table's render log).
    this.newSeqs = new Map();
    this.hasDevice = false;
    // Ranks by host, for the table's node rows and the heat map's order.
    this.nodes = new NodeIndex();
    // {page, per_page, total, pages, health, sort} while the server windows the rows, else null.
    this.window = null;
    // The window's ranks in the server's order; its hosts' rows (from agents' digests), if any.
    this.order = [];
    this.hosts = null;
  }

  // More than one host: the table groups its ranks by node.
  multiNode() {
    // Windowed, the server's window is the page: no node grouping of a slice of the job.
    return !this.window && this.nodes.hostCount() > 1;
  }

  serverNow() {
    return Date.now() / 1000 + this.offset;
  }

  _head(msg) {
    this.offset = msg.now - Date.now() / 1000;
    this.worldSize = msg.world_size;
    if (msg.summary) this.summary = msg.summary;
    if (msg.run) this.run = msg.run;
  }

  _noteRow(row) {
    if (row.seq !== null && row.seq !== undefined) this.newSeqs.set(row.rank, row.seq);
    if (row.device) this.hasDevice = true;
  }

  // Returns the rows that carry a heartbeat, for the charts.
  applySnapshot(msg) {
    this._head(msg);
    this.window = msg.window || null;
    this.order = msg.ranks.map((row) => row.rank);
    this.hosts = msg.hosts || null;
    this.rows.clear();
    this.nodes.clear();
    for (const row of msg.ranks) {
      this.rows.set(row.rank, row);
      this.nodes.note(row.rank, row.host);
      this._noteRow(row);
    }
    return msg.ranks.filter((row) => row.time !== null);
  }

  // Merges changed fields; returns the merged rows that got a new heartbeat.
  applyDelta(msg) {
    this._head(msg);
    const beats = [];
    for (const change of msg.rows || []) {
      const row = Object.assign(this.rows.get(change.rank) || {}, change);
      this.rows.set(change.rank, row);
      this.nodes.note(change.rank, row.host);
      this._noteRow(change);
      if (change.time !== undefined && change.time !== null) beats.push(row);
    }
    if (msg.hosts) this.hosts = msg.hosts;
    if (msg.window) this._rewindow(msg.window);
    return beats;
  }

  // The server's window moved or reordered: keep its rows only, in its order.
  _rewindow(window) {
    const { order, ...rest } = window;
    this.window = rest;
    this.order = order;
    const keep = new Set(order);
    for (const rank of Array.from(this.rows.keys())) if (!keep.has(rank)) this.rows.delete(rank);
    this.nodes.clear();
    for (const rank of order) {
      const row = this.rows.get(rank);
      if (row) this.nodes.note(rank, row.host);
    }
  }

  takeNewSeqs() {
    const seqs = this.newSeqs;
    this.newSeqs = new Map();
    return seqs;
  }
}

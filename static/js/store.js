// The page's copy of the rows, kept current from ranks_snapshot and ranks_delta.

import { NodeIndex } from "./nodes.js";

export class RankStore {
  constructor() {
    this.rows = new Map();
    this.worldSize = 0;
    this.summary = null;
    this.run = null;
    // Server clock minus this clock, in seconds, so ages are right on both.
    this.offset = 0;
    // rank -> seq not yet drawn (read by the table's render log).
    this.newSeqs = new Map();
    this.hasDevice = false;
    // Ranks by host, for the table's node rows and the heat map's order.
    this.nodes = new NodeIndex();
  }

  // More than one host: the table groups its ranks by node.
  multiNode() {
    return this.nodes.hostCount() > 1;
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
    return beats;
  }

  takeNewSeqs() {
    const seqs = this.newSeqs;
    this.newSeqs = new Map();
    return seqs;
  }
}

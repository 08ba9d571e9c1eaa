// The rank table: sortable, filterable by verdict, paged for large jobs.
//
// Rows are drawn at most once per animation frame, however many deltas
// arrive, and only the visible page is touched; a cell's text is written
// only when it changed. Each draw records which heartbeats it showed in
// window.rankwatchRenderLog as [rank, seq, heartbeat time (s), drawn at (ms)],
// which the scale benchmark reads to measure write-to-screen latency.

import { SEL, $ } from "./dom.js";
import {
  GLYPH, formatCount, formatNumber, formatValue, headerLabel, isNumber, verdictLabel,
} from "./format.js";

// Worst first, so sorting by verdict brings trouble to the top.
const SEVERITY = [
  "node_lost", "dead", "failed", "stalled", "corrupt", "straggler", "pending", "healthy", "exited", "finished",
];
const RENDER_LOG_MAX = 100000;
// A rank read from msrun's worker log (source "log", README "Log mode") has
// no bridge to report these: each such row says so, and how to get them.
const LOG_ONLY = Object.freeze({
  note: "read from its worker log only: CPU, memory, device and stop stages are not in it; "
    + "add the Rankwatch bridge to the script to see them",
  cells: { cpu_percent: "not in log", rss_bytes: "not in log", device: "not in log" },
  age: "Seconds since its worker log last grew",
});

function compareValues(a, b) {
  if (a === b) return 0;
  if (a === null || a === undefined) return 1;
  if (b === null || b === undefined) return -1;
  if (typeof a === "string" || typeof b === "string") return String(a).localeCompare(String(b));
  return a - b;
}

export class RankTable {
  constructor(store, config) {
    this.store = store;
    this.rankMetrics = config.metrics.filter((m) => m.group === "rank");
    this.deviceMetrics = config.metrics.filter((m) => m.group === "device");
    this.verdicts = config.verdicts;
    this.pageSize = config.settings.page_size;
    this.sortKey = "rank";
    this.sortDir = 1;
    this.filter = "";
    this.page = 0;
    // Ranks whose reason the operator unfolded (a click or Enter on the cell).
    this.expanded = new Set();
    this.columns = [];
    this.scheduled = false;
    this.renderLog = [];
    window.rankwatchRenderLog = this.renderLog;

    this.headRow = $(SEL.tableHeadRow);
    this.body = $(SEL.tableBody);
    this.empty = $(SEL.tableEmpty);
    this.filterSelect = $(SEL.filter);
    this.pager = $(SEL.pager);
    this.pageInfo = $(SEL.pageInfo);

    for (const v of this.verdicts) {
      const option = document.createElement("option");
      option.value = v.name;
      option.textContent = verdictLabel(v.name);
      option.title = v.help;
      this.filterSelect.append(option);
    }
    this.filterSelect.addEventListener("change", () => this.setFilter(this.filterSelect.value));
    const unfold = (event) => {
      const td = event.target.closest('td[data-col="reason"]');
      if (!td) return;
      if (event.type === "keydown" && event.key !== "Enter" && event.key !== " ") return;
      event.preventDefault();
      const rank = Number(td.parentElement.dataset.rank);
      if (!this.expanded.delete(rank)) this.expanded.add(rank);
      this.invalidate();
    };
    this.body.addEventListener("click", unfold);
    this.body.addEventListener("keydown", unfold);
    $(SEL.pagePrev).addEventListener("click", () => this.turn(-1));
    $(SEL.pageNext).addEventListener("click", () => this.turn(1));
    this.buildHeader(false);
  }

  buildHeader(withDevice) {
    this.withDevice = withDevice;
    this.columns = withDevice ? [...this.rankMetrics, ...this.deviceMetrics] : this.rankMetrics;
    this.headRow.replaceChildren(...this.columns.map((m) => {
      const th = document.createElement("th");
      th.scope = "col";
      th.dataset.col = m.name;
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = headerLabel(m);
      button.title = m.description;
      button.addEventListener("click", () => this.sortBy(m.name));
      th.append(button);
      return th;
    }));
    // The Stack action (incidents.js listens for its clicks on the body).
    const actions = document.createElement("th");
    actions.scope = "col";
    actions.dataset.col = "actions";
    actions.textContent = "Stack";
    this.headRow.append(actions);
    this.body.replaceChildren();
    this.markSort();
  }

  markSort() {
    for (const th of this.headRow.cells) {
      const sorted = th.dataset.col === this.sortKey;
      th.setAttribute("aria-sort", sorted ? (this.sortDir > 0 ? "ascending" : "descending") : "none");
    }
  }

  sortBy(name) {
    this.sortDir = name === this.sortKey ? -this.sortDir : 1;
    this.sortKey = name;
    this.markSort();
    this.invalidate();
  }

  setFilter(verdict) {
    this.filter = verdict;
    this.filterSelect.value = verdict;
    this.page = 0;
    this.invalidate();
  }

  turn(by) {
    this.page += by;
    this.invalidate();
  }

  invalidate() {
    if (this.scheduled) return;
    this.scheduled = true;
    requestAnimationFrame(() => {
      this.scheduled = false;
      this.render();
    });
  }

  sortValue(row, key) {
    if (key === "health") return SEVERITY.indexOf(row.health);
    // The age is derived from the write time: older heartbeat, larger age.
    if (key === "heartbeat_age_s") return row.time === null ? null : -row.time;
    return row[key];
  }

  view() {
    let rows = Array.from(this.store.rows.values());
    if (this.filter) rows = rows.filter((row) => row.health === this.filter);
    const key = this.sortKey;
    const dir = this.sortDir;
    return rows.sort((a, b) => {
      const va = this.sortValue(a, key);
      const vb = this.sortValue(b, key);
      // Missing values go last whichever way the column is sorted.
      if (va === null || va === undefined || vb === null || vb === undefined) {
        return compareValues(va, vb) || a.rank - b.rank;
      }
      return dir * compareValues(va, vb) || a.rank - b.rank;
    });
  }

  render() {
    if (this.store.hasDevice !== this.withDevice) this.buildHeader(this.store.hasDevice);
    const rows = this.view();
    const pages = Math.max(1, Math.ceil(rows.length / this.pageSize));
    this.page = Math.min(Math.max(this.page, 0), pages - 1);
    const first = this.page * this.pageSize;
    const visible = rows.slice(first, first + this.pageSize);
    const now = this.store.serverNow();

    while (this.body.rows.length < visible.length) this.body.append(this.newRow());
    while (this.body.rows.length > visible.length) this.body.lastElementChild.remove();
    visible.forEach((row, i) => this.fillRow(this.body.rows[i], row, now));

    this.pager.hidden = pages <= 1;
    this.pageInfo.textContent = `${first + 1}–${first + visible.length} of ${rows.length}`;
    $(SEL.pagePrev).disabled = this.page === 0;
    $(SEL.pageNext).disabled = this.page >= pages - 1;
    this.empty.hidden = visible.length > 0;
    if (!visible.length) {
      this.empty.textContent = this.filter
        ? `No rank is ${this.filter} right now.`
        : (this.store.run?.message || "No ranks yet.");
    }
    this.logDrawn();
  }

  logDrawn() {
    const drawnAt = Date.now();
    for (const [rank, seq] of this.store.takeNewSeqs()) {
      const row = this.store.rows.get(rank);
      this.renderLog.push([rank, seq, row ? row.time : null, drawnAt]);
    }
    if (this.renderLog.length > RENDER_LOG_MAX) this.renderLog.splice(0, RENDER_LOG_MAX / 2);
  }

  newRow() {
    const tr = document.createElement("tr");
    for (const m of this.columns) {
      const td = document.createElement("td");
      td.dataset.col = m.name;
      if (m.name === "health") {
        const badge = document.createElement("span");
        badge.className = "badge";
        td.append(badge);
      }
      if (m.name === "reason") {
        td.tabIndex = 0;
      }
      tr.append(td);
    }
    const td = document.createElement("td");
    td.dataset.col = "actions";
    const stack = document.createElement("button");
    stack.type = "button";
    stack.className = "btn btn-small";
    stack.textContent = "Stack";
    td.append(stack);
    tr.append(td);
    return tr;
  }

  cellText(m, row, now) {
    if (row.source === "log" && m.name in LOG_ONLY.cells) return LOG_ONLY.cells[m.name];
    switch (m.name) {
      case "health": return `${GLYPH[row.health] || ""} ${verdictLabel(row.health)}`;
      case "global_step":
        if (row.global_step === null || row.global_step === undefined) return "–";
        return `${formatNumber(row.epoch)} / ${formatNumber(row.step)} (${formatCount(row.global_step)})`;
      case "heartbeat_age_s":
        return isNumber(row.time) ? formatValue(m, Math.max(0, now - row.time)) : "–";
      case "reason": {
        // Problems the bridge met and survived (a full disk) ride along with
        // the verdict's reason: warnings have no column of their own.
        const warnings = Array.isArray(row.warnings) ? row.warnings : [];
        const reason = formatValue(m, row.reason);
        const more = warnings.length > 1 ? ` (+${warnings.length - 1} more)` : "";
        const text = warnings.length
          ? `${reason} ⚠ ${formatValue(m, warnings[warnings.length - 1])}${more}` : reason;
        return row.source === "log" ? `${text} · ${LOG_ONLY.note}` : text;
      }
      default: return formatValue(m, row[m.name]);
    }
  }

  fillRow(tr, row, now) {
    if (tr.dataset.rank !== String(row.rank)) {
      tr.dataset.rank = row.rank;
      const stack = tr.lastElementChild.firstChild;
      stack.dataset.stackRank = row.rank;
      stack.title = `What rank ${row.rank}'s threads are doing: its newest stack capture`;
    }
    if (tr.dataset.health !== row.health) {
      tr.dataset.health = row.health;
      tr.lastElementChild.firstChild.dataset.health = row.health;
    }
    if (tr.dataset.source !== row.source) tr.dataset.source = row.source;
    const reason = tr.cells[this.columns.findIndex((m) => m.name === "reason")];
    if (reason) reason.toggleAttribute("data-expanded", this.expanded.has(row.rank));
    this.columns.forEach((m, i) => {
      const td = tr.cells[i];
      const text = this.cellText(m, row, now);
      if (td.rwText === text) return;
      td.rwText = text;
      if (m.name === "health") {
        td.firstChild.className = `badge verdict-${row.health}`;
        td.firstChild.textContent = text;
      } else {
        td.textContent = text;
        if (m.name === "reason" || m.name === "host") td.title = text;
        if (m.name === "heartbeat_age_s") td.title = row.source === "log" ? LOG_ONLY.age : "";
      }
    });
  }
}

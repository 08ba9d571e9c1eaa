// The rank table: sortable, filterable by verdict, paged for large jobs, and
// grouped by node when the job spans more than one host.
//
// Rows are drawn at most once per animation frame, however many deltas
// arrive, and only the visible page is touched; a cell's text is written
// only when it changed. A multi-host job gets a summary row per node
// (nodes.js) above that node's ranks, which it can fold away; sorting and
// the verdict filter order and pick ranks within each node, and nodes keep
// the order of their lowest rank. Each draw records which heartbeats it showed in
// window.rankwatchRenderLog as [rank, seq, heartbeat time (s), drawn at (ms)],
// which the scale benchmark reads to measure write-to-screen latency.
//
// Windowed (a job above PAGE_WINDOW_RANKS: the store holds only the server's
// window), paging, the verdict filter and sorting by rank or verdict are the
// server's: they send the window asked for (onView, the ranks_view event)
// and the table draws the rows the server sends, in its order.

import { api } from "./base.js";
import { SEL, $ } from "./dom.js";
import {
  GLYPH, formatCount, formatLoss, formatNumber, formatSeconds, formatValue, headerLabel, isNumber, verdictLabel,
} from "./format.js";
import { NODES_OPEN_MAX_RANKS } from "./nodes.js";
import { SERVER_SORTS, differs, wantedView, windowInfo } from "./serverview.js";

// Worst first, so sorting by verdict brings trouble to the top.
const SEVERITY = [
  "node_lost", "agent_lost", "dead", "failed", "stalled", "corrupt", "straggler", "pending", "starting", "healthy", "exited", "finished",
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

// A rank that has ended (or whose process is gone) has no live rate, step
// time or CPU: its cells are blank, the last value in their tooltip.
const ENDED = new Set(["exited", "finished", "failed", "dead", "node_lost"]);
// Verdicts of a rank that no longer reports, whatever it last said: its reported state is
// only what it said last ("training" beside "dead" read as a contradiction).
const SILENT = new Set(["dead", "node_lost", "agent_lost"]);
const REPORTED_END = new Set(["exited", "finished", "failed"]);
const LIVE_COLS = new Set(["samples_per_s", "step_time_ms", "step_time_mean_ms", "cpu_percent", "device_util_percent"]);

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
    // Nodes the operator opened (true) or closed (false); others follow the default.
    this.nodeOpen = new Map();
    // Rank rows to reuse, in page order, and node rows by host.
    this.rankRows = [];
    this.nodeRows = new Map();
    this.columns = [];
    this.scheduled = false;
    this.renderLog = [];
    window.rankwatchRenderLog = this.renderLog;
    // Set by main.js: sends the window asked for to the server (windowed only).
    this.onView = () => {};

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
    // A button: Enter and Space work as a click.
    this.body.addEventListener("click", (event) => {
      const toggle = event.target.closest(SEL.nodeToggle);
      if (!toggle) return;
      const host = toggle.closest("tr").rwHost;
      const open = !this.isOpen(host);
      this.nodeOpen.set(host, open);
      this.invalidate();
      if (open) this.fetchNode(host);
    });
    $(SEL.pagePrev).addEventListener("click", () => this.turn(-1));
    $(SEL.pageNext).addEventListener("click", () => this.turn(1));
    this.buildHeader(false);
  }

  // With agents, the rows a node's digests carried may be a resync old: an
  // opened node's rows come fresh from its agent (GET /api/hosts/<host>/ranks).
  async fetchNode(host) {
    if (host === null || this.store.window || this.store.run?.transport !== "agents") return;
    try {
      const res = await fetch(api(`/api/hosts/${encodeURIComponent(host)}/ranks`));
      if (!res.ok) return;
      const body = await res.json();
      if (!body.agent?.answered) return; // the digests' rows: the page has them already
      this.store.applyDelta({ now: body.now, world_size: this.store.worldSize, rows: body.ranks });
      this.invalidate();
    } catch {
      // The next push brings the rows all the same.
    }
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
    this.rankRows = [];
    this.nodeRows = new Map();
    this.markSort();
  }

  markSort() {
    for (const th of this.headRow.cells) {
      const sorted = th.dataset.col === this.sortKey;
      th.setAttribute("aria-sort", sorted ? (this.sortDir > 0 ? "ascending" : "descending") : "none");
    }
  }

  askServer(page) {
    this.onView(wantedView(this.pageSize, this.filter, this.sortKey, page));
  }

  // After a windowed snapshot: the server forgets a window on reconnect, so ask again if it differs.
  syncView() {
    const w = this.store.window;
    const want = w && wantedView(this.pageSize, this.filter, this.sortKey, w.page);
    if (w && differs(want, w)) this.onView(want);
  }

  sortBy(name) {
    // Windowed, only the orders the server keeps: by rank, or worst verdict first.
    if (this.store.window && !(name in SERVER_SORTS)) return;
    this.sortDir = name === this.sortKey ? -this.sortDir : 1;
    if (this.store.window) this.sortDir = 1;
    this.sortKey = name;
    this.markSort();
    if (this.store.window) this.askServer(1);
    this.invalidate();
  }

  setFilter(verdict) {
    this.filter = verdict;
    this.filterSelect.value = verdict;
    this.page = 0;
    if (this.store.window) this.askServer(1);
    this.invalidate();
  }

  turn(by) {
    if (this.store.window) {
      this.askServer(this.store.window.page + by);
      return;
    }
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
    if (this.store.window) return this.store.order.map((rank) => this.store.rows.get(rank)).filter(Boolean);
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

  isOpen(host) {
    const open = this.nodeOpen.get(host);
    if (open !== undefined) return open;
    // A filter asks to see those ranks: their nodes open unless closed by hand.
    return Boolean(this.filter)
      || Math.max(this.store.worldSize, this.store.rows.size) <= NODES_OPEN_MAX_RANKS;
  }

  // The sorted, filtered rows as the table's lines: per node, its summary
  // row, then its ranks if open. Nodes with no rank left by the filter go.
  grouped(rows) {
    const lines = [];
    for (const { node, items } of this.store.nodes.group(rows, (row) => row.rank, this.store.rows)) {
      if (!node) {
        lines.push(...items);
        continue;
      }
      const open = this.isOpen(node.host);
      lines.push({ isNode: true, node, open, shown: items.length });
      if (open) lines.push(...items);
    }
    return lines;
  }

  render() {
    if (this.store.hasDevice !== this.withDevice) this.buildHeader(this.store.hasDevice);
    if (this.store.window) {
      this.renderWindow();
      return;
    }
    const rows = this.view();
    const multiNode = this.store.multiNode();
    const lines = multiNode ? this.grouped(rows) : rows;
    const pages = Math.max(1, Math.ceil(lines.length / this.pageSize));
    this.page = Math.min(Math.max(this.page, 0), pages - 1);
    const first = this.page * this.pageSize;
    const visible = lines.slice(first, first + this.pageSize);
    if (multiNode && visible.length && !visible[0].isNode) {
      // A page that starts inside a node repeats that node's row on top.
      let i = first;
      while (i >= 0 && !lines[i].isNode) i -= 1;
      if (i >= 0) visible.unshift({ ...lines[i], continued: true });
    }
    this.draw(visible, multiNode, this.store.serverNow());

    this.pager.hidden = pages <= 1;
    const shown = `${first + 1}–${Math.min(first + this.pageSize, lines.length)} of ${lines.length}`;
    this.pageInfo.textContent = multiNode
      ? `rows ${shown} (${formatCount(this.store.nodes.hostCount())} nodes)` : shown;
    $(SEL.pagePrev).disabled = this.page === 0;
    $(SEL.pageNext).disabled = this.page >= pages - 1;
    this.empty.hidden = visible.length > 0;
    if (!visible.length) {
      this.empty.textContent = this.filter
        ? `No rank is ${this.filter} right now.`
        // The run status line above already says why (missing directory, no job): not twice.
        : "No ranks to show yet.";
    }
    this.logDrawn();
  }

  // The server's window: its rows as they came, its page and total in the pager.
  renderWindow() {
    const w = this.store.window;
    const rows = this.view();
    this.draw(rows, false, this.store.serverNow());
    this.pager.hidden = false;
    this.pageInfo.textContent = windowInfo(w, rows.length);
    $(SEL.pagePrev).disabled = w.page <= 1;
    $(SEL.pageNext).disabled = w.page >= w.pages;
    this.empty.hidden = rows.length > 0;
    if (!rows.length) this.empty.textContent = this.filter ? `No rank is ${this.filter} right now.` : "No ranks to show yet.";
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

  // Puts the page's lines in the body, reusing rows: rank rows in order,
  // node rows by host (so a node's button keeps focus when it is toggled).
  draw(lines, multiNode, now) {
    const nodeRows = new Map();
    let ranks = 0;
    const wanted = lines.map((line) => {
      if (line.isNode) {
        const host = line.node.host;
        const tr = this.nodeRows.get(host) || this.newNodeRow(host);
        nodeRows.set(host, tr);
        this.fillNode(tr, line, now);
        return tr;
      }
      if (ranks === this.rankRows.length) this.rankRows.push(this.newRow());
      const tr = this.rankRows[ranks];
      ranks += 1;
      if (tr.hasAttribute("data-in-node") !== multiNode) tr.toggleAttribute("data-in-node", multiNode);
      this.fillRow(tr, line, now);
      return tr;
    });
    this.nodeRows = nodeRows;
    this.rankRows.length = ranks;
    const children = this.body.children;
    wanted.forEach((tr, i) => {
      if (children[i] !== tr) this.body.insertBefore(tr, children[i] || null);
    });
    while (children.length > wanted.length) this.body.lastElementChild.remove();
  }

  newNodeRow(host) {
    const tr = document.createElement("tr");
    tr.className = "node-row";
    tr.rwHost = host;
    const td = document.createElement("td");
    td.className = "node-cell";
    const toggle = document.createElement("button");
    toggle.type = "button";
    toggle.className = "node-toggle";
    toggle.dataset.nodeToggle = "";
    const parts = ["name", "ranks", "verdicts", "slowest", "age"].map((part) => {
      const span = document.createElement("span");
      span.className = `node-${part}`;
      return span;
    });
    // Spaces between the parts, for screen readers and copied text.
    toggle.append(parts[0], " ", parts[1]);
    td.append(toggle, " ", parts[2], " ", parts[3], " ", parts[4]);
    tr.append(td);
    tr.rwParts = Object.fromEntries(parts.map((span) => [span.className.slice(5), span]));
    return tr;
  }

  fillNode(tr, line, now) {
    const { node, open } = line;
    const td = tr.firstElementChild;
    const span = this.columns.length + 1;
    if (td.colSpan !== span) td.colSpan = span;
    const toggle = td.firstElementChild;
    if (toggle.getAttribute("aria-expanded") !== String(open)) {
      toggle.setAttribute("aria-expanded", String(open));
      toggle.title = open ? "Hide this node's ranks" : "Show this node's ranks";
    }
    const worst = SEVERITY.find((v) => node.counts[v]) || "";
    if (tr.dataset.worst !== worst) tr.dataset.worst = worst;
    if (tr.hasAttribute("data-unhealthy") !== node.unhealthy > 0) {
      tr.toggleAttribute("data-unhealthy", node.unhealthy > 0);
    }
    const p = tr.rwParts;
    const set = (el, text) => {
      if (el.textContent !== text) el.textContent = text;
    };
    set(p.name, node.host === null ? "host not known yet" : node.host);
    set(p.ranks, `${formatCount(node.ranks)} rank${node.ranks === 1 ? "" : "s"}`
      + (line.shown < node.ranks ? `, ${formatCount(line.shown)} shown` : "")
      + (line.continued ? " (continued)" : ""));
    const counts = SEVERITY.filter((v) => node.counts[v]).map((v) => [v, node.counts[v]]);
    const key = counts.join(";");
    if (p.verdicts.rwKey !== key) {
      p.verdicts.rwKey = key;
      p.verdicts.replaceChildren(...counts.map(([v, n]) => {
        const badge = document.createElement("span");
        badge.className = `badge verdict-${v}`;
        badge.dataset.verdict = v;
        badge.textContent = `${GLYPH[v] || ""} ${verdictLabel(v)} ${formatCount(n)}`;
        return badge;
      }));
    }
    const slow = node.slowest;
    set(p.slowest, slow ? `slowest: rank ${slow.rank}, ${formatNumber(slow.step_time_ms)} ms` : "slowest: –");
    set(p.age, node.oldest === null ? "no heartbeat yet"
      : `oldest heartbeat ${formatSeconds(Math.max(0, now - node.oldest))} ago`);
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
    if (LIVE_COLS.has(m.name) && ENDED.has(row.health)) return "–";
    switch (m.name) {
      case "health": return `${GLYPH[row.health] || ""} ${verdictLabel(row.health)}`;
      case "global_step":
        // A log can tell the epoch and step without the global step (no steps per epoch printed).
        if (row.global_step === null || row.global_step === undefined) {
          return row.epoch ? `${formatNumber(row.epoch)} / ${formatNumber(row.step)}` : "–";
        }
        // A resumed launch is marked; the cell's title says from where (set and global step).
        return `${formatNumber(row.epoch)} / ${formatNumber(row.step)} (${formatCount(row.global_step)})`
          + (row.resumed_from ? " ↻" : "");
      case "state":
        return SILENT.has(row.health) && typeof row.state === "string" && !REPORTED_END.has(row.state)
          ? `last said ${row.state}` : formatValue(m, row.state);
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
      case "loss": return formatLoss(row.loss, row.loss_nonfinite);
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
        if (m.name === "global_step") td.title = row.resumed_from || "";
        if (m.name === "state") {
          td.title = text.startsWith("last said") ? "The rank no longer reports: this is the last state it reported" : "";
        }
        if (m.name === "heartbeat_age_s") td.title = row.source === "log" ? LOG_ONLY.age : "";
        if (LIVE_COLS.has(m.name)) {
          td.title = ENDED.has(row.health) && isNumber(row[m.name])
            ? `last: ${formatValue(m, row[m.name])}, before the rank ended` : "";
        }
      }
    });
  }
}

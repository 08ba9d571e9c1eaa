// The summary strip and the run status line above the table.

import { SEL, $, $all } from "./dom.js";
import { GLYPH, formatCount, formatLoss, formatNumber, formatSeconds, isNumber, plural, verdictLabel } from "./format.js";

// Verdicts that turn the page's state red; straggler first would read oddly, so worst first.
const TROUBLE = ["node_lost", "agent_lost", "dead", "failed", "stalled", "corrupt", "straggler"];

export class SummaryStrip {
  // onFilter(verdict) is called when a verdict count is clicked.
  constructor(store, config, onFilter) {
    this.store = store;
    this.values = new Map($all(SEL.summaryValue).map((el) => [el.dataset.summary, el]));
    const byName = new Map(config.metrics.map((m) => [m.name, m]));
    for (const el of $all(SEL.summaryLabel)) {
      const metric = byName.get(el.dataset.label);
      el.textContent = metric.label;
      el.title = metric.description;
    }
    this.chips = new Map();
    const holder = $(SEL.verdictCounts);
    for (const v of config.verdicts) {
      const chip = document.createElement("button");
      chip.type = "button";
      chip.className = `badge chip verdict-${v.name}`;
      chip.dataset.verdict = v.name;
      chip.title = `${v.help}; click to show only these`;
      chip.hidden = true;
      chip.addEventListener("click", () => onFilter(v.name));
      holder.append(chip);
      this.chips.set(v.name, chip);
    }
    this.filterOptions = $(SEL.filter).options;
    this.metricThroughput = byName.get("throughput");
    this.runSection = $(SEL.runStatus);
    this.runMessage = $(SEL.runMessage);
    this.pill = $(SEL.statePill);
    this.connection = $(SEL.connection);
  }

  set(name, text) {
    const el = this.values.get(name);
    if (el && el.textContent !== text) el.textContent = text;
  }

  render() {
    const s = this.store.summary;
    if (!s) return;
    // Windowed, the store knows only the window's hosts: not the job's count.
    const hosts = this.store.window ? 0 : this.store.nodes.hostCount();
    // No job yet: a world size of 0 is not a figure.
    this.set("world_size", !s.world_size ? "–" : (s.reported < s.world_size
      ? `${s.world_size} (${s.reported} reported)` : String(s.world_size))
      + (hosts > 1 ? ` on ${hosts} hosts` : ""));
    for (const [name, chip] of this.chips) {
      const n = s.counts[name] || 0;
      chip.hidden = n === 0;
      const text = `${GLYPH[name]} ${verdictLabel(name)} ${n}`;
      if (chip.textContent !== text) chip.textContent = text;
    }
    for (const option of this.filterOptions) {
      if (!option.value) continue;
      option.textContent = `${verdictLabel(option.value)} (${s.counts[option.value] || 0})`;
    }
    const slow = s.slowest;
    // The server words it (app/ranks/peers.py): rankwatch status prints the same sentence.
    this.set("slowest", slow && typeof slow.text === "string" ? slow.text : "–");
    // null: no rank reports a rate (ranks shown from their logs): unknown, not 0.
    this.set("throughput", s.throughput == null ? "unknown"
      : isNumber(s.throughput) && s.throughput > 0
        ? `${formatCount(Math.round(s.throughput))} ${this.metricThroughput.unit}` : "–");
    this.renderAges();
    this.renderRun();
    this.renderPill();
  }

  // The page-level state, as W&B's run state and Grafana's stat panels:
  // one line that says whether all is well, and the job's headline figures.
  renderPill() {
    const s = this.store.summary;
    const run = this.store.run;
    if (!s || !run) return;
    const counts = s.counts || {};
    const world = s.world_size || 0;
    const figures = [];
    if (isNumber(s.global_step)) figures.push(`step ${formatCount(s.global_step)}`);
    const first = this.store.rows.get(0);
    if (first?.loss_nonfinite) figures.push(`loss ${formatLoss(null, first.loss_nonfinite)}`);
    else if (isNumber(first?.loss)) figures.push(`loss ${formatNumber(first.loss)}`);
    const trouble = TROUBLE.filter((v) => counts[v] > 0);
    const bad = trouble.reduce((n, v) => n + counts[v], 0);
    const told = trouble.map((v) => `${counts[v]} ${verdictLabel(v)}`).join(", ");
    let state;
    let text;
    if (run.status === "missing" || run.status === "waiting" || !world) {
      state = "none";
      text = "No job yet";
    } else if (run.status === "conflict") {
      state = "bad";
      text = `${GLYPH.dead} Two launches in one run directory`;
    } else if (run.status === "unreadable") {
      state = "bad";
      text = `${GLYPH.dead} Run directory unreadable`;
    } else if (run.status === "ended") {
      const crashed = (counts.failed || 0) + (counts.dead || 0) + (counts.node_lost || 0);
      state = crashed ? "bad" : "ended";
      // "Stopped" only once the stop panel (the same store.stop) says it completed.
      const stopping = ["requested", "stopping"].includes(this.store.stop?.state);
      text = crashed ? `${GLYPH.dead} Crashed: ${told}`
        : counts.exited ? (stopping ? `${GLYPH.exited} Stopping: ranks are exiting` : `${GLYPH.exited} Stopped`)
          : `${GLYPH.finished} Finished`;
    } else if (bad) {
      state = "bad";
      text = `${GLYPH.dead} ${bad} of ${plural(world, "rank")} unhealthy: ${told}`;
    } else if (counts.starting || counts.pending || s.reported < world) {
      state = "starting";
      const up = s.reported || 0;
      const stepping = (counts.healthy || 0);
      text = `${GLYPH.starting} Starting: ${up} of ${plural(world, "rank")} up`
        + (stepping ? `, ${stepping} training` : "") + (counts.starting ? ", compiling" : "");
    } else {
      state = "healthy";
      const healthy = counts.healthy || 0;
      const ended = (counts.exited || 0) + (counts.finished || 0);
      text = `${GLYPH.healthy} ` + (healthy === world ? `All ${plural(world, "rank")} healthy`
        : `${healthy} of ${plural(world, "rank")} healthy, ${ended} ended`);
      if (isNumber(s.throughput) && s.throughput > 0) {
        figures.push(`${formatCount(Math.round(s.throughput))} ${this.metricThroughput.unit}`);
      }
    }
    if (state !== "none" && figures.length && state !== "starting") text += ` · ${figures.join(" · ")}`;
    if (this.pill.dataset.state !== state) this.pill.dataset.state = state;
    if (this.pill.textContent !== text) this.pill.textContent = text;
  }

  // Ages move with the clock, not with the data: redrawn every second.
  renderAges() {
    const s = this.store.summary;
    if (!s) return;
    this.set("last_step_age_s", !isNumber(s.last_step_at)
      ? "no step yet"
      : `${formatSeconds(Math.max(0, this.store.serverNow() - s.last_step_at))} ago`
        + (s.global_step != null ? ` (global step ${formatCount(s.global_step)})` : ""));
  }

  renderRun() {
    const run = this.store.run;
    if (!run) return;
    if (this.runSection.dataset.status !== run.status) this.runSection.dataset.status = run.status;
    if (this.runMessage.textContent !== run.message) this.runMessage.textContent = run.message;
  }

  setConnection(state, text) {
    this.connection.dataset.state = state;
    this.connection.textContent = text;
  }
}

// The summary strip and the run status line above the table.

import { SEL, $, $all } from "./dom.js";
import { GLYPH, formatCount, formatNumber, formatSeconds, isNumber, verdictLabel } from "./format.js";

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
    this.connection = $(SEL.connection);
  }

  set(name, text) {
    const el = this.values.get(name);
    if (el && el.textContent !== text) el.textContent = text;
  }

  render() {
    const s = this.store.summary;
    if (!s) return;
    const hosts = this.store.nodes.hostCount();
    this.set("world_size", (s.reported < s.world_size
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
    this.set("slowest", slow
      ? `rank ${slow.rank}: ${formatNumber(slow.step_time_ms)} ms`
        + (slow.basis === "work" ? " own work" : "") + `, +${formatNumber(slow.gap_ms)} ms`
        + ` over the median ${formatNumber(slow.median_ms)} ms`
        + (slow.ratio ? ` (${slow.ratio}×)` : "")
      : "–");
    // null: no rank reports a rate (ranks shown from their logs): unknown, not 0.
    this.set("throughput", s.throughput == null ? "unknown"
      : `${formatCount(isNumber(s.throughput) ? Math.round(s.throughput) : s.throughput)}`
      + ` ${this.metricThroughput.unit}`);
    this.renderAges();
    this.renderRun();
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

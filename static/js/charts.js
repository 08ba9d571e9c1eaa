// The run page's charts: the whole run's step time and loss (runcharts.js),
// and, above CHART_LINES_MAX_RANKS, a ranks x time heat map of step times.
//
// The heat map's history is kept as time buckets (CHART_BUCKET_S), at most
// HISTORY_POINTS of them, the same way the server's /api/history serves it:
// the page seeds from that once, then adds a point per heartbeat from the
// deltas. It redraws with Plotly.react at most every CHART_REFRESH_S and only
// when data changed, which keeps it steady (no flicker, zoom kept through
// uirevision).

import { SEL, $ } from "./dom.js";
import { headerLabel, isNumber } from "./format.js";
import { RunCharts } from "./runcharts.js";

const PLOT_CONFIG = Object.freeze({
  displaylogo: false,
  responsive: true,
  modeBarButtonsToRemove: ["select2d", "lasso2d"],
});

// Per-rank step times in aligned time-bucket columns.
class History {
  constructor(bucketS, maxColumns) {
    this.bucketS = bucketS;
    this.max = maxColumns;
    this.first = null; // bucket index of column 0
    this.len = 0;
    this.step = new Map(); // rank -> [ms or null per column]
  }

  arrays() {
    return [...this.step.values()];
  }

  seed(data) {
    if (!data || !data.t.length) return;
    const width = data.t.length;
    this.first = Math.round(data.t[0] / this.bucketS);
    this.len = width;
    data.ranks.forEach((rank, i) => {
      this.step.set(rank, data.step_time_ms[i]);
    });
    this.trim();
  }

  row(map, rank) {
    let values = map.get(rank);
    if (!values) {
      values = new Array(this.len).fill(null);
      map.set(rank, values);
    }
    return values;
  }

  add(rank, t, stepMs) {
    const bucket = Math.floor(t / this.bucketS);
    if (this.first === null) this.first = bucket;
    if (bucket < this.first) return;
    const end = this.first + this.len;
    if (bucket >= end) this.grow(bucket - end + 1);
    const col = bucket - this.first;
    this.row(this.step, rank)[col] = stepMs ?? null;
  }

  grow(n) {
    if (n > this.max) {
      // A gap longer than the window (the page slept): start afresh.
      this.first += this.len + n - this.max;
      this.len = 0;
      for (const values of this.arrays()) values.length = 0;
      n = this.max;
    }
    for (const values of this.arrays()) {
      for (let i = 0; i < n; i += 1) values.push(null);
    }
    this.len += n;
    this.trim();
  }

  trim() {
    const drop = this.len - this.max;
    if (drop <= 0) return;
    for (const values of this.arrays()) values.splice(0, drop);
    this.first += drop;
    this.len -= drop;
  }

  // A heatmap row: a heartbeat that lands just after a bucket boundary leaves
  // one bucket empty and the next one filled twice; bridging such single gaps
  // leaves only real silences (two buckets or more) blank.
  heatRow(rank, width) {
    const values = this.step.get(rank).slice(0, width);
    for (let i = 1; i < width - 1; i += 1) {
      if (values[i] === null && values[i - 1] !== null && values[i + 1] !== null) {
        values[i] = values[i - 1];
      }
    }
    return values;
  }

  times() {
    return Array.from({ length: this.len },
      (_, i) => new Date((this.first + i) * this.bucketS * 1000));
  }
}

export class Charts {
  constructor(store, config) {
    const s = config.settings;
    this.store = store;
    this.linesMax = s.chart_lines_max_ranks;
    this.history = new History(s.chart_bucket_s, s.history_points);
    this.seeded = false;
    this.early = [];
    this.dirty = false;
    this.revision = 0;
    const metric = new Map(config.metrics.map((m) => [m.name, m]));
    this.run = new RunCharts(config.urls.run_history, PLOT_CONFIG, {
      step: headerLabel(metric.get("step_time_mean_ms")),
      loss: headerLabel(metric.get("loss")),
    });
    this.el = { heat: $(SEL.chartHeatmap) };
    this.heatSection = $(SEL.heatmapSection);
    setInterval(() => this.refresh(), s.chart_refresh_s * 1000);
  }

  // data is /api/history's answer, or null when it could not be fetched.
  seed(data) {
    this.history.seed(data);
    for (const point of this.early) this.history.add(...point);
    this.early = [];
    this.seeded = true;
    this.dirty = true;
    this.refresh();
  }

  addRows(rows) {
    const num = (v) => (isNumber(v) ? v : null);
    for (const row of rows) {
      // A time that is not a number would poison every later bucket: skip the row.
      if (!isNumber(row.time)) continue;
      const point = [row.rank, row.time, num(row.step_time_mean_ms) ?? num(row.step_time_ms)];
      if (this.seeded) this.history.add(...point);
      else this.early.push(point);
    }
    if (rows.length) {
      this.dirty = true;
      this.run.poke();
    }
  }

  layout(title, yTitle, extra = {}) {
    return {
      title: { text: title, font: { size: 14 } },
      margin: { l: 60, r: 20, t: 36, b: 40 },
      xaxis: { type: "date" },
      yaxis: { title: { text: yTitle }, rangemode: "tozero" },
      legend: { orientation: "h", y: -0.2 },
      uirevision: "keep",
      datarevision: this.revision,
      ...extra,
    };
  }

  refresh() {
    if (!this.dirty || !this.seeded) return;
    this.dirty = false;
    const h = this.history;
    const ranks = Array.from(h.step.keys()).sort((a, b) => a - b);
    const large = Math.max(this.store.worldSize, ranks.length) > this.linesMax;
    this.heatSection.hidden = !large;
    if (!large) return;
    this.revision += 1;
    this.heatmap(h, h.times(), ranks);
  }

  // One row per rank; in a multi-host job, rows by node (the table's node
  // order), then rank, labelled "host · rank", with a line between nodes.
  heatmap(h, x, ranks) {
    // The newest bucket is still filling: leaving it out keeps the edge even.
    const width = Math.max(0, h.len - 1);
    let order = ranks;
    let y = ranks;
    let yTitle = "rank";
    const shapes = [];
    if (this.store.multiNode()) {
      const groups = this.store.nodes.group(ranks, (rank) => rank, this.store.rows);
      order = groups.flatMap((g) => g.items);
      y = groups.flatMap((g) => g.items.map((rank) => `${g.host ?? "?"} · ${rank}`));
      yTitle = "host · rank";
      let row = 0;
      for (const g of groups.slice(0, -1)) {
        row += g.items.length;
        shapes.push({
          type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: row - 0.5, y1: row - 0.5,
          line: { color: "#ffffff", width: 2 },
        });
      }
    }
    Plotly.react(this.el.heat, [{
      type: "heatmap", x: x.slice(0, width), y,
      z: order.map((rank) => h.heatRow(rank, width)),
      colorscale: "Cividis", zsmooth: false, colorbar: { title: { text: "ms" } },
      hovertemplate: `${yTitle === "rank" ? "rank " : ""}%{y}<br>%{x}<br>%{z} ms<extra></extra>`,
    }], this.layout("Step time per rank (a slow rank is a bright row)", yTitle, {
      yaxis: {
        title: { text: yTitle }, autorange: "reversed", automargin: true,
        type: shapes.length ? "category" : "-",
      },
      shapes,
    }), PLOT_CONFIG);
  }
}

// Step time and loss over time, and a ranks x time heat map for large jobs.
//
// History is kept as time buckets (CHART_BUCKET_S), at most HISTORY_POINTS of
// them, the same way the server's /api/history serves it: the page seeds from
// that once, then adds a point per heartbeat from the deltas. Charts redraw
// with Plotly.react at most every CHART_REFRESH_S and only when data changed,
// which keeps them steady (no flicker, zoom kept through uirevision).

import { SEL, $ } from "./dom.js";
import { headerLabel, isNumber } from "./format.js";

const PLOT_CONFIG = Object.freeze({
  displaylogo: false,
  responsive: true,
  modeBarButtonsToRemove: ["select2d", "lasso2d"],
});

// Per-rank step times and losses in aligned time-bucket columns.
class History {
  constructor(bucketS, maxColumns) {
    this.bucketS = bucketS;
    this.max = maxColumns;
    this.first = null; // bucket index of column 0
    this.len = 0;
    this.step = new Map(); // rank -> [ms or null per column]
    this.loss = new Map();
    this.stats = []; // per column: {median, max, maxRank, meanLoss}
    this.staleFrom = 0; // stats from this column on need recomputing
  }

  arrays() {
    return [...this.step.values(), ...this.loss.values(), this.stats];
  }

  seed(data) {
    if (!data || !data.t.length) return;
    const width = data.t.length;
    this.first = Math.round(data.t[0] / this.bucketS);
    this.len = width;
    data.ranks.forEach((rank, i) => {
      this.step.set(rank, data.step_time_ms[i]);
      this.loss.set(rank, data.loss[i]);
    });
    this.stats = new Array(width).fill(null);
    this.staleFrom = 0;
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

  add(rank, t, stepMs, loss) {
    const bucket = Math.floor(t / this.bucketS);
    if (this.first === null) this.first = bucket;
    if (bucket < this.first) return;
    const end = this.first + this.len;
    if (bucket >= end) this.grow(bucket - end + 1);
    const col = bucket - this.first;
    this.row(this.step, rank)[col] = stepMs ?? null;
    this.row(this.loss, rank)[col] = loss ?? null;
    this.staleFrom = Math.min(this.staleFrom, col);
  }

  grow(n) {
    if (n > this.max) {
      // A gap longer than the window (the page slept): start afresh.
      this.first += this.len + n - this.max;
      this.len = 0;
      for (const values of this.arrays()) values.length = 0;
      this.staleFrom = 0;
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
    this.staleFrom = Math.max(0, this.staleFrom - drop);
  }

  // Cross-rank statistics per column, recomputed only for changed columns.
  updateStats() {
    for (let col = this.staleFrom; col < this.len; col += 1) {
      const times = [];
      let max = null;
      let maxRank = null;
      for (const [rank, values] of this.step) {
        const v = values[col];
        if (v === null || v === undefined) continue;
        times.push(v);
        if (max === null || v > max) {
          max = v;
          maxRank = rank;
        }
      }
      let lossSum = 0;
      let lossN = 0;
      for (const values of this.loss.values()) {
        const v = values[col];
        if (v !== null && v !== undefined) {
          lossSum += v;
          lossN += 1;
        }
      }
      times.sort((a, b) => a - b);
      const mid = times.length >> 1;
      const median = !times.length ? null
        : times.length % 2 ? times[mid] : (times[mid - 1] + times[mid]) / 2;
      this.stats[col] = { median, max, maxRank, meanLoss: lossN ? lossSum / lossN : null };
    }
    this.staleFrom = this.len;
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
    this.stepTitle = headerLabel(metric.get("step_time_mean_ms"));
    this.lossTitle = headerLabel(metric.get("loss"));
    this.el = { step: $(SEL.chartStep), loss: $(SEL.chartLoss), heat: $(SEL.chartHeatmap) };
    this.heatSection = $(SEL.heatmapSection);
    this.emptyNote = { step: $(SEL.chartStepEmpty), loss: $(SEL.chartLossEmpty) };
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
      const point = [row.rank, row.time, num(row.step_time_mean_ms) ?? num(row.step_time_ms), num(row.loss)];
      if (this.seeded) this.history.add(...point);
      else this.early.push(point);
    }
    if (rows.length) this.dirty = true;
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
    this.revision += 1;
    const h = this.history;
    const x = h.times();
    const ranks = Array.from(h.step.keys()).sort((a, b) => a - b);
    const large = Math.max(this.store.worldSize, ranks.length) > this.linesMax;
    let stepTraces;
    let lossTraces;
    if (large) {
      h.updateStats();
      const line = (name, y, extra = {}) => ({ type: "scatter", mode: "lines", name, x, y, ...extra });
      stepTraces = [
        line("median of ranks", h.stats.map((s) => s?.median ?? null)),
        line("slowest rank", h.stats.map((s) => s?.max ?? null), {
          text: h.stats.map((s) => (s ? `rank ${s.maxRank}` : "")),
          hovertemplate: "%{text}: %{y} ms<extra></extra>",
        }),
      ];
      lossTraces = [line("mean over ranks", h.stats.map((s) => s?.meanLoss ?? null))];
    } else {
      const lines = (map) => ranks.map((rank) => ({
        type: "scatter", mode: "lines", name: `rank ${rank}`, x, y: map.get(rank),
      }));
      stepTraces = lines(h.step);
      lossTraces = lines(h.loss);
    }
    this.draw("step", stepTraces, this.layout("Step time", this.stepTitle));
    this.draw("loss", lossTraces, this.layout("Loss", this.lossTitle));
    this.heatSection.hidden = !large;
    if (large) this.heatmap(h, x, ranks);
  }

  // A chart without a single point says so, instead of Plotly's default axis
  // (January to November 2000) or sub-second ticks around one instant.
  draw(name, traces, layout) {
    const el = this.el[name];
    const has = traces.some((t) => t.y.some((v) => v !== null && v !== undefined));
    this.emptyNote[name].hidden = has;
    if (!has) {
      if (el.dataset.drawn) Plotly.purge(el);
      delete el.dataset.drawn;
      return;
    }
    el.dataset.drawn = "";
    Plotly.react(el, traces, layout, PLOT_CONFIG);
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

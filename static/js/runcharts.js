// The whole run's step-time and loss charts, as TensorBoard and W&B draw them.
//
// Data: /api/history/run (app/run/history.py), one point per attempt and
// global step: [step, t, mean loss, median step ms, slowest rank's step ms].
// The page fetches it once, then, while deltas arrive, at most every
// FETCH_MS only the points after the newest it has (?after=&generation=);
// after the server thinned, its generation differs and the whole series
// comes again. Each attempt is its own trace: a relaunch that resumed at
// S+1 continues the line in the same colour, a relaunch that replays steps
// an earlier attempt ran is a branch in its own colour and dash.
// Controls: x-axis (global step or wall time), EMA smoothing with the raw
// line faint behind, log scale; the y range ignores each attempt's first
// points (graph compilation) and the extreme percentiles, once there are
// enough points to call one an outlier and only if it is far beyond the rest.

import { SEL, $ } from "./dom.js";
import { formatClock, formatCount } from "./format.js";
import { endText } from "./attempts.js";
import { evidenceText } from "./spikes.js";

const FETCH_MS = 3000;
// Each attempt's first points (the compile step, the first checkpoint) are suspects: the y
// range leaves them out if they are outliers (robustRange).
const WARMUP_POINTS = 2;
// Fewer points than this and none is called an outlier: early in a run the range shows them all.
const OUTLIER_MIN_POINTS = 10;
// How far beyond the rest a point must lie to be left out: this many times the rest's spread,
// and at least half their magnitude on a linear axis, a factor of 2 (in log10 units) on a log one.
const OUTLIER_SPREADS = 1;
const OUTLIER_SHARE = 0.5;
const OUTLIER_LOG10 = Math.log10(2);
const LINE = "#1f77b4";
const BRANCHES = ["#d62728", "#9467bd", "#ff7f0e", "#2ca02c", "#8c564b", "#e377c2"];
const MARK = "#888888";

// TensorBoard's smoothing: an exponential moving average, debiased so the
// first points are not pulled towards zero; gaps stay gaps.
export function ema(ys, weight) {
  let last = 0;
  let n = 0;
  return ys.map((v) => {
    if (!Number.isFinite(v)) return null;
    last = last * weight + (1 - weight) * v;
    n += 1;
    return weight === 0 ? v : last / (1 - weight ** n);
  });
}

function quantile(sorted, q) {
  const pos = (sorted.length - 1) * q;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

// A y range over `values` and the `suspects` (each attempt's first points), padded; in
// log10 units for a log axis (Plotly's convention). null: let Plotly decide.
// The rest is `values` from their 1st to their 99th percentile (all of them below 50); a
// point outside it (a suspect, or a percentile's tail) is left out only when there are
// OUTLIER_MIN_POINTS points or more and it lies far beyond the rest. So the compile step's
// seconds among 50 ms steps are ignored, while the first losses of the fall (2.31 above
// 2.29, at the demo's start) are drawn: cutting them hid where the run began.
export function robustRange(values, log, suspects = []) {
  const scale = (vs) => vs.filter((v) => Number.isFinite(v) && (!log || v > 0)).map((v) => (log ? Math.log10(v) : v));
  const vals = scale(values);
  const all = vals.concat(scale(suspects));
  if (all.length < 3) return null;
  let lo;
  let hi;
  if (all.length < OUTLIER_MIN_POINTS || vals.length < 3) {
    lo = Math.min(...all);
    hi = Math.max(...all);
  } else {
    vals.sort((a, b) => a - b);
    const q = vals.length >= 50 ? 0.01 : 0;
    lo = quantile(vals, q);
    hi = quantile(vals, 1 - q);
    const far = Math.max(
      (hi - lo) * OUTLIER_SPREADS,
      log ? OUTLIER_LOG10 : Math.max(Math.abs(lo), Math.abs(hi)) * OUTLIER_SHARE,
    );
    const [rlo, rhi] = [lo, hi];
    for (const v of all) {
      if (v >= rlo - far && v <= rhi + far) {
        lo = Math.min(lo, v);
        hi = Math.max(hi, v);
      }
    }
  }
  const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.1 || 1;
  hi += pad;
  lo = !log && lo >= 0 ? Math.max(0, lo - pad) : lo - pad;
  return [lo, hi];
}

// Plotly renders hover text as a small HTML subset: text from the run directory is escaped.
function esc(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function attemptName(a, i) {
  const n = a.attempt ?? `#${i + 1}`;
  return a.replayed ? `attempt ${n} · replays ${formatCount(a.replayed[0])}–${formatCount(a.replayed[1])}` : `attempt ${n}`;
}

// Which attempt a line is, and why the one before it ended.
function attemptStory(a, i, previous) {
  const parts = [attemptName(a, i)];
  if (a.resumed_from) parts.push(`resumed from global step ${formatCount(a.resumed_from.global_step)}`);
  if (previous) parts.push(`attempt ${previous.attempt ?? i} before it: ${endText(previous)}`);
  return esc(parts.join("; "));
}

const every = (s) => (s === 60 ? "one point a minute" : `one point every ${formatCount(Math.round(s / 60))} minutes`);

export class RunCharts {
  constructor(url, plotConfig, titles) {
    this.url = url;
    this.plotConfig = plotConfig;
    this.titles = titles;
    this.attempts = [];
    this.spikes = []; // the loss-spike detections (/api/spikes' marks), drawn on the loss chart
    this.thinned = [];
    this.generation = null;
    this.newest = null;
    this.dirty = false;
    this.loading = false;
    this.revision = 0;
    this.zoomed = { step: false, loss: false };
    this.yRange = { step: null, loss: null };
    this.el = { step: $(SEL.chartStep), loss: $(SEL.chartLoss) };
    this.empty = { step: $(SEL.chartStepEmpty), loss: $(SEL.chartLossEmpty) };
    this.thinnedNote = $("#chart-thinned");
    this.xSelect = $("#chart-x");
    this.smoothInput = $("#chart-smoothing");
    this.smoothOut = $("#chart-smoothing-value");
    this.logBox = $("#chart-log");
    for (const input of [this.xSelect, this.smoothInput, this.logBox]) {
      input?.addEventListener("input", () => this.draw());
      input?.addEventListener("change", () => this.draw());
    }
    if (!url) return;
    this.load();
    setInterval(() => {
      if (this.dirty && !document.hidden) this.load();
    }, FETCH_MS);
  }

  // The loss-spike detections changed (static/js/spikes.js polls them).
  setSpikes(marks) {
    this.spikes = marks;
    this.draw();
  }

  // One marker per detection at its step (its time on a time axis), on the loss chart:
  // at its loss, or for a NaN or Inf (no y) at the top of the chart. Hover: rule and evidence.
  spikeTrace(xTime, ranged) {
    if (!this.spikes.length) return null;
    const finite = ranged.filter((v) => typeof v === "number" && Number.isFinite(v));
    const top = finite.length ? Math.max(...finite) : 1;
    const x = this.spikes.map((d) => (xTime ? new Date(d.at * 1000) : d.step));
    const y = this.spikes.map((d) => (typeof d.value === "number" && Number.isFinite(d.value) && d.rule !== "grad_norm" ? d.value : top));
    return {
      type: "scatter", mode: "markers", x, y, name: "loss spikes", showlegend: false,
      marker: { symbol: "x", size: 11, color: "#b3261e", line: { width: 2, color: "#b3261e" } },
      text: this.spikes.map((d) => `${evidenceText(d)}<br>${d.text}`),
      hovertemplate: "%{text}<extra>loss spike</extra>", meta: { kind: "spike" },
    };
  }

  // New heartbeats arrived: the series has grown.
  poke() {
    this.dirty = true;
  }

  get xMode() { return this.xSelect?.value === "time" ? "time" : "step"; }
  get smoothing() {
    const w = Number(this.smoothInput?.value ?? 0);
    return Number.isFinite(w) ? Math.min(0.99, Math.max(0, w)) : 0;
  }
  get log() { return Boolean(this.logBox?.checked); }

  async load() {
    if (this.loading) return;
    this.loading = true;
    this.dirty = false;
    const url = new URL(this.url, location.href);
    if (this.generation !== null && this.newest !== null) {
      url.searchParams.set("after", String(this.newest));
      url.searchParams.set("generation", String(this.generation));
    }
    try {
      const r = await fetch(url);
      const body = await r.json();
      if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
      this.merge(body);
      this.draw();
    } catch (err) {
      console.error("rankwatch: whole-run chart history unavailable:", err);
      this.dirty = true;
    } finally {
      this.loading = false;
    }
  }

  // A partial answer carries each attempt's points from some step on: they replace ours from there.
  merge(body) {
    const old = new Map(this.attempts.map((a) => [a.launch ?? "", a]));
    this.attempts = (body.attempts || []).map((a) => {
      const prev = old.get(a.launch ?? "");
      if (!body.partial || !prev) return a;
      if (!a.points.length) return { ...a, points: prev.points };
      const from = a.points[0][0];
      let keep = prev.points.length;
      while (keep > 0 && prev.points[keep - 1][0] >= from) keep -= 1;
      return { ...a, points: prev.points.slice(0, keep).concat(a.points) };
    });
    this.thinned = body.thinned || [];
    this.generation = body.generation;
    let newest = this.newest;
    for (const a of this.attempts) {
      const last = a.points[a.points.length - 1];
      if (last && (newest === null || last[1] > newest)) newest = last[1];
    }
    this.newest = newest;
  }

  draw() {
    if (this.smoothOut) this.smoothOut.textContent = this.smoothing.toFixed(2);
    this.revision += 1;
    const xTime = this.xMode === "time";
    const w = this.smoothing;
    const traces = { step: [], loss: [] };
    const ranged = { step: [], loss: [] };
    const suspects = { step: [], loss: [] };
    // The first points of an attempt long enough to have a rest to compare them with.
    const warm = (ys) => Math.min(WARMUP_POINTS, Math.max(0, ys.length - 3));
    const rank = (chart, ys) => {
      ranged[chart].push(...ys.slice(warm(ys)));
      suspects[chart].push(...ys.slice(0, warm(ys)));
    };
    let branch = 0;
    const shown = this.attempts.filter((a) => a.points.length);
    shown.forEach((a, i) => {
      const color = a.replayed ? BRANCHES[branch++ % BRANCHES.length] : LINE;
      const dash = a.replayed ? "dash" : "solid";
      const name = attemptName(a, i);
      const pts = a.points;
      // One per point: a hovertemplate's %{text} reads the point's own text and shows "-"
      // for a scalar, however Plotly's trace docs read.
      const text = pts.map(() => attemptStory(a, i, i > 0 ? shown[i - 1] : null));
      const x = pts.map((p) => (xTime ? new Date(p[1] * 1000) : p[0]));
      const steps = pts.map((p) => p[0]);
      const meta = (kind) => ({ attempt: a.attempt, launch: a.launch, branch: Boolean(a.replayed), kind });
      const hover = `%{text}<br>global step %{customdata}<br>%{y:.4g}<extra></extra>`;
      const pair = (chart, col, label) => {
        const raw = pts.map((p) => p[col]);
        traces[chart].push({
          type: "scatter", mode: "lines", x, y: raw, name: `${name} (raw)`, legendgroup: name, showlegend: false,
          opacity: 0.25, line: { color, width: 1, dash }, hoverinfo: "skip", meta: meta("raw"),
        }, {
          // A line of one point draws nothing: a short attempt (a relaunch killed at once) gets markers.
          type: "scatter", mode: pts.length < 3 ? "lines+markers" : "lines", x, y: ema(raw, w),
          name: `${name}${label}`, legendgroup: name,
          line: { color, width: 2, dash }, text, customdata: steps, hovertemplate: hover, meta: meta("smoothed"),
        });
        rank(chart, raw);
      };
      pair("loss", 2, "");
      pair("step", 3, " median");
      const slowest = pts.map((p) => p[4]);
      rank("step", slowest);
      traces.step.push({
        type: "scatter", mode: "lines", x, y: slowest, name: `${name} slowest rank`, legendgroup: name,
        showlegend: false, opacity: 0.5, line: { color, width: 1, dash: "dot" }, text, customdata: steps,
        hovertemplate: `%{text}<br>slowest rank, global step %{customdata}<br>%{y:.4g}<extra></extra>`,
        meta: meta("slowest"),
      });
    });
    const marks = this.marks(shown, xTime);
    const spikes = this.spikeTrace(xTime, ranged.loss);
    if (spikes && traces.loss.length) traces.loss.push(spikes);
    this.plot("step", traces.step, ranged.step, suspects.step, this.titles.step, marks, xTime);
    this.plot("loss", traces.loss, ranged.loss, suspects.loss, this.titles.loss, marks, xTime);
    this.noteThinned();
  }

  // A dotted vertical line and a label where each attempt began (its first step, or its
  // start); attempts that began at the same step (a replay) share one: "attempts 2, 3".
  marks(shown, xTime) {
    const at = new Map();
    shown.forEach((a, i) => {
      const x = xTime ? (a.started_at ?? a.points[0][1]) * 1000 : (a.first_step ?? a.points[0][0]);
      if (!at.has(x)) at.set(x, []);
      at.get(x).push(a.attempt ?? i + 1);
    });
    const shapes = [];
    const annotations = [];
    for (const [key, numbers] of at) {
      const x = xTime ? new Date(key) : key;
      shapes.push({
        type: "line", xref: "x", x0: x, x1: x, yref: "paper", y0: 0, y1: 1,
        line: { color: MARK, width: 1, dash: "dot" },
      });
      annotations.push({
        x, xref: "x", y: 1, yref: "paper", yanchor: "bottom", showarrow: false,
        text: `${numbers.length > 1 ? "attempts" : "attempt"} ${numbers.join(", ")}`,
        font: { size: 10, color: MARK },
      });
    }
    return { shapes, annotations };
  }

  plot(name, traces, ranged, suspects, yTitle, marks, xTime) {
    const el = this.el[name];
    if (!el) return;
    const has = traces.some((t) => t.y.some((v) => v !== null && v !== undefined));
    this.empty[name].hidden = has;
    // Flags are "1", never "": an empty dataset value is falsy, and a guard that tested one
    // added a plotly_relayout handler on every redraw (261 per chart after 30 minutes).
    if (!has) {
      // purge drops the chart's handlers too.
      if (el.dataset.drawn) Plotly.purge(el);
      delete el.dataset.drawn;
      delete el.dataset.listening;
      return;
    }
    const log = this.log;
    // A zoomed chart keeps the range it was given, so Plotly keeps the user's zoom (uirevision).
    if (!this.zoomed[name]) this.yRange[name] = robustRange(ranged, log, suspects);
    const range = this.yRange[name];
    const layout = {
      title: { text: name === "step" ? "Step time" : "Loss", font: { size: 14 } },
      margin: { l: 60, r: 20, t: 36, b: 40 },
      // No axis title: the x-axis control above says what it is, and the legend needs the room.
      xaxis: { type: xTime ? "date" : "linear" },
      yaxis: { title: { text: yTitle }, type: log ? "log" : "linear", ...(range ? { range } : { autorange: true }) },
      showlegend: traces.filter((t) => t.meta.kind === "smoothed").length > 1,
      legend: { orientation: "h", y: -0.2 },
      uirevision: `${this.xMode}|${log}`,
      datarevision: this.revision,
      ...marks,
    };
    el.dataset.drawn = "1";
    Plotly.react(el, traces, layout, this.plotConfig);
    if (!el.dataset.listening) {
      el.dataset.listening = "1";
      el.on("plotly_relayout", (ev) => {
        if ("yaxis.autorange" in ev || "xaxis.autorange" in ev) this.zoomed[name] = false;
        else if (Object.keys(ev).some((k) => k.startsWith("xaxis.range") || k.startsWith("yaxis.range"))) {
          this.zoomed[name] = true;
        }
      });
    }
  }

  noteThinned() {
    const note = this.thinnedNote;
    if (!note) return;
    note.hidden = !this.thinned.length;
    if (!this.thinned.length) return;
    const day = 86400;
    const clock = (t) => formatClock(t, this.newest !== null && this.newest - t > day);
    note.textContent = "Thinned to stay bounded: " + this.thinned
      .map((r, i) => (i === 0 ? `before ${clock(r.to)}` : `${clock(r.from)}–${clock(r.to)}`) + `, ${every(r.every_s)}`)
      .reverse()
      .join("; ") + ".";
  }
}

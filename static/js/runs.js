// The runs table (landing page under --runs): one server page of GET /api/runs
// at a time, refreshed every few seconds; only the rows on screen are fetched.

import { GLYPH, formatBytes, formatClock, formatFixed, formatSeconds, plural } from "./format.js";
import { token } from "./token.js";

// The printed link (#login=<code>) lands here under --runs: the token it
// trades for stays in this tab's sessionStorage for every run's console.
token.follow();

const config = JSON.parse(document.getElementById("runs-config").textContent);
const REFRESH_MS = 5000;
const body = document.querySelector("#runs-table tbody");
const stateSelect = document.getElementById("runs-state");
const search = document.getElementById("runs-q");
const pageLabel = document.getElementById("runs-page");
const summary = document.getElementById("runs-summary");
const empty = document.getElementById("runs-empty");
const slurmHead = document.getElementById("runs-slurm-head");
const view = { page: 1, sort: "attention", state: "", q: "" };
let pages = 1;
let timer = null;

function cell(col, content, title) {
  const td = document.createElement("td");
  td.dataset.col = col;
  if (title) td.title = title;
  if (content instanceof Node) td.append(content);
  else td.textContent = content;
  return td;
}

function verdicts(counts) {
  const span = document.createElement("span");
  for (const [name, n] of Object.entries(counts)) {
    const b = document.createElement("span");
    b.className = `badge run-badge verdict-${name}`;
    b.textContent = `${GLYPH[name] || ""} ${n} ${name}`.trim();
    span.append(b);
  }
  return span;
}

// The loss sparkline: an inline SVG polyline (a chart library per row would not
// survive a page of hundreds of rows), scaled to its own min and max.
const SVG = "http://www.w3.org/2000/svg";
const SPARK_W = 96;
const SPARK_H = 20;

function sparkline(values) {
  const losses = (values || []).filter((v) => typeof v === "number" && Number.isFinite(v));
  if (losses.length === 0) return "–";
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", SPARK_W);
  svg.setAttribute("height", SPARK_H);
  svg.setAttribute("viewBox", `0 0 ${SPARK_W} ${SPARK_H}`);
  svg.setAttribute("role", "img");
  const first = losses[0].toPrecision(3);
  const last = losses[losses.length - 1].toPrecision(3);
  svg.setAttribute("aria-label", `loss ${first} to ${last} over the last ${losses.length} points`);
  const lo = Math.min(...losses);
  const span = Math.max(...losses) - lo || 1;
  const dx = losses.length > 1 ? (SPARK_W - 2) / (losses.length - 1) : 0;
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "currentColor");
  line.setAttribute("stroke-width", "1.5");
  line.setAttribute("points", losses.map((v, i) => `${(1 + i * dx).toFixed(1)},${(SPARK_H - 2 - ((v - lo) / span) * (SPARK_H - 4)).toFixed(1)}`).join(" "));
  svg.append(line);
  const title = document.createElementNS(SVG, "title");
  title.textContent = `loss ${first} → ${last}`;
  svg.prepend(title);
  return svg;
}

// The newest loss as a number, its recent course as the sparkline beside it.
function loss(r) {
  const spark = sparkline(r.loss_spark);
  if (typeof r.loss !== "number" || !Number.isFinite(r.loss)) return spark;
  const span = document.createElement("span");
  span.className = "run-loss";
  const value = document.createElement("span");
  value.className = "run-loss-value";
  // As the rank table writes a loss.
  value.textContent = formatFixed(r.loss, 4);
  span.append(value, " ", spark);
  return span;
}

// Slurm's view of the run (RANKWATCH_SLURM): its job's state, the reason it waits, its nodes, the time left.
function slurmText(s) {
  if (!s) return "–";
  const state = s.state.toLowerCase();
  let text = `job ${s.job_id}: ${state}`;
  if (s.reason) text += ` (${s.reason})`;
  if (s.nodes) text += ` on ${s.nodes}`;
  if (typeof s.time_left_s === "number") text += `, ${formatSeconds(s.time_left_s)} left`;
  if (s.restart_count) text += `, restart ${s.restart_count}`;
  return text;
}

// The run's goodput (app/run/goodput.py) and its restarts, as the run page says them.
// A run rankwatch launch gave up on says so (the cell's title says why).
function goodput(r) {
  const ratio = r.goodput == null ? "–" : `${(r.goodput * 100).toFixed(1)}%`;
  // Automatic restarts only: a relaunch by hand after a stop is not a fault (the run page says both).
  const text = r.automatic_restarts ? `${ratio} · ${plural(r.automatic_restarts, "automatic restart")}` : ratio;
  if (!r.gave_up) return text;
  const span = document.createElement("span");
  span.className = "run-gave-up";
  span.title = r.gave_up;
  span.textContent = `⚠ ${text} · launch gave up`;
  return span;
}

function row(r, now) {
  const tr = document.createElement("tr");
  tr.dataset.run = r.id;
  tr.dataset.state = r.state;
  if (r.needs_attention) tr.dataset.attention = "";
  const a = document.createElement("a");
  a.href = r.url;
  a.textContent = r.id;
  let id = a;
  if (r.lookalike) {
    // Two directories whose names differ only in Unicode form (NFC, NFD): show the escaped id.
    id = document.createElement("span");
    const warn = document.createElement("span");
    warn.className = "run-lookalike";
    warn.textContent = ` ⚠ ${r.lookalike.escaped}`;
    warn.title = `Looks like ${r.lookalike.others.map((o) => JSON.stringify(o)).join(", ")}: another directory with the same letters in another Unicode form`;
    id.append(a, warn);
  }
  tr.append(
    cell("id", id),
    cell("state", (r.needs_attention ? `⚠ ${r.state}` : (r.status_message || "").startsWith("not read yet") ? "idle (not read yet)" : r.state)
      + (r.spike_open?.length ? ` · loss ${r.spike_open.join(", ")}` : "")
      + (r.rollbacks ? ` · ${r.rollbacks} rollback${r.rollbacks === 1 ? "" : "s"}` : "")
      + (r.slurm_stop ? " · ⚠ stop longer than Slurm's KillWait" : ""), r.slurm_stop),
    cell("world", r.hosts > 1 ? `${r.world_size} on ${r.hosts} hosts` : String(r.world_size ?? "–")),
    cell("step", r.global_step == null ? "–" : r.global_step.toLocaleString()),
    cell("loss", loss(r)),
    cell("health", verdicts(r.health_counts || {})),
    cell("ckpt", r.newest_complete_set ? `step ${r.newest_complete_set.global_step ?? "?"}` : "–"),
    cell("goodput", goodput(r)),
    cell("disk", r.disk_bytes == null ? "–" : `${r.disk_truncated ? "≥ " : ""}${formatBytes(r.disk_bytes)}`),
    cell("stop", r.last_stop ? `${r.last_stop.state}, by ${r.last_stop.requested_by || "?"} at ${formatClock(r.last_stop.requested_at)}` : "–"),
    cell("activity", r.last_activity == null ? "–" : `${formatSeconds(Math.max(0, now - r.last_activity))} ago`),
  );
  if ("scheduler" in r) {
    tr.append(cell("slurm", slurmText(r.scheduler)));
    if (r.scheduler) tr.dataset.slurm = r.scheduler.state.toLowerCase();
  }
  return tr;
}

async function load() {
  const params = new URLSearchParams({ page: view.page, per_page: config.per_page, sort: view.sort });
  if (view.state) params.set("state", view.state);
  if (view.q) params.set("q", view.q);
  try {
    const r = await fetch(`${config.api}?${params}`, { headers: { Accept: "application/json" } });
    const data = await r.json();
    if (!r.ok) throw new Error(data.error || `HTTP ${r.status}`);
    const now = Date.now() / 1000;
    body.replaceChildren(...data.runs.map((x) => row(x, now)));
    // The Slurm column is there when the dashboard asks Slurm (RANKWATCH_SLURM).
    slurmHead.hidden = !data.runs.some((x) => "scheduler" in x);
    pages = data.pages;
    empty.hidden = data.runs.length > 0;
    pageLabel.textContent = `page ${data.page} of ${data.pages}`;
    const unread = data.unread ? `; ${data.unread} idle not read yet (read in the background, shown as they are)` : "";
    summary.textContent = `${data.total} run${data.total === 1 ? "" : "s"}, ${data.needs_attention} need${data.needs_attention === 1 ? "s" : ""} attention${unread}`;
  } catch (err) {
    summary.textContent = `runs unavailable: ${err.message}`;
  }
  clearTimeout(timer);
  timer = setTimeout(load, REFRESH_MS);
}

stateSelect.addEventListener("change", () => { view.state = stateSelect.value; view.page = 1; load(); });
search.addEventListener("input", () => { view.q = search.value.trim(); view.page = 1; load(); });
document.getElementById("runs-tools").addEventListener("submit", (e) => e.preventDefault());
document.getElementById("runs-prev").addEventListener("click", () => { if (view.page > 1) { view.page -= 1; load(); } });
document.getElementById("runs-next").addEventListener("click", () => { if (view.page < pages) { view.page += 1; load(); } });
for (const button of document.querySelectorAll("#runs-table th button")) {
  button.addEventListener("click", () => {
    const key = button.dataset.sort;
    view.sort = view.sort === key ? `-${key}` : key;
    for (const th of document.querySelectorAll("#runs-table th")) th.setAttribute("aria-sort", "none");
    button.parentElement.setAttribute("aria-sort", view.sort.startsWith("-") ? "descending" : "ascending");
    load();
  });
}
load();

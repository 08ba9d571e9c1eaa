// Loss spikes and rollbacks, from /api/spikes (app/incidents/spikes.py): the run page's
// section (each detection, and each line of rankwatch/rollbacks.jsonl: when, why, from
// where to where, what was skipped), and the marks the loss chart draws at their steps.

import { $ } from "./dom.js";
import { formatClock, formatCount, plural } from "./format.js";

const POLL_MS = 5000;

const value = (v) => (typeof v === "number" ? v.toPrecision(5) : ({ nan: "NaN", inf: "Inf", "-inf": "-Inf" }[v] ?? "?"));

// The evidence in one line: rule, rank, step, value and the level it was judged against.
export function evidenceText(d) {
  const level = typeof d.level === "number" ? `, level ${d.level.toPrecision(5)}` : "";
  const ranks = d.ranks > 1 ? ` (${d.ranks} ranks)` : "";
  return `${d.rule}: rank ${d.rank}, step ${formatCount(d.step)}, ${value(d.value)}${level}${ranks}`;
}

function lineText(ln) {
  const to = ln.target_step === null || ln.target_step === undefined
    ? "no healthy set to roll back to"
    : `to the set at step ${formatCount(ln.target_step)}${ln.target_set ? ` (${ln.target_set})` : ""}`;
  const skip = ln.skip_batches ? `, skipping ${plural(ln.skip_batches, "batch", "batches")}` : "";
  return `${formatClock(ln.at, true)} · ${ln.kind} · ${ln.rule} from step ${formatCount(ln.first_step)} `
    + `${to}${skip}${ln.rung > 1 ? ` · rung ${ln.rung}` : ""}${ln.note ? ` · ${ln.note}` : ""}`;
}

export class Rollbacks {
  constructor(url, onMarks) {
    this.url = url;
    this.onMarks = onMarks;
    this.list = $("#rollbacks-list");
    this.note = $("#rollbacks-note");
    this.last = "";
    if (!url) return;
    this.load();
    setInterval(() => { if (!document.hidden) this.load(); }, POLL_MS);
  }

  async load() {
    let body;
    try {
      const r = await fetch(this.url);
      body = await r.json();
      if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
    } catch (err) {
      console.error("rankwatch: loss spikes unavailable:", err);
      return;
    }
    const key = JSON.stringify([body.marks, body.rollbacks, body.policy, body.supervisor_error]);
    if (key === this.last) return;
    this.last = key;
    if (this.onMarks) this.onMarks(Array.isArray(body.marks) ? body.marks : []);
    this.render(body);
  }

  render(body) {
    if (!this.list) return;
    const marks = Array.isArray(body.marks) ? body.marks : [];
    const lines = Array.isArray(body.rollbacks) ? body.rollbacks : [];
    const items = [];
    for (const d of marks) {
      const li = document.createElement("li");
      li.dataset.rule = d.rule;
      li.dataset.acts = String(Boolean(d.acts));
      li.textContent = `${formatClock(d.at, true)} · ${evidenceText(d)} · ${d.text}`;
      items.push(li);
    }
    for (const ln of lines) {
      const li = document.createElement("li");
      li.dataset.kind = ln.kind;
      li.dataset.rule = ln.rule;
      li.textContent = lineText(ln);
      items.push(li);
    }
    if (!items.length) {
      const li = document.createElement("li");
      li.className = "muted";
      li.textContent = "No loss spike or NaN seen.";
      items.push(li);
    }
    this.list.replaceChildren(...items);
    const p = body.policy || {};
    const problems = [p.error, body.norms_error, body.supervisor_error].filter(Boolean).join("; ");
    if (this.note) this.note.dataset.mode = p.mode || "";
    if (problems && this.note) this.note.textContent = problems;
  }
}

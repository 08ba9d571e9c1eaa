// The attempts timeline: each launch of the job in this run directory, from
// /api/attempts (app/ranks/attempts.py), oldest first. A human stop, a policy stop,
// a crash and a kill each read (and look) different: data-end and
// data-stop-by carry the kind for the stylesheet and for tests.

import { $ } from "./dom.js";
import { formatClock, formatCount, plural } from "./format.js";

const POLL_MS = 5000;

function steps(a) {
  const first = a.first_step;
  const last = a.last_step;
  if (last === null || last === undefined) return `from global step ${formatCount(first)}`;
  if (last < first) return "no step trained";
  return `global steps ${formatCount(first)}–${formatCount(last)}`;
}

// Why the attempt ended, in words: who stopped it, or that it crashed.
export function endText(a) {
  switch (a.end) {
    case null: case undefined: return "running";
    case "graceful_stop": {
      const req = a.request_id ? ` (request ${a.request_id})` : "";
      if (a.stop_by === "policy") return `stopped by the stop policy${req}`;
      if (a.stop_by === "sigterm") return "stopped on SIGTERM";
      return `stopped by ${a.requested_by || "an operator"}${req}`;
    }
    case "finished": return "finished";
    case "failed": return `crashed: ${a.error || "a rank failed"}`;
    case "killed": return "killed: its ranks vanished without a word";
    default: return "ended, how is unknown";
  }
}

// The cause rankwatch launch recorded (a crash's rank, signal or status, error line).
export function causeText(c) {
  if (c && c.kind === "rollback") return rollbackText(c);
  if (c && c.kind === "preempted") {
    const left = typeof c.time_left_s === "number" ? `, ${Math.round(c.time_left_s)} s left` : "";
    return `preempted by the scheduler (${c.signal || "a signal"}${left}): saved and stopped gracefully`;
  }
  if (c && c.kind === "hang") {
    // The hang rule (app/supervise/hang.py): its error says how long, why, and the stack capture.
    return `rank ${c.rank}${c.host ? ` on ${c.host}` : ""} hung: ${c.error || "stalled"}`;
  }
  if (!c || c.kind !== "crash") return "";
  const who = c.role === "worker" ? `rank ${c.rank}` : (c.role || "a process");
  const how = c.signal ? `killed by ${c.signal}` : `exit status ${c.exit_code}`;
  const where = c.host ? ` on ${c.host}` : "";
  return `${who}${where} ${how}${c.error ? `: ${c.error}` : ""}`;
}

// A loss-spike rollback (rankwatch launch, issue 34): the rule, the evidence, from where to where.
function rollbackText(c) {
  let text = `loss-spike rollback (${c.rule || "?"}${c.rung > 1 ? `, rung ${c.rung}` : ""})`;
  if (c.evidence) text += `: ${c.evidence}`;
  if (typeof c.from_step === "number") text += `; from global step ${formatCount(c.from_step)}`;
  if (typeof c.to_step === "number") text += ` back to global step ${formatCount(c.to_step)} (set ${c.to_set || "?"})`;
  if (typeof c.skip_batches === "number") text += `, ${plural(c.skip_batches, "batch", "batches")} skipped past it`;
  return text;
}

// The batch scheduler an attempt ran under (rankwatch launch's record of Slurm's variables).
export function schedulerText(s) {
  if (!s || s.kind !== "slurm") return "";
  const task = s.array_task_id ? `_${s.array_task_id}` : "";
  const where = [s.partition ? `partition ${s.partition}` : "", s.nodelist ? `on ${s.nodelist}` : ""]
    .filter(Boolean).join(" ");
  return `Slurm job ${s.job_id}${task}${s.restart_count ? ` (requeued, restart ${s.restart_count})` : ""}`
    + `${where ? `, ${where}` : ""}`;
}

// The downtime of a restart, in its parts (seconds).
function downtimeText(d) {
  const s = (v) => (typeof v === "number" ? `${v.toFixed(1)} s` : "?");
  let text = `down ${s(d.total_s)}: detected ${s(d.fault_to_detected_s)}, ended ${s(d.detected_to_ended_s)}, `
    + `relaunched ${s(d.ended_to_relaunched_s)}`;
  if (typeof d.relaunched_to_bridge_start_s === "number") text += `, bridge started ${s(d.relaunched_to_bridge_start_s)} later`;
  return text;
}

// The words are app/run/goodput.py's (text and detail in the answer), as the terminal says them.
export function goodputText(g) {
  return g.detail ? `${g.text} (${g.detail})` : g.text;
}

export class Attempts {
  constructor(url) {
    this.url = url;
    this.list = $("#attempts-list");
    this.note = $("#attempts-note");
    // What the note says when nothing is wrong (the template's words and markup).
    this.intro = this.note ? [...this.note.childNodes].map((n) => n.cloneNode(true)) : [];
    this.last = "";
    if (!this.list || !url) return;
    this.load();
    setInterval(() => { if (!document.hidden) this.load(); }, POLL_MS);
  }

  async load() {
    if (!this.list || !this.url) return;
    let body;
    try {
      const r = await fetch(this.url);
      body = await r.json();
      if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
    } catch (err) {
      this.say(`Attempts unavailable: ${err.message}`);
      return;
    }
    // Said on every answer, not only when the list changed: an error from while the
    // dashboard was away must go when it answers again, though the list is the same.
    const notes = [];
    if (body.error) notes.push(body.error);
    if (body.skipped_lines) notes.push(`${plural(body.skipped_lines, "line")} of attempts.jsonl skipped as invalid`);
    // A second launch into this run directory, turned away by its rank 0: its own logs are elsewhere.
    for (const r of Array.isArray(body.refused) ? body.refused : []) {
      const when = new Date(r.at * 1000).toLocaleString();
      notes.push(`A second launch into this run directory was refused at ${when} (pid ${r.pid} on ${r.host}): ${r.reason}`);
    }
    // Under Slurm, a preemption's stop that would not fit in KillWait: said before it happens.
    const fit = body.slurm_stop;
    if (fit && fit.fits === false) notes.push(`⚠ Slurm job ${fit.job_id}: ${fit.text}`);
    this.say(notes.join("; "));
    const key = JSON.stringify(body);
    if (key === this.last) return;
    this.last = key;
    this.render(body);
  }

  // A problem in the note, or (text "") the template's words back.
  say(text) {
    if (text) {
      if (this.note.textContent !== text) this.note.textContent = text;
      this.note.dataset.problem = "";
    } else if ("problem" in this.note.dataset) {
      this.note.replaceChildren(...this.intro.map((n) => n.cloneNode(true)));
      delete this.note.dataset.problem;
    }
  }

  render(body) {
    this.goodput(body.goodput);
    const rows = Array.isArray(body.attempts) ? body.attempts : [];
    if (!rows.length) {
      const li = document.createElement("li");
      li.className = "muted";
      li.textContent = "No attempt recorded yet.";
      this.list.replaceChildren(li);
    } else {
      this.list.replaceChildren(...rows.map((a) => this.item(a)));
    }
  }

  // The run's goodput, restarts and steps lost (app/run/goodput.py), above the timeline.
  goodput(g) {
    const p = $("#attempts-goodput");
    if (!p) return;
    if (!g || !g.restarts && g.goodput == null) {
      p.hidden = true;
      return;
    }
    p.hidden = false;
    p.dataset.goodput = g.goodput == null ? "" : String(g.goodput);
    p.textContent = goodputText(g);
    // The supervisor gave up: the run needs a person.
    if (g.gave_up) {
      p.dataset.gaveUp = "";
      p.textContent += ` · ⚠ ${g.gave_up}`;
    } else {
      delete p.dataset.gaveUp;
    }
  }

  item(a) {
    const li = document.createElement("li");
    li.dataset.attempt = a.attempt;
    li.dataset.end = a.end || "running";
    if (a.stop_by) li.dataset.stopBy = a.stop_by;
    const hosts = Array.isArray(a.hosts) ? a.hosts.join(", ") : "";
    const head = document.createElement("span");
    head.textContent = `Attempt ${a.attempt} · started ${formatClock(a.started_at, true)} · `
      + `${plural(a.world_size, "rank")} on ${hosts || "?"} · ${a.resumed_text} · ${steps(a)}`;
    // The set's id only where it is asked for: a newcomer reads the step.
    if (a.resumed_from && a.resumed_from.set) head.title = `Resumed from the checkpoint set ${a.resumed_from.set}`;
    li.append(head);
    if (Array.isArray(a.replayed)) {
      const replay = document.createElement("span");
      replay.className = "attempt-replay";
      replay.textContent = ` · trained global steps ${formatCount(a.replayed[0])}–${formatCount(a.replayed[1])} `
        + "again (a branch: it resumed from an older set)";
      li.append(replay);
    }
    if (Array.isArray(a.skipped)) {
      const skip = document.createElement("span");
      skip.className = "attempt-skipped";
      skip.textContent = ` · skipped the batches of global steps ${formatCount(a.skipped[0])}–`
        + `${formatCount(a.skipped[1])}, untrained (a loss-spike rollback)`;
      li.append(skip);
    }
    const end = document.createElement("span");
    end.className = "attempt-end";
    const when = a.ended_at ? ` at ${formatClock(a.ended_at)}` : "";
    end.textContent = ` · ${endText(a)}${a.end ? when : ""}`;
    li.append(end);
    if (a.cause) {
      li.dataset.cause = a.cause.kind;
      const cause = document.createElement("span");
      cause.className = "attempt-cause";
      const said = causeText(a.cause);
      cause.textContent = said ? ` · cause: ${said}` : "";
      if (a.restarted_by === "launch") {
        cause.textContent += " · relaunched by rankwatch launch";
        if (a.downtime) cause.textContent += ` (${downtimeText(a.downtime)})`;
      } else if (a.supervisor && a.supervisor.note) {
        cause.textContent += ` · ${a.supervisor.note}`;
      }
      li.append(cause);
    }
    const sched = schedulerText(a.supervisor && a.supervisor.scheduler);
    if (sched) {
      li.dataset.scheduler = a.supervisor.scheduler.kind;
      const span = document.createElement("span");
      span.className = "attempt-scheduler";
      span.textContent = ` · ${sched}`;
      li.append(span);
    }
    if (a.note) {
      // Log mode: msrun emptied this attempt's worker logs when it relaunched the job.
      const note = document.createElement("span");
      note.className = "attempt-note";
      note.textContent = ` · ${a.note}`;
      li.append(note);
    }
    if (a.inferred || a.sealed_by) {
      li.title = a.inferred || `no end line of its own: attempt ${a.sealed_by} judged it from its ranks' heartbeats`;
    }
    return li;
  }
}

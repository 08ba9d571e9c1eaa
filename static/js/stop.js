// The Stop gracefully button, its dialog, the per-rank lifecycle and the
// audit trail. The server pushes `stop_status` (README, "Socket.IO events");
// actions go through operatorFetch with the token.

import { LOGIN, api } from "./base.js";
import { SEL, $ } from "./dom.js";
import { formatBytes, formatClock, formatFixed, formatNumber, formatSeconds, isNumber } from "./format.js";
import { token, checkToken, operatorFetch } from "./token.js";

const STAGES = ["requested", "seen", "agreed", "saving", "saved", "exited"];
// Above this many ranks the table lists only the ranks still on their way.
const MAX_RANK_ROWS = 64;

const HEADLINE = {
  // With no job (no run directory, nothing started yet, or ended) there is nothing that "trains until it ends".
  idle: (s, run) => (run && ["running", "starting"].includes(run.status)
    ? "No stop requested. The job trains until it ends or you press Stop gracefully."
    : "No stop requested.") + lastStop(s.last_stop),
  requested: () => "Stop requested: waiting for the ranks to read the flag.",
  stopping: (s) => (s.stop_step != null
    ? `Stopping after step ${s.stop_step}: ranks are saving and exiting.`
    : "Stopping: the ranks are agreeing on the step to stop after."),
  completed: (s) => `Stopped: ${s.summary}.`,
  cancelled: () => "The stop request was cancelled before any rank agreed; training goes on.",
  not_obeyed: (s) => `The stop was ${s.summary}. The flag is re-armed, so relaunching the job trains.`,
  rearmed: (s) => (s.summary
    ? `Last stop: ${s.summary}. The stop flag is cleared, so relaunching the job trains normally.`
    : "The stop flag is cleared; relaunching the job trains normally."),
};

// What a tab whose token the server refused shows (a relaunched dashboard has a
// new token; docs/security.md says why it does not keep the old one).
const STALE_TEXT = `read-only: open a new login link (\`${LOGIN}\`)`;

// The stop an earlier launch of this run obeyed: one line under "No stop requested".
function lastStop(last) {
  const l = object(last);
  if (!l) return "";
  return ` Last stop: ${l.outcome || "completed"}, requested ${formatClock(l.requested_at)}`
    + (l.requested_by ? ` by ${l.requested_by}` : "")
    + (Number.isInteger(l.attempt) ? `, attempt ${l.attempt}.` : ", by an earlier launch of this run.");
}

// Who did an audited action, in plain words (the API's basis, README "Audit trail").
function basisText(a) {
  if (a.basis === "observed") return "seen in the run directory";
  if (a.basis === "policy") return "stop policy";
  const from = typeof a.remote_addr === "string" ? a.remote_addr : "";
  if (from.startsWith("shell ")) return `from the shell (user ${from.slice(6)})`;
  return a.who === "policy" ? "stop policy" : "operator token";
}

function text(el, value) {
  el.textContent = value;
}

// The status comes from the ranks' files: every field may hold anything, so
// nothing below calls a method on a field without checking its type first.
function list(v) {
  return Array.isArray(v) ? v : [];
}

function object(v) {
  return v && typeof v === "object" && !Array.isArray(v) ? v : null;
}

function cell(row, value, cls) {
  const td = row.insertCell();
  td.textContent = value === null || value === undefined ? "–" : (typeof value === "object" ? "?" : String(value));
  if (cls) td.className = cls;
  return td;
}

// Ranks shown only from msrun's worker logs report no stop stages: say whether
// their script can obey the flag at all (README, "Log mode").
function logNote(logs) {
  // The server words it (rankwatch stop prints the same sentence).
  if (typeof logs.note === "string") return logs.note;
  const who = `${logs.ranks} rank${logs.ranks === 1 ? " is" : "s are"} shown only from msrun's worker logs`;
  if (logs.on_request_exit) {
    return `${who}; their logs show OnRequestExit at work ("${logs.on_request_exit}"), so the script obeys `
      + "the flag, but Rankwatch cannot follow its stop stages or checkpoints.";
  }
  return `${who}, and nothing in them shows that the script uses OnRequestExit: it may ignore the flag. `
    + "Stop gracefully still writes RUN/graceful_exit.json; for a script that is sure to stop, add the "
    + "Rankwatch bridge (or OnRequestExit(config_file=RUN/graceful_exit.json) with MS_ENABLE_GRACEFUL_EXIT=1 "
    + "on Ascend or in one process).";
}

export class StopControls {
  // `store` (store.js) holds the status for the header too; onStatus() runs after each new one.
  constructor(socket, store = { stop: null }) {
    this.store = store;
    this.onStatus = () => {};
    this.busy = false;
    // The run's status (from the rank events): an ended job has nothing to stop.
    this.run = null;
    this.bind();
    const followRun = (msg) => {
      if (!msg.run || msg.run.status === this.run?.status) return;
      const before = this.run;
      this.run = msg.run;
      this.renderOperator();
      this.render();
      // The job ended or began: the stop it ends with is news too; take it now rather than
      // show the last pushed stage beside a header that already says the job ended.
      if (before) this.refresh();
    };
    socket.on("ranks_snapshot", followRun);
    socket.on("ranks_delta", followRun);
    socket.on("stop_status", (status) => this.take(status));
    window.addEventListener("rankwatch-token", () => this.renderOperator());
    window.addEventListener("rankwatch-login-failed", (e) => this.openToken(`The login link did not work: ${e.detail}`));
    socket.on("connect", () => token.recheck());
    token.follow();
    this.renderOperator();
    this.loadAudit();
    setInterval(() => this.renderTimes(), 1000);
  }

  get status() {
    return this.store.stop;
  }

  set status(value) {
    this.store.stop = value;
  }

  take(status) {
    this.status = status;
    this.render();
    this.onStatus();
    this.loadAudit();
  }

  async refresh() {
    try {
      const r = await fetch(api("/api/exit"));
      if (r.ok) this.take(await r.json());
    } catch {
      // the next push brings it
    }
  }

  bind() {
    $(SEL.tokenOpen).addEventListener("click", () => this.openToken());
    $(SEL.tokenDismiss).addEventListener("click", () => $(SEL.tokenDialog).close());
    $(SEL.tokenForget).addEventListener("click", () => {
      token.clear();
      $(SEL.tokenDialog).close();
    });
    $(SEL.tokenForm).addEventListener("submit", (e) => {
      e.preventDefault();
      this.saveToken();
    });
    $(SEL.stopOpen).addEventListener("click", () => this.openStop());
    $(SEL.stopDismiss).addEventListener("click", () => $(SEL.stopDialog).close());
    $(SEL.stopReason).addEventListener("input", () => this.renderConfirm());
    $(SEL.stopForm).addEventListener("submit", (e) => {
      e.preventDefault();
      this.confirmStop();
    });
    $(SEL.stopCancel).addEventListener("click", () => this.act(api("/api/exit/cancel"), "Cancel the stop request?"));
    $(SEL.stopRearm).addEventListener("click", () => this.rearm());
  }

  // -- the token ---------------------------------------------------------------
  renderOperator() {
    const has = Boolean(token.get());
    const stale = !has && token.stale();
    const state = $(SEL.operatorState);
    state.dataset.state = has ? "operator" : stale ? "stale" : "read-only";
    text(state, has ? "operator" : stale ? STALE_TEXT : "read-only");
    text($(SEL.tokenOpen), has ? "Token…" : "Enter operator token");
    const stop = $(SEL.stopOpen);
    // Only a proven end (every rank's process gone) disables Stop: files alone can be forged.
    const ended = this.run?.status === "ended" && this.run?.proven !== false;
    stop.disabled = !has || ended;
    stop.dataset.why = ended ? "ended" : has ? "" : "read-only";
    // Why it is disabled is in its text, not only in a tooltip.
    text(stop, ended ? "Stop gracefully (job ended)" : has ? "Stop gracefully"
      : stale ? "Stop gracefully (needs a new login link)" : "Stop gracefully (needs the token)");
    if (ended) stop.title = `Nothing to stop: ${this.run.message} Relaunch the job to train again.`;
    else if (has && this.run?.status === "ended") stop.title = `Warning: ${this.run.message}`;
    else stop.title = has ? "Every rank saves a checkpoint at the same step, then exits"
      : "Read-only: enter the operator token to stop the job";
    $(SEL.tokenForget).hidden = !has;
    this.renderButtons();
  }

  openToken(problem = null) {
    $(SEL.tokenError).hidden = !problem;
    text($(SEL.tokenError), problem || "");
    $(SEL.tokenInput).value = "";
    $(SEL.tokenDialog).showModal();
    $(SEL.tokenInput).focus();
  }

  async saveToken() {
    const value = $(SEL.tokenInput).value.trim();
    const error = $(SEL.tokenError);
    try {
      if (!(await checkToken(value))) {
        error.hidden = false;
        text(error, "That is not the operator token.");
        return;
      }
    } catch (err) {
      error.hidden = false;
      text(error, `Could not check the token: ${err.message}`);
      return;
    }
    token.set(value);
    $(SEL.tokenDialog).close();
  }

  // -- the stop dialog ---------------------------------------------------------
  async openStop() {
    $(SEL.stopError).hidden = true;
    $(SEL.stopReason).value = "";
    this.busy = false;
    this.renderConfirm();
    $(SEL.stopDialog).showModal();
    $(SEL.stopReason).focus();
    try {
      const r = await fetch(api("/api/exit"));
      const s = await r.json();
      const est = s.estimate || {};
      text($(SEL.estimateRanks), est.ranks ?? "–");
      text($(SEL.estimateSeconds), est.seconds != null ? `about ${formatSeconds(est.seconds)}` : "unknown (no rank reports yet)");
      text($(SEL.estimateDir), `${est.checkpoint_dir || "?"} in the run directory`);
      text($(SEL.estimateBasis), est.basis ? `Estimate: ${est.basis}.` : "");
    } catch (err) {
      text($(SEL.estimateBasis), `No estimate: ${err.message}`);
    }
  }

  renderConfirm() {
    $(SEL.stopConfirm).disabled = this.busy || !$(SEL.stopReason).value.trim();
  }

  async confirmStop() {
    if (this.busy) return; // a double click sends one request
    this.busy = true;
    this.renderConfirm();
    const body = { reason: $(SEL.stopReason).value.trim() };
    const who = $(SEL.stopWho).value.trim();
    if (who) body.who = who;
    const res = await operatorFetch(api("/api/exit"), body);
    if (res.ok) {
      $(SEL.stopDialog).close();
      this.loadAudit();
      return;
    }
    this.busy = false;
    this.renderConfirm();
    const error = $(SEL.stopError);
    error.hidden = false;
    text(error, res.status === 401 ? `${STALE_TEXT}: this tab's operator session has ended.` : res.body.error);
  }

  async act(url, question, extra = {}) {
    if (!window.confirm(question)) return;
    const res = await operatorFetch(url, { ...extra });
    if (!res.ok) window.alert(res.body.error);
    this.loadAudit();
  }

  rearm() {
    const s = this.status || {};
    // A job that ended without obeying has nothing left to stop: no force needed.
    const force = !["completed", "not_obeyed"].includes(s.state);
    const question = force
      ? "Not every rank has exited. Clear the stop flag anyway? Ranks that have not stopped will train on."
      : "Clear the stop flag, so that a relaunch trains instead of stopping?";
    this.act(api("/api/exit/rearm"), question, force ? { force: true } : {});
  }

  // -- the lifecycle -------------------------------------------------------------
  render() {
    const s = this.status;
    if (!s) return;
    $(SEL.stopPanel).dataset.state = s.state;
    text($(SEL.stopHeadline), (HEADLINE[s.state] || HEADLINE.idle)(s, this.run));
    this.renderNote(s);
    this.renderRequest(s.request);
    this.renderStages(s);
    this.renderRanks(s);
    this.renderButtons();
  }

  renderNote(s) {
    const notes = [];
    if (s.flag_error) notes.push(`The flag file is unreadable (${s.flag_error}); no rank will stop because of it.`);
    // While the bridge may still send its first heartbeat (compiling), a warning would be premature.
    if (s.logs && !s.logs.heartbeats_expected) notes.push(logNote(s.logs));
    if (s.request && !s.bridge_seen && !s.logs) {
      notes.push("No rank of this run reports through the Rankwatch bridge. The flag is in MindSpore's "
        + "own format, so a script using OnRequestExit(config_file=RUN/graceful_exit.json) with "
        + "MS_ENABLE_GRACEFUL_EXIT=1 stops on it, but Rankwatch cannot see when it stops or what it "
        + "saves: look for rank_*/<name>_train.ckpt in the checkpoint browser.");
    }
    if (list(s.late).length) {
      notes.push(`Late: rank ${list(s.late).join(", ")} has been in one stage longer than ${formatSeconds(s.deadline_s)}.`);
    }
    const note = $(SEL.stopNote);
    note.hidden = !notes.length;
    text(note, notes.join(" "));
  }

  renderRequest(request) {
    const req = object(request);
    $(SEL.stopRequest).hidden = !req;
    if (!req) return;
    text($(SEL.stopRequestId), req.request_id ? String(req.request_id) : "(no id: a bare native flag)");
    text($(SEL.stopRequestBy), req.requested_by ? String(req.requested_by) : "–");
    text($(SEL.stopRequestReason), req.reason ? String(req.reason) : "–");
    text($(SEL.stopRequestAt), formatClock(req.requested_at));
  }

  renderStages(s) {
    const stages = $(SEL.stopStages);
    const ranks = list(s.ranks).filter(object);
    stages.hidden = !ranks.length || !s.request;
    stages.replaceChildren();
    const counts = Object.fromEntries(STAGES.map((st) => [st, 0]));
    for (const r of ranks) if (STAGES.includes(r.stage)) counts[r.stage] += 1;
    for (const stage of STAGES) {
      const li = document.createElement("li");
      li.className = "stage";
      li.dataset.stage = stage;
      li.dataset.count = counts[stage];
      li.textContent = `${stage} ${counts[stage]}`;
      stages.append(li);
    }
    const holding = $(SEL.stopHolding);
    const waiting = list(s.holding_up);
    holding.hidden = !waiting.length;
    if (waiting.length) {
      const stage = ranks.find((r) => r.rank === waiting[0])?.stage;
      const names = waiting.slice(0, 20).join(", ") + (waiting.length > 20 ? ` and ${waiting.length - 20} more` : "");
      text(holding, `Holding the others up: rank ${names} (still at "${stage}").`);
    }
  }

  renderRanks(s) {
    const wrap = $(SEL.stopRanksWrap);
    const ranks = list(s.ranks).filter(object);
    wrap.hidden = !ranks.length || !s.request;
    const order = Object.fromEntries(STAGES.map((st, i) => [st, i]));
    const rows = [...ranks].sort((a, b) => (order[a.stage] ?? 0) - (order[b.stage] ?? 0)
      || (isNumber(a.rank) && isNumber(b.rank) ? a.rank - b.rank : 0));
    const shown = rows.length > MAX_RANK_ROWS ? rows.filter((r) => r.stage !== "exited").slice(0, MAX_RANK_ROWS) : rows;
    const requestedAt = object(s.request)?.requested_at;
    const body = $(SEL.stopRanksBody);
    body.replaceChildren();
    for (const r of shown) {
      const tr = body.insertRow();
      tr.dataset.rank = r.rank;
      tr.dataset.stage = r.stage;
      if (r.late) tr.classList.add("late");
      const stageName = STAGES.includes(r.stage) ? r.stage : "requested";
      cell(tr, r.rank);
      cell(tr, r.late ? `${stageName} (late)` : stageName, `stage-cell stage-${stageName}`);
      const since = cell(tr, "", "in-stage");
      since.dataset.since = stageName === "exited" || !isNumber(r.stage_since) ? "" : r.stage_since;
      const at = object(r.at) || {};
      for (const stage of STAGES.slice(1)) {
        const t = at[stage];
        // A rank told by the vote never "saw" the flag itself: say so.
        const fallback = stage === "seen" && at.agreed ? "via vote" : null;
        cell(tr, isNumber(t) && isNumber(requestedAt) ? `+${formatFixed(t - requestedAt, 2)}` : fallback,
          `at-${stage}`).dataset.stage = stage;
      }
      cell(tr, r.seen_step == null ? null : formatNumber(r.seen_step));
      cell(tr, r.stop_step == null ? null : formatNumber(r.stop_step));
      const checkpoint = object(r.checkpoint);
      cell(tr, checkpoint?.path || r.error);
      cell(tr, checkpoint ? formatBytes(checkpoint.bytes) : null);
      cell(tr, checkpoint ? formatFixed(checkpoint.seconds, 2) : null);
    }
    const more = $(SEL.stopRanksMore);
    more.hidden = shown.length === rows.length;
    text(more, `Showing ${shown.length} of ${rows.length} ranks: those not yet exited.`);
    this.renderTimes();
  }

  renderTimes() {
    const now = Date.now() / 1000;
    for (const td of document.querySelectorAll(`${SEL.stopRanksBody} td.in-stage`)) {
      const since = Number(td.dataset.since);
      td.textContent = td.dataset.since && Number.isFinite(since) ? formatSeconds(Math.max(0, now - since)) : "–";
    }
  }

  renderButtons() {
    const s = this.status || {};
    const has = Boolean(token.get());
    $(SEL.stopCancel).hidden = !(has && s.can_cancel);
    // Mid-stop, clearing the flag is a way out only for ranks that are late, not a
    // step of a normal stop; after a stop the job ignored, it is the way to clear it.
    $(SEL.stopRearm).hidden = !(has && s.can_rearm
      && (["completed", "not_obeyed"].includes(s.state) || (s.state === "stopping" && list(s.late).length > 0)));
  }

  // -- the audit trail -----------------------------------------------------------
  async loadAudit() {
    let rows;
    try {
      const r = await fetch(api("/api/audit?limit=20"));
      rows = list((await r.json()).rows).filter(object);
    } catch (err) {
      console.error("rankwatch: audit trail unavailable:", err);
      return;
    }
    const body = $(SEL.auditBody);
    body.replaceChildren();
    if (!rows.length) {
      cell(body.insertRow(), "No entries yet.", "muted").colSpan = 8;
      return;
    }
    for (const a of rows) {
      const tr = body.insertRow();
      tr.dataset.action = a.action;
      cell(tr, formatClock(a.at, true));
      cell(tr, a.action);
      cell(tr, a.who);
      cell(tr, a.remote_addr);
      cell(tr, a.reason);
      cell(tr, a.outcome);
      cell(tr, a.request_id);
      cell(tr, basisText(a), a.basis === "observed" ? "muted" : null);
    }
  }
}

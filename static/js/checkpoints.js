// The checkpoint browser's entry point: the answer line ("resume from here"),
// the set table, the dialogs, and the Socket.IO stream that keeps them live.

import { LOGIN, openSocket } from "./base.js";
import { $ } from "./dom.js";
import { CKPT, el } from "./checkpoints_dom.js";
import { SetTable, epochLabel, rankList } from "./checkpoints_table.js";
import { DeleteDialog, ResumeDialog, api } from "./checkpoints_dialogs.js";
import { formatBytes, formatSeconds, plural } from "./format.js";
import { RetentionView } from "./checkpoints_retention.js";
import { operatorFetch, token } from "./token.js";

window.addEventListener("rankwatch-login-failed", (e) => flash(`The login link did not work: ${e.detail}`, "error"));
// A relaunched dashboard refused this tab's token (token.recheck on reconnect): say so now,
// not when a delete is refused.
window.addEventListener("rankwatch-token", () => {
  if (!token.get() && token.stale()) flash(`read-only: open a new login link (\`${LOGIN}\`)`, "error");
});
token.follow();
const config = JSON.parse($(CKPT.config).textContent);
// Server time minus this tab's clock, so ages agree with the server.
let clockOffset = 0;
const serverNow = () => Date.now() / 1000 + clockOffset;
let index = null;

function flash(text, kind = "info") {
  const p = $(CKPT.flash);
  p.textContent = text;
  p.dataset.kind = kind;
  p.hidden = false;
}

function byId(id) {
  return index.sets.find((s) => s.id === id);
}

async function resume(set) {
  const error = await resumeDialog.open(set);
  if (error) flash(error, "error");
}

// A deep verify runs MindSpore on the dashboard's machine, so it needs the token.
async function verify(set) {
  if (!token.get()) {
    flash("A deep verify needs the operator token: open the login link the dashboard printed "
      + `(${LOGIN} prints a new one), or enter the token in the delete dialog or on the ranks page.`,
    "error");
    return;
  }
  const r = await operatorFetch(config.urls.verify, { set: set.id });
  if (!r.ok) flash(r.body.error, "error");
}

const table = new SetTable(config, {
  resume: (set) => resume(set).catch((err) => flash(err.message, "error")),
  verify: (set) => verify(set).catch((err) => flash(err.message, "error")),
  remove: (set) => deleteDialog.open(set, index),
}, serverNow);
const resumeDialog = new ResumeDialog(config);
const deleteDialog = new DeleteDialog(config, (result, set) => {
  const failed = result.failed.map((f) => `${f.path}: ${f.error}`);
  flash(`Deleted ${plural(result.deleted.length, "file")} of global step ${set.global_step ?? "?"}`
    + (failed.length ? `; could not delete ${failed.join("; ")}` : "."), failed.length ? "error" : "info");
});

const retention = new RetentionView(config, flash);

function renderAnswer() {
  const answer = $(CKPT.answer);
  const headline = $(CKPT.headline);
  const button = $(CKPT.headlineResume);
  // The newest complete set with no evidence against its weights (app/checkpoints/service.py): a NaN
  // breakpoint save is often the newest on disk, and the headline must not send anyone there.
  const newest = index.newest_healthy ? byId(index.newest_healthy) : null;
  // What the next launch really does, as "How to resume" says it (app/checkpoints/resume.py).
  const bridge = newest && index.bridge_resume ? byId(index.bridge_resume) : null;
  // Two sets of one step (the periodic save beside the stop's own): the relaunch resumes at that
  // step from the bridge's set, which is the one the headline, the ★ and How to resume name.
  const sameStep = Boolean(bridge && bridge.id !== newest.id && bridge.global_step != null
    && bridge.global_step === newest.global_step);
  const star = sameStep ? bridge : newest;
  headline.replaceChildren();
  if (newest) {
    answer.dataset.status = "running";
    const age = el("span");
    age.dataset.mtime = star.mtime;
    const facts = ` (epoch / step ${epochLabel(star)}): complete on all ${plural(star.world_size, "rank")}, `
      + `${formatBytes(star.bytes)}, ${star.origin}, saved `;
    const pin = (step) => [" To resume from it, pin it: relaunch with ",
      el("code", "", `${config.resume_step_env}=${step}`), " (the bridge loads that step), or see How to resume."];
    if (bridge && bridge.id === star.id) {
      headline.append("Resume from ", el("strong", "", `global step ${star.global_step ?? "?"}`), facts, age,
        ". An unchanged relaunch with the bridge resumes from it"
        + (sameStep ? ` (★); the ${newest.origin} set of the same step is the same point in training.` : "."));
    } else {
      headline.append("Newest complete set: ", el("strong", "", `global step ${newest.global_step ?? "?"}`),
        facts, age, ".");
      headline.append(bridge
        ? ` An unchanged relaunch with the bridge resumes from global step ${bridge.global_step}, its newest `
          + "complete graceful-stop set (★), not from this one."
        : " An unchanged relaunch does not resume from it: the bridge resumes only from its own saves "
          + "(there are none), and a script without it starts over unless it loads a checkpoint itself.");
      if (newest.global_step != null) headline.append(...pin(newest.global_step));
    }
  } else if (index.newest_complete) {
    const bad = byId(index.newest_complete);
    answer.dataset.status = "waiting";
    headline.textContent = "No healthy complete set: every complete set has evidence against its weights. "
      + `The newest, global step ${bad.global_step ?? "?"}: ${bad.unhealthy}.`;
  } else if (index.sets.length) {
    const last = index.sets[0];
    answer.dataset.status = "waiting";
    headline.textContent = "No complete set: every set lacks a readable file for at least one rank. "
      + `The newest, global step ${last.global_step ?? "?"}, lacks `
      + `${last.ranks_missing.length === 1 ? "rank" : "ranks"} ${rankList(last.ranks_missing)}.`;
  } else {
    answer.dataset.status = index.errors.length ? "missing" : "waiting";
    headline.textContent = index.errors.length ? index.errors[0] : "No checkpoints in the run directory yet.";
  }
  button.hidden = !newest;
  button.onclick = newest ? () => table.actions.resume(star) : null;
  const source = index.world_size_source === "job" ? "from the job" : "per layout: highest rank + 1";
  $(CKPT.meta).textContent = `${plural(index.sets.length, "set")}, ${formatBytes(index.total_bytes)} in `
    + `${index.run_dir}; world size ${index.world_size ?? "unknown"} (${source}); `
    + `new files show within ${formatSeconds(config.scan_s)}.`;
  const errors = $(CKPT.errors);
  errors.replaceChildren(...index.errors.map((e) => el("li", "", e)));
  errors.hidden = index.errors.length === 0;
}

const socket = openSocket("checkpoints");
const connection = $(CKPT.connection);
socket.on("connect", () => {
  token.recheck();
  connection.dataset.state = "live";
  connection.textContent = "live";
});
socket.on("disconnect", () => {
  queued = null;  // an ask in flight is lost with the connection: the reconnect brings the whole index
  connection.dataset.state = "down";
  connection.textContent = "reconnecting…";
});
// The answer line above the list changes with the list, held with it: a
// longer headline would push the rows down under the pointer too.
table.onDraw = (msg) => {
  index = msg;
  renderAnswer();
  // The retention column goes in with the rows (the last plan at once, then the new one),
  // and is held with them while the pointer rests on the list.
  queueMicrotask(() => {
    retention.redraw();
    retention.refresh(() => table.pending !== null).catch(() => {});
  });
};
// The index as last pushed (drawn, or held back while the pointer is on the list): the whole
// index on connect, then each delta applied to it (app/checkpoints/indexbody.py's apply_delta).
let latest = null;
// While the whole index is asked for: the deltas that arrive meanwhile, applied after it.
let queued = null;

function show(msg) {
  latest = msg;
  clockOffset = msg.now - Date.now() / 1000;
  table.render(msg);
}

// The delta applied to `whole`; `whole` itself for a delta it includes already; null when this
// page missed a push (it holds another version than the one the delta applies to).
function applyDelta(whole, delta) {
  const version = whole.version;
  if (version != null && delta.version <= version) return whole;
  if (version != null && delta.base !== version) return null;
  const sets = new Map(whole.sets.map((s) => [s.id, s]));
  for (const id of delta.removed ?? []) sets.delete(id);
  for (const { files_changed: changed, files_removed: removed, ...s } of delta.sets ?? []) {
    const old = sets.get(s.id) ?? {};
    const next = { ...old, ...s };
    if (changed) {
      // A changed set's files: merged by path, in the server's order (lowest rank first, then path).
      const files = new Map((old.files ?? []).map((f) => [f.path, f]));
      for (const path of removed) files.delete(path);
      for (const f of changed) files.set(f.path, f);
      next.files = [...files.values()].sort((a, b) => a.rank - b.rank || (a.path < b.path ? -1 : a.path > b.path ? 1 : 0));
    }
    sets.set(s.id, next);
  }
  const { order, ...fields } = delta.summary ?? {};
  const ids = order ?? whole.sets.map((s) => s.id);
  return {
    ...whole, ...fields, now: delta.now, scanned_at: delta.scanned_at, version: delta.version,
    sets: ids.filter((id) => sets.has(id)).map((id) => sets.get(id)),
  };
}

// A missed push: ask for the whole index (it comes back as the ack), once at a time.
function askWhole() {
  queued = [];
  socket.emit(config.events.whole, {}, (body) => {
    const later = queued;
    queued = null;
    if (!body || body.error) return;
    show(body);
    for (const delta of later) onDelta(delta);
  });
}

function onDelta(delta) {
  if (queued) {
    queued.push(delta);
    return;
  }
  if (!latest) return;  // the whole index comes on connect
  const next = applyDelta(latest, delta);
  if (next === null) askWhole();
  else if (next !== latest) show(next);
}

socket.on(config.events.checkpoints, (msg) => show(msg));
socket.on(config.events.delta, onDelta);
socket.on(config.events.verify, (msg) => table.applyVerify(msg));

setInterval(() => table.renderAges(), 1000);

// For looking around from the browser console.
window.rankwatchCheckpoints = { socket, table, get index() { return index; }, get latest() { return latest; } };

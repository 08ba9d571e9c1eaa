// When a job goes wrong (README, "When a job hangs"): a rank's stack in a
// dialog (the Stack action in each table row), every rank's stack grouped,
// the stop policy's rules and the alerts' delivery attempts. The server
// pushes `incidents` when the policy or the deliveries changed; stacks are
// fetched when asked for. No inline script or handler: everything is bound here.

import { api } from "./base.js";
import { SEL, $, setCodeText } from "./dom.js";
import { formatClock, formatSeconds, plural, verdictLabel } from "./format.js";
import { token, operatorFetch } from "./token.js";

const POLL_MS = 500;
const WAIT_MS = 60000;

function text(el, value) {
  el.textContent = value;
}

function when(t) {
  return formatClock(t);
}

async function getJson(url) {
  const r = await fetch(url);
  let body = null;
  try {
    body = await r.json();
  } catch {
    body = { error: `HTTP ${r.status}`, status: r.status };
  }
  return { ok: r.ok, status: r.status, body };
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// The clipboard API exists only in secure contexts (https or localhost).
async function copy(button, value, selectable) {
  try {
    await navigator.clipboard.writeText(value);
    text(button, "Copied");
  } catch {
    window.getSelection().selectAllChildren(selectable);
    text(button, "Selected: press Ctrl+C");
  }
  setTimeout(() => text(button, "Copy"), 2000);
}

function frameLine(f, native) {
  const line = f.line ? `:${f.line}` : "";
  return `    ${f.function} (${f.file}${line})${native ? "  [native]" : ""}`;
}

// A training thread as text: native frames below the innermost Python one, then the Python frames.
function threadText(thread) {
  if (!thread) return "(no training thread in the capture)";
  const lines = [`Thread ${thread.id}${thread.name ? ` "${thread.name}"` : ""}`];
  for (const f of thread.native || []) lines.push(frameLine(f, true));
  for (const f of thread.frames) {
    lines.push(frameLine(f, false));
    if (f.code) lines.push(`        ${f.code}`);
  }
  if (thread.omitted) lines.push(`    ... ${thread.omitted} outer frames left out`);
  return lines.join("\n");
}

class StackDialog {
  constructor() {
    this.rank = null;
    this.capture = null;
    this.busy = false;
    this.dialog = $(SEL.stackDialog);
    $(SEL.tableBody).addEventListener("click", (e) => {
      const button = e.target.closest("button[data-stack-rank]");
      if (button) this.open(Number(button.dataset.stackRank), button.dataset.health);
    });
    $(SEL.stackClose).addEventListener("click", () => this.dialog.close());
    $(SEL.stackCapture).addEventListener("click", () => this.captureNow());
    $(SEL.stackCopy).addEventListener("click", () => copy($(SEL.stackCopy), $(SEL.stackText).textContent, $(SEL.stackText)));
    window.addEventListener("rankwatch-token", () => this.renderButtons());
  }

  renderButtons() {
    const button = $(SEL.stackCapture);
    const has = Boolean(token.get());
    button.disabled = this.busy || !has;
    button.title = has ? "Ask the rank for a fresh capture" : "Read-only: enter the operator token to ask for a capture";
  }

  async open(rank, health) {
    this.rank = rank;
    this.capture = null;
    text($(SEL.stackDialogTitle), `Stack of rank ${rank}`);
    $(SEL.stackNative).checked = health !== undefined && health !== "healthy";
    this.message(null);
    $(SEL.stackPending).hidden = true;
    text($(SEL.stackMeta), "Loading…");
    text($(SEL.stackText), "");
    this.renderButtons();
    if (!this.dialog.open) this.dialog.showModal();
    await this.load();
  }

  message(error) {
    const el = $(SEL.stackError);
    el.hidden = !error;
    text(el, error || "");
  }

  async load() {
    const rank = this.rank;
    const res = await getJson(api(`/api/ranks/${rank}/stack`));
    if (rank !== this.rank) return null;
    if (!res.ok) {
      text($(SEL.stackMeta), "");
      this.message(res.body.error);
      return null;
    }
    this.render(res.body);
    return res.body;
  }

  render(c) {
    this.capture = c;
    const why = c.trigger === "stall"
      ? `automatically, ${c.since_step_s != null ? formatSeconds(c.since_step_s) : "some time"} after its last step`
      : "on request";
    const step = c.global_step != null ? `, global step ${c.global_step}` : "";
    const stale = c.stale ? " — from before the rank's current process started" : "";
    text($(SEL.stackMeta), `Captured ${when(c.captured_at)} (${formatSeconds(c.age_s)} ago) ${why} by ${c.source}`
      + `, pid ${c.pid ?? "?"} on ${c.host ?? "?"}${step}; native frames: ${c.native}${stale}.`);
    text($(SEL.stackText), c.text);
    const pending = $(SEL.stackPending);
    pending.hidden = !c.pending;
    if (c.pending) {
      text(pending, c.pending.error
        ? `The capture requested at ${when(c.pending.requested_at)} failed: ${c.pending.error}`
        : `A capture requested at ${when(c.pending.requested_at)} (via ${c.pending.via}) has not arrived yet.`);
    }
    this.message(null);
  }

  async captureNow() {
    if (this.busy) return;
    this.busy = true;
    this.renderButtons();
    const rank = this.rank;
    try {
      const res = await operatorFetch(api(`/api/ranks/${rank}/stack`), { native: $(SEL.stackNative).checked });
      if (!res.ok) {
        this.message(res.status === 401 ? "The operator token was refused; enter it again." : res.body.error);
        return;
      }
      const asked = res.body;
      const pending = $(SEL.stackPending);
      pending.hidden = false;
      text(pending, `Asked rank ${rank} for a capture (via ${asked.via}: ${asked.why}); waiting…`);
      const deadline = Date.now() + WAIT_MS;
      while (Date.now() < deadline && rank === this.rank && this.dialog.open) {
        await sleep(POLL_MS);
        const got = await getJson(api(`/api/ranks/${rank}/stack`));
        if (got.ok && got.body.request_id === asked.request_id) {
          this.render(got.body);
          return;
        }
        const error = got.ok ? got.body.pending?.error : null;
        if (error) {
          this.message(error);
          return;
        }
      }
      if (rank === this.rank) {
        text(pending, `No capture from rank ${rank} within ${WAIT_MS / 1000} s: its reporter thread is not running `
          + "(the process is stopped, dead, or stuck with the GIL held), it cannot write to the run directory, "
          + "or its bridge predates stack captures.");
      }
    } finally {
      this.busy = false;
      this.renderButtons();
    }
  }
}

class StackGroups {
  constructor() {
    this.data = null;
    $(SEL.stacksLoad).addEventListener("click", () => this.load());
    $(SEL.stacksCaptureAll).addEventListener("click", () => this.captureAll());
    $(SEL.stacksCopy).addEventListener("click", () => copy($(SEL.stacksCopy), this.asText(), $(SEL.stacksGroups)));
    window.addEventListener("rankwatch-token", () => this.renderButtons());
    this.renderButtons();
  }

  renderButtons() {
    const has = Boolean(token.get());
    const button = $(SEL.stacksCaptureAll);
    button.disabled = !has;
    button.title = has ? "Ask every rank for a fresh capture, then group them"
      : "Read-only: enter the operator token to ask every rank for a capture";
  }

  error(message) {
    const el = $(SEL.stacksError);
    el.hidden = !message;
    text(el, message || "");
  }

  async load(requestId) {
    const res = await getJson(api(requestId ? `/api/stacks?request=${encodeURIComponent(requestId)}` : "/api/stacks"));
    if (!res.ok) {
      this.error(res.body.error);
      return null;
    }
    this.error(null);
    this.render(res.body);
    return res.body;
  }

  render(data) {
    this.data = data;
    const summary = $(SEL.stacksText);
    summary.hidden = false;
    // No capture on a healthy job is the normal case: say how to get one.
    setCodeText(summary, data.missing?.length
      ? `${data.text}. Press "Capture every rank now" to see what each rank is doing.` : data.text);
    $(SEL.stacksCopy).hidden = !data.groups.length;
    const list = $(SEL.stacksGroups);
    list.replaceChildren(...data.groups.map((g) => {
      const li = document.createElement("li");
      li.dataset.ranks = g.ranks_text;
      const details = document.createElement("details");
      const head = document.createElement("summary");
      const span = g.captured_to - g.captured_from;
      setCodeText(head, `${g.summary} (captured ${when(g.captured_from)}${span >= 1 ? ` – ${when(g.captured_to)}` : ""}`
        + (g.stale ? "; stale: these ranks have ended since)" : ")"));
      if (g.stale) li.dataset.stale = "";
      const pre = document.createElement("pre");
      pre.className = "stack-text";
      text(pre, `rank ${g.example_rank}:\n${threadText(g.thread)}`);
      details.append(head, pre);
      li.append(details);
      return li;
    }));
  }

  asText() {
    const d = this.data;
    if (!d) return "";
    return [d.text, ...d.groups.map((g) => `\n${g.summary}\nrank ${g.example_rank}:\n${threadText(g.thread)}`)].join("\n");
  }

  async captureAll() {
    const button = $(SEL.stacksCaptureAll);
    button.disabled = true;
    try {
      const res = await operatorFetch(api("/api/stacks"), {});
      if (!res.ok) {
        this.error(res.status === 401 ? "The operator token was refused; enter it again." : res.body.error);
        return;
      }
      const asked = res.body;
      const expected = asked.bridge.length + asked.py_spy.length;
      const cannot = Object.keys(asked.cannot).length;
      const deadline = Date.now() + WAIT_MS;
      let data = null;
      do {
        await sleep(POLL_MS * 2);
        data = await this.load(asked.request_id);
      } while (data && data.answered < expected && Date.now() < deadline);
      if (data && (data.answered < expected || cannot)) {
        this.error(`${data.answered} of ${expected} ranks answered`
          + (cannot ? `; ${cannot} cannot be captured (e.g. rank ${Object.keys(asked.cannot)[0]}: `
            + `${Object.values(asked.cannot)[0]})` : ""));
      }
    } finally {
      this.renderButtons();
    }
  }
}

class PolicyPanel {
  render(policy) {
    const mode = $(SEL.policyMode);
    mode.dataset.mode = policy.mode;
    text(mode, { off: "off", dry_run: "dry run", on: "armed" }[policy.mode] || policy.mode);
    text($(SEL.policyNote), policy.mode === "off"
      ? "Off (RANKWATCH_POLICY_MODE=off): no rule is evaluated. Set dry_run to see what it would do, on to let it stop the job."
      : policy.mode === "dry_run"
        ? "Dry run: a rule that fires is logged, audited and alerted; nothing is stopped."
        : "Armed: a rule that fires stops the job gracefully, as the button does (who = policy). Each rule fires at most once per job run.");
    $(SEL.policyRules).replaceChildren(...policy.rules.map((r) => {
      const li = document.createElement("li");
      li.dataset.state = r.state;
      li.dataset.rule = r.rule;
      let state = r.state;
      if (r.fired) {
        state = `${r.fired.mode === "dry_run" ? "fired in dry run" : "fired"} at ${when(r.fired.at)}: ${r.fired.outcome}`;
      } else if (r.holding && policy.armed) {
        state += `; rank ${r.holding.rank} in this state since ${when(r.holding.since)}`
          + (r.holding.ranks > 1 ? ` (${r.holding.ranks} ranks)` : "");
      }
      text(li, `${r.rule} — ${r.help.replace("N s", `${r.for_s} s`)}: ${state}`);
      return li;
    }));
  }
}

class AlertsPanel {
  render(alerts, rows) {
    const note = $(SEL.alertsNote);
    text(note, alerts.enabled
      ? `Webhooks: ${alerts.targets.join(", ")}; ${plural(alerts.queued, "alert")} waiting to be delivered.`
      : "No webhook configured (RANKWATCH_WEBHOOK_URL): verdict changes, stops and policy actions are not sent anywhere.");
    if (!rows.length) return;
    const body = $(SEL.alertsBody);
    body.replaceChildren(...rows.map((r) => {
      const tr = document.createElement("tr");
      for (const value of [when(r.at), verdictLabel(r.event), r.target, r.attempt, r.outcome, r.text, r.run]) {
        const td = tr.insertCell();
        text(td, value ?? "–");
      }
      tr.dataset.outcome = String(r.outcome).split(/[ :]/)[0];
      return tr;
    }));
  }
}

export class Incidents {
  constructor(socket) {
    this.stacks = new StackDialog();
    this.groups = new StackGroups();
    this.policy = new PolicyPanel();
    this.alerts = new AlertsPanel();
    socket.on("incidents", (msg) => {
      this.policy.render(msg.policy);
      this.alerts.render(msg.alerts, msg.alerts.recent);
    });
    this.loadOnce();
  }

  async loadOnce() {
    const [policy, alerts] = await Promise.all([getJson(api("/api/policy")), getJson(api("/api/alerts?limit=20"))]);
    if (policy.ok) this.policy.render(policy.body);
    if (alerts.ok) this.alerts.render(alerts.body, alerts.body.rows);
  }
}

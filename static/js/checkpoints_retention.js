// Retention on the checkpoint page: the plan as a column ("kept: newest complete
// healthy", "will free 4.2 GiB"), the policy and disk space, and one Apply button
// that sends the plan's hash (a plan that changed since is refused with 409).

import { $, $all } from "./dom.js";
import { el } from "./checkpoints_dom.js";
import { formatBytes, formatCount, plural } from "./format.js";
import { operatorFetch, token } from "./token.js";

// A set by its step, in words; its id (…rankwatch-9_15.ckpt#g495) in the tooltip, for whoever needs it.
// A leftover temporary file has no step: its path is what names it.
function goingItem(e) {
  const what = e.kind === "set" && e.global_step !== null ? `global step ${formatCount(e.global_step)}` : e.id;
  const li = el("li", "", `${what}: ${e.why}`);
  li.title = e.id;
  return li;
}

export const RETENTION = Object.freeze({
  section: "#ckpt-retention",
  policy: "#ckpt-retention-policy",
  disk: "#ckpt-retention-disk",
  apply: "#ckpt-retention-apply",
  head: "#ckpt-table thead tr",
  dialog: "#retention-dialog",
  form: "#retention-form",
  summary: "#retention-summary",
  modeNote: "#retention-mode-note",
  sets: "#retention-sets",
  error: "#retention-error",
  cancel: "#retention-cancel",
  confirm: "#retention-confirm",
});

// What the policy does by itself, and so what Apply adds to it (docs/checkpoints.md, "Retention").
const MODE = {
  off: "Retention is off: nothing is deleted by itself. Apply deletes what the plan marks, once, now; "
    + "it does not turn retention on (RETENTION_MODE=on does).",
  dry_run: "Retention is a dry run: it audits and alerts what it would delete, and deletes nothing. "
    + "Apply deletes what the plan marks, once, now.",
  on: "Retention is on: the plan is applied after each new complete set. Apply does it now.",
};

export class RetentionView {
  constructor(config, flash) {
    this.config = config;
    this.flash = flash;
    this.plan = null;
    $(RETENTION.apply).onclick = () => this.ask();
    $(RETENTION.cancel).onclick = () => $(RETENTION.dialog).close();
    $(RETENTION.form).addEventListener("submit", (e) => {
      e.preventDefault();
      this.apply().catch((err) => this.fail(err.message));
    });
  }

  // After each drawing of the rows: fetch the plan and draw it beside them, unless
  // held() says the list is held still under the pointer meanwhile.
  async refresh(held = () => false) {
    const r = await fetch(this.config.urls.retention, { headers: { Accept: "application/json" } });
    if (!r.ok) return;
    const plan = await r.json();
    if (held()) return;
    this.plan = plan;
    this.render();
  }

  // The last plan again, on freshly drawn rows.
  redraw() {
    if (this.plan) this.render();
  }

  render() {
    const plan = this.plan;
    const head = $(RETENTION.head);
    if (head && !head.querySelector('[data-col="retention"]')) {
      const th = el("th", "", "Retention");
      th.scope = "col";
      th.dataset.col = "retention";
      th.title = "What the retention plan does with the set, and why";
      head.insertBefore(th, head.querySelector('[data-col="actions"]'));
    }
    const byId = new Map(plan.sets.filter((e) => e.kind === "set").map((e) => [e.id, e]));
    for (const tr of $all("#ckpt-table tbody tr.set-row")) {
      const entry = byId.get(tr.dataset.setId);
      const td = el("td", "ckpt-retention-cell",
        !entry ? "–" : entry.action === "delete" ? `will free ${formatBytes(entry.bytes)}` : entry.why);
      td.dataset.col = "retention";
      if (entry) {
        td.dataset.action = entry.action;
        td.title = entry.why;
        const pinned = plan.policy.pinned.includes(entry.id);
        const pin = el("button", "btn btn-small ckpt-pin", pinned ? "Unpin" : "Pin");
        pin.type = "button";
        pin.title = pinned ? "Let retention decide again" : "Never delete this set (operator token needed)";
        pin.onclick = () => this.pin(entry.id, !pinned).catch((err) => this.flash(err.message, "error"));
        td.append(" ", pin);
      }
      tr.querySelector('[data-col="retention"]')?.remove();
      tr.insertBefore(td, tr.lastElementChild);
    }
    for (const td of $all("#ckpt-table tbody tr:not(.set-row) td[colspan]")) td.colSpan = 10;
    const p = plan.policy;
    $(RETENTION.policy).textContent = `Retention ${p.mode}: keep the newest ${plural(p.keep, "complete set")}`
      + (p.every ? `, every multiple of ${p.every}` : "")
      + `, stop, pinned, resume and newest healthy sets (${p.source}).`
      + (p.mode === "off" ? " Nothing is deleted by itself; Apply deletes the plan's sets once." : "")
      + (p.errors.length ? ` ${p.errors.join(" ")}` : "");
    const d = plan.disk;
    const disk = $(RETENTION.disk);
    disk.textContent = d.warning
      || `Checkpoints ${formatBytes(d.run_bytes)}; ${formatBytes(d.free_bytes)} free on their filesystem`
        + (d.next_save_bytes ? ` (the next save needs about ${formatBytes(d.next_save_bytes)}).` : ".");
    disk.dataset.low = String(Boolean(d.low));
    const count = plan.sets.filter((e) => e.action === "delete").length;
    const button = $(RETENTION.apply);
    button.hidden = count === 0;
    button.textContent = `${p.mode === "on" ? "Apply retention now" : "Apply retention once"}: delete ${count}, `
      + `will free ${formatBytes(plan.frees_bytes)}`;
    $(RETENTION.section).hidden = false;
  }

  async pin(id, pinned) {
    if (!token.get()) {
      this.flash("Pinning needs the operator token: open the login link the dashboard printed.", "error");
      return;
    }
    const r = await operatorFetch(this.config.urls.pin, { set: id, pinned });
    if (!r.ok) this.flash(r.body.error, "error");
    await this.refresh();
  }

  // The page's own dialog: what goes, how much it frees, and what Apply means in this mode.
  ask() {
    const plan = this.plan;
    if (!plan) return;
    if (!token.get()) {
      this.flash("Applying retention needs the operator token: open the login link the dashboard printed, "
        + "or enter the token in the delete dialog.", "error");
      return;
    }
    const going = plan.sets.filter((e) => e.action === "delete");
    $(RETENTION.summary).textContent = `Delete ${plural(going.length, "set")} or leftovers, `
      + `freeing ${formatBytes(plan.frees_bytes)}. The audit trail records it.`;
    $(RETENTION.modeNote).textContent = MODE[plan.policy.mode] || "";
    $(RETENTION.sets).replaceChildren(...going.map(goingItem));
    $(RETENTION.error).hidden = true;
    $(RETENTION.confirm).disabled = false;
    $(RETENTION.dialog).showModal();
  }

  fail(message) {
    const error = $(RETENTION.error);
    error.textContent = message;
    error.hidden = false;
    $(RETENTION.confirm).disabled = false;
  }

  async apply() {
    const plan = this.plan;
    $(RETENTION.confirm).disabled = true; // a double click sends one request
    const r = await operatorFetch(this.config.urls.retention_apply, { hash: plan.hash });
    if (!r.ok) {
      this.fail(r.body.error);
      await this.refresh();
      return;
    }
    $(RETENTION.dialog).close();
    const failed = r.body.failed.length ? `; ${r.body.failed.length} failed` : "";
    this.flash(`Retention deleted ${r.body.deleted.length}, freed ${formatBytes(r.body.frees_bytes)}${failed}.`,
      failed ? "error" : "info");
  }
}

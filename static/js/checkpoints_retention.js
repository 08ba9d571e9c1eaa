// Retention on the checkpoint page: the plan as a column ("kept: newest complete
// healthy", "will free 4.2 GiB"), the policy and disk space, and one Apply button
// that sends the plan's hash (a plan that changed since is refused with 409).

import { $, $all } from "./dom.js";
import { el } from "./checkpoints_dom.js";
import { formatBytes, plural } from "./format.js";
import { operatorFetch, token } from "./token.js";

export const RETENTION = Object.freeze({
  section: "#ckpt-retention",
  policy: "#ckpt-retention-policy",
  disk: "#ckpt-retention-disk",
  apply: "#ckpt-retention-apply",
  head: "#ckpt-table thead tr",
});

export class RetentionView {
  constructor(config, flash) {
    this.config = config;
    this.flash = flash;
    this.plan = null;
    $(RETENTION.apply).onclick = () => this.apply().catch((err) => flash(err.message, "error"));
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
    button.textContent = `Apply retention: delete ${count}, will free ${formatBytes(plan.frees_bytes)}`;
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

  async apply() {
    const plan = this.plan;
    if (!token.get()) {
      this.flash("Applying retention needs the operator token: open the login link the dashboard printed, "
        + "or enter the token in the delete dialog.", "error");
      return;
    }
    const count = plan.sets.filter((e) => e.action === "delete").length;
    if (!window.confirm(`Delete ${plural(count, "set")} or leftovers, freeing ${formatBytes(plan.frees_bytes)}?`)) return;
    const r = await operatorFetch(this.config.urls.retention_apply, { hash: plan.hash });
    if (!r.ok) {
      this.flash(r.body.error, "error");
      await this.refresh();
      return;
    }
    const failed = r.body.failed.length ? `; ${r.body.failed.length} failed` : "";
    this.flash(`Retention deleted ${r.body.deleted.length}, freed ${formatBytes(r.body.frees_bytes)}${failed}.`,
      failed ? "error" : "info");
  }
}

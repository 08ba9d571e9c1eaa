// The table of checkpoint sets: one row per set, newest step first (the
// server's order), with a detail row of per-rank files that the operator
// opens. Sets change rarely (a save, a delete), so a new index redraws every
// row; which rows are open and each set's deep-verify progress survive it.
// A redraw never happens under the operator's hand: while the pointer is on
// the table or a set's files are open, a new index waits (a note says so),
// so a click lands on the row that was under the pointer.

import { $, $all } from "./dom.js";
import { CKPT, el } from "./checkpoints_dom.js";
import { formatBytes, formatSeconds, plural } from "./format.js";

const COLUMNS = 9;

export function stepLabel(set) {
  return set.global_step ?? "–";
}

export function epochLabel(set) {
  if (set.epoch === null && set.step === null) return "–";
  return `${set.epoch ?? "?"} / ${set.step ?? "?"}`;
}

// The word the delete dialog asks the operator to type.
export function confirmWord(set) {
  return String(set.global_step ?? set.step ?? "delete");
}

export function rankList(ranks) {
  const shown = ranks.slice(0, 12).join(", ");
  return ranks.length > 12 ? `${shown} and ${ranks.length - 12} more` : shown;
}

// The set that gets the ★: the one an unchanged relaunch resumes from (the bridge's own
// choice), else the newest complete one.
export function starOf(index) {
  return index.star ?? index.bridge_resume ?? index.newest_complete;
}

// index.sets (newest step first) with the ★ set first among the sets of its step.
function grouped(index) {
  const star = starOf(index);
  const sets = index.sets.slice();
  const at = sets.findIndex((s) => s.id === star);
  if (at > 0) {
    let first = at;
    while (first > 0 && sets[first - 1].global_step !== null && sets[first - 1].global_step === sets[at].global_step) {
      first -= 1;
    }
    sets.splice(first, 0, ...sets.splice(at, 1));
  }
  return sets;
}

export class SetTable {
  // actions: {resume(set), verify(set), remove(set)}; clock() is the server's time in seconds.
  constructor(config, actions, clock) {
    this.actions = actions;
    this.clock = clock;
    this.body = $(CKPT.tableBody);
    this.empty = $(CKPT.empty);
    this.otherSection = $(CKPT.other);
    this.otherList = $(CKPT.otherList);
    this.fileUrl = config.urls.file;
    this.open = new Set();
    // set id -> {summary: last verify event, files: Map(path -> result)}
    this.verify = new Map();
    this.index = null;
    // A newer index held back while the operator is on the table.
    this.pending = null;
    // Called with each index drawn (checkpoints.js redraws the answer line from it).
    this.onDraw = () => {};
    this.held = $(CKPT.held);
    this.table = this.body.closest("table");
    this.table.addEventListener("mouseleave", () => this.release());
    $(CKPT.heldShow).addEventListener("click", () => this.release(true));
  }

  // The operator is working on the list: the pointer is on it, or a set's files are open.
  busy() {
    return this.open.size > 0 || this.table.matches(":hover");
  }

  render(index) {
    // New sets move rows; a delete or a verify is the operator's own doing and shows at once.
    const shown = new Set(this.index ? this.index.sets.map((s) => s.id) : []);
    const waiting = this.index ? index.sets.filter((s) => !shown.has(s.id)).length : 0;
    if (waiting && this.busy()) {
      this.pending = index;
      this.held.hidden = false;
      $(CKPT.heldText).textContent = `${plural(waiting, "new set")} arrived: shown when the pointer `
        + "leaves the list and the files are closed, so that nothing moves under it.";
      return;
    }
    this.draw(index);
  }

  release(now = false) {
    if (!this.pending || (!now && this.busy())) return;
    const index = this.pending;
    this.pending = null;
    this.draw(index);
  }

  draw(index) {
    index = { ...index, sets: grouped(index) };
    this.held.hidden = true;
    this.pending = null;
    this.index = index;
    this.onDraw(index);
    const ids = new Set(index.sets.map((s) => s.id));
    for (const id of [...this.verify.keys()]) if (!ids.has(id)) this.verify.delete(id);
    for (const id of [...this.open]) if (!ids.has(id)) this.open.delete(id);
    for (const set of index.sets) {
      // The index carries each set's latest verify; live events may be newer.
      const local = this.verify.get(set.id)?.summary;
      if (set.verify && (!local || set.verify.state !== "running" || set.verify.done > local.done)) {
        this.verify.set(set.id, {
          summary: set.verify,
          files: new Map(set.verify.files.map((f) => [f.path, f])),
        });
      }
    }
    this.body.replaceChildren(...index.sets.flatMap((set) => this.rows(set)));
    this.empty.hidden = index.sets.length > 0;
    this.renderOther(index.other_files);
    this.renderAges();
  }

  rows(set) {
    const index = this.index;
    const tr = el("tr", "set-row");
    tr.dataset.setId = set.id;
    tr.dataset.complete = String(set.complete);
    tr.dataset.newest = String(set.id === index.newest_complete);
    tr.dataset.star = String(set.id === starOf(index));
    // A second save of one step (the periodic set beside the stop's own): one group, ★ first.
    const first = index.sets.find((s) => s.global_step !== null && s.global_step === set.global_step);
    if (first && first.id !== set.id) tr.classList.add("same-step");
    tr.dataset.origin = set.origin;
    tr.title = set.notes.join("\n");

    const origin = el("td", "", set.origin);
    if (set.origin === "TTP") {
      const info = el("span", "ckpt-info", " ⓘ");
      info.title = set.notes.find((n) => n.startsWith("TTP")) || "";
      origin.append(info);
    }
    origin.append(el("span", "ckpt-layout", set.layout));
    if (set.series) {
      // lenet, lenet_1, lenet_2: one series, saved by successive launches (MindSpore's renaming).
      const label = el("span", "ckpt-series", `launch ${set.series.launch} of ${set.series.launches}`
        + ` of the ${set.series.base} series`);
      label.title = `MindSpore names a relaunch's files ${set.series.base}_1, ${set.series.base}_2, … `
        + `when ${set.series.base}'s exist in the directory: the same model, saved by another launch.`;
      origin.append(label);
    }

    const ranks = el("td", "", `${set.ranks_present.length} / ${set.world_size}`);
    if (set.ranks_missing.length) {
      ranks.append(el("span", "ckpt-missing", ` missing ${rankList(set.ranks_missing)}`));
    }

    const age = el("td");
    age.dataset.mtime = set.mtime;

    tr.append(
      this.cell("step", String(stepLabel(set))),
      this.cell("epoch", epochLabel(set)),
      this.tag(origin, "origin"),
      this.tag(ranks, "ranks"),
      this.cell("size", formatBytes(set.bytes)),
      this.tag(age, "age"),
      this.tag(this.status(set), "status"),
      this.tag(this.verifyCell(set.id), "verify"),
      this.tag(this.buttons(set), "actions"),
    );
    const detail = el("tr", "set-detail");
    detail.dataset.detailFor = set.id;
    detail.hidden = !this.open.has(set.id);
    const td = el("td");
    td.colSpan = COLUMNS;
    td.append(this.details(set));
    detail.append(td);
    return [tr, detail];
  }

  cell(col, text) {
    return this.tag(el("td", "", text), col);
  }

  tag(td, col) {
    td.dataset.col = col;
    return td;
  }

  status(set) {
    const td = el("td");
    const index = this.index;
    // One ★, on the set an unchanged relaunch uses; the headline and How to resume say the same.
    if (set.id === index.bridge_resume) {
      td.append(this.badge("ckpt-newest", "★ an unchanged relaunch resumes here",
        "The bridge loads this set on every rank when the job is relaunched unchanged"));
    } else if (set.id === starOf(index)) {
      td.append(this.badge("ckpt-newest", "★ newest complete",
        "The newest step from which every rank can resume (an unchanged relaunch does not load it by itself)"));
    } else if (set.complete) {
      td.append(this.badge("ckpt-complete", "✓ complete", "Every rank has a readable file"));
    } else {
      td.append(this.badge("ckpt-incomplete", "✕ incomplete",
        `No readable file for ${set.ranks_missing.length === 1 ? "rank" : "ranks"} ${rankList(set.ranks_missing)}`));
    }
    const twin = index.sets.find((s) => s.id !== set.id && s.global_step !== null && s.global_step === set.global_step);
    if (twin) {
      td.append(" ", this.badge("ckpt-same-step", `same step as the ${twin.origin} set`,
        `Global step ${set.global_step} was saved twice (${set.origin} and ${twin.origin}); `
        + "either resumes training at the same step"));
    }
    // Weights with evidence against them (a NaN breakpoint save, a NaN loss, MindFormers' health
    // file): never a resume or rollback target, and the page says why before anyone tries.
    if (set.unhealthy) {
      td.append(" ", this.badge("ckpt-unhealthy", "⚠ unhealthy: never resumed from", set.unhealthy));
    }
    const corrupt = set.files.filter((f) => f.status !== "ok");
    if (corrupt.length) {
      td.append(" ", this.badge("ckpt-corrupt", `${corrupt.length} corrupt`,
        corrupt.map((f) => `${f.path}: ${f.reason}`).join("\n")));
    }
    return td;
  }

  badge(kind, text, title) {
    const span = el("span", `badge ${kind}`, text);
    span.title = title;
    return span;
  }

  buttons(set) {
    const td = el("td");
    const box = el("div", "ckpt-actions");
    td.append(box);
    const files = el("button", "btn", "Files");
    files.type = "button";
    files.setAttribute("aria-expanded", String(this.open.has(set.id)));
    files.addEventListener("click", () => this.toggle(set.id, files));
    const add = (label, action, title) => {
      const button = el("button", "btn", label);
      button.type = "button";
      button.dataset.action = label.toLowerCase();
      button.title = title;
      button.addEventListener("click", () => action(set));
      return button;
    };
    box.append(files,
      add("Resume", this.actions.resume, "The relaunch command and the code that loads this set"),
      add("Verify", this.actions.verify, "Load every file fully with MindSpore (CRC checked when stored)"),
      add("Delete", this.actions.remove, "Delete every file of this set (operator token needed)"));
    return td;
  }

  toggle(id, button) {
    const open = !this.open.has(id);
    if (open) this.open.add(id); else this.open.delete(id);
    button.setAttribute("aria-expanded", String(open));
    const detail = this.body.querySelector(`tr[data-detail-for="${CSS.escape(id)}"]`);
    detail.hidden = !open;
    if (!open) this.release();
  }

  details(set) {
    const wrap = el("div", "ckpt-detail");
    if (set.notes.length) {
      const notes = el("ul", "ckpt-note");
      notes.append(...set.notes.map((n) => el("li", "", n)));
      wrap.append(notes);
    }
    const table = el("table", "ckpt-files");
    const head = el("tr");
    for (const h of ["Rank", "File", "Format", "Size", "Epoch / step / global", "Status", "Deep verify"]) {
      const th = el("th", "", h);
      th.scope = "col";
      head.append(th);
    }
    table.append(el("thead"), el("tbody"));
    table.tHead.append(head);
    const verify = this.verify.get(set.id);
    for (const f of set.files) {
      const tr = el("tr");
      tr.dataset.path = f.path;
      tr.dataset.status = f.status;
      const link = el("a", "", f.path);
      link.href = `${this.fileUrl}?path=${encodeURIComponent(f.path)}`;
      link.setAttribute("download", "");
      const where = `${f.epoch ?? "?"} / ${f.step ?? "?"} / ${f.global_step ?? "?"}`;
      const status = f.status === "ok" ? el("td", "ckpt-ok", "ok")
        : el("td", "ckpt-bad", `${f.status}: ${f.reason}`);
      status.dataset.col = "file-status";
      const fileTd = el("td");
      // Listed by another node's agent (no shared filesystem): named, not downloadable from here.
      if (f.host) fileTd.append(el("span", "", f.path), el("span", "ckpt-host", ` on host ${f.host}`));
      else fileTd.append(link);
      const verifyTd = el("td");
      verifyTd.dataset.col = "file-verify";
      this.fillFileVerify(verifyTd, verify?.files.get(f.path));
      tr.append(el("td", "", String(f.rank)), fileTd, el("td", "", f.format ?? "?"),
        el("td", "", formatBytes(f.bytes)), el("td", "", where), status, verifyTd);
      table.tBodies[0].append(tr);
    }
    wrap.append(table);
    return wrap;
  }

  fillFileVerify(td, result) {
    td.className = "";
    if (!result) {
      td.textContent = "–";
    } else if (result.ok) {
      td.textContent = result.crc ? "✓ loads, CRC ok" : "✓ loads (no CRC stored)";
      td.className = "ckpt-ok";
    } else {
      td.textContent = `✕ ${result.error}`;
      td.className = "ckpt-bad";
    }
  }

  verifyCell(id) {
    const td = el("td");
    this.fillVerify(td, this.verify.get(id)?.summary);
    return td;
  }

  fillVerify(td, v) {
    td.replaceChildren();
    td.dataset.state = v ? v.state : "none";
    td.title = v?.error ?? "";
    if (!v) {
      td.textContent = "–";
    } else if (v.state === "running") {
      const bar = el("progress");
      bar.max = v.total;
      bar.value = v.done;
      td.append(bar, ` ${v.done} / ${v.total}`);
    } else if (v.state === "ok") {
      td.textContent = `✓ all ${v.total} load`;
    } else {
      td.textContent = `✕ ${v.error}`;
    }
  }

  // One checkpoint_verify event: the set's progress, and the file just loaded.
  applyVerify(event) {
    let state = this.verify.get(event.set);
    if (!state || (event.state === "running" && event.done === 0)) {
      state = { summary: event, files: new Map() };
      this.verify.set(event.set, state);
    }
    state.summary = event;
    if (event.file) state.files.set(event.file, { ok: event.ok, error: event.error, crc: event.crc });
    const row = this.body.querySelector(`tr.set-row[data-set-id="${CSS.escape(event.set)}"]`);
    if (!row) return;
    this.fillVerify(row.querySelector('td[data-col="verify"]'), event);
    const detail = this.body.querySelector(`tr[data-detail-for="${CSS.escape(event.set)}"]`);
    if (event.file) {
      const fileRow = $all("tr[data-path]", detail).find((tr) => tr.dataset.path === event.file);
      if (fileRow) this.fillFileVerify(fileRow.querySelector('td[data-col="file-verify"]'),
        state.files.get(event.file));
    }
  }

  renderOther(files) {
    this.otherSection.hidden = files.length === 0;
    this.otherList.replaceChildren(...files.map((f) => {
      const li = el("li");
      const link = el("a", "", f.path);
      link.href = `${this.fileUrl}?path=${encodeURIComponent(f.path)}`;
      link.setAttribute("download", "");
      li.append(f.host ? `${f.path} on host ${f.host}` : link, ` ${f.format ?? "?"}, ${formatBytes(f.bytes)}`,
        f.status === "ok" ? "" : el("span", "ckpt-bad", ` corrupt: ${f.reason}`));
      return li;
    }));
  }

  // Ages move with the clock; only their text changes.
  renderAges() {
    const now = this.clock();
    for (const node of $all(CKPT.ages)) {
      const text = `${formatSeconds(Math.max(0, now - Number(node.dataset.mtime)))} ago`;
      if (node.textContent !== text) node.textContent = text;
    }
  }
}

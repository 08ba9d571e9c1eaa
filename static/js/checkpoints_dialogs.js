// The resume and delete dialogs. Delete needs the operator token, which the
// page holds as the stop controls do (token.js: this tab's sessionStorage,
// sent as "Authorization: Bearer <token>", never a cookie).

import { $, $all } from "./dom.js";
import { CKPT, el } from "./checkpoints_dom.js";
import { confirmWord, epochLabel, rankList } from "./checkpoints_table.js";
import { formatBytes, plural } from "./format.js";
import { checkToken, operatorFetch, token } from "./token.js";

// A request that needs no token (reads, verify), answering {ok, status, body};
// errors come back in the API's one shape.
export async function api(url, { method = "GET", body } = {}) {
  const headers = body === undefined ? {} : { "Content-Type": "application/json" };
  // With the token, reads show what viewers without it do not get (paths, the relaunch command).
  if (token.get()) headers.Authorization = `Bearer ${token.get()}`;
  const response = await fetch(url, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await response.json();
  return { ok: response.ok, status: response.status, body: data };
}

function describe(set) {
  const where = set.global_step !== null ? `global step ${set.global_step}` : "unknown step";
  return `${where} (epoch / step ${epochLabel(set)}), ${set.origin}`;
}

function fillList(list, items) {
  list.replaceChildren(...items.map((text) => el("li", "", text)));
  list.hidden = items.length === 0;
}

export class ResumeDialog {
  constructor(config) {
    this.url = config.urls.resume;
    this.dialog = $(CKPT.resumeDialog);
    for (const button of $all(CKPT.copyButtons, this.dialog)) {
      button.addEventListener("click", () => this.copy(button));
    }
  }

  // Returns an error sentence, or null once the dialog is open.
  async open(set) {
    const r = await api(`${this.url}?set=${encodeURIComponent(set.id)}`);
    if (!r.ok) return r.body.error;
    const info = r.body;
    $(CKPT.resumeTitle).textContent = `Resume from ${describe(set)}`;
    $(CKPT.resumeHow).textContent = info.how;
    fillList($(CKPT.resumeWarnings), info.warnings);
    $(CKPT.resumeCommand).textContent = info.command ?? "(unknown: see below)";
    fillList($(CKPT.resumeCommandNotes), info.command_notes);
    $(CKPT.resumeCode).textContent = info.code;
    this.dialog.showModal();
    return null;
  }

  // Says what happened on the button itself (a Copy that said nothing was taken for broken),
  // and, where the clipboard is refused or missing, selects the text for Ctrl+C instead.
  async copy(button) {
    const source = $(button.dataset.copy, this.dialog);
    let said;
    try {
      // The clipboard API exists only in secure contexts (https or localhost), and may be refused.
      if (!navigator.clipboard) throw new Error("no clipboard");
      await navigator.clipboard.writeText(source.textContent);
      said = "Copied ✓";
      button.dataset.copied = "true";
    } catch {
      window.getSelection().selectAllChildren(source);
      said = "Selected: press Ctrl+C";
      button.dataset.copied = "selected";
    }
    button.textContent = said;
    clearTimeout(button.rwReset);
    button.rwReset = setTimeout(() => {
      button.textContent = "Copy";
      delete button.dataset.copied;
    }, 4000);
  }
}

export class DeleteDialog {
  // onDone(result, set) is called after a delete the server accepted.
  constructor(config, onDone) {
    this.url = config.urls.delete;
    this.onDone = onDone;
    this.dialog = $(CKPT.deleteDialog);
    this.form = $(CKPT.deleteForm);
    this.submit = $(CKPT.deleteSubmit);
    this.inputs = {
      force: $(CKPT.deleteForce), reason: $(CKPT.deleteReason), who: $(CKPT.deleteWho),
      token: $(CKPT.deleteToken), confirm: $(CKPT.deleteConfirm),
    };
    this.form.addEventListener("input", () => this.check());
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send().catch((err) => {
        this.showError(`The dashboard did not answer: ${err.message}`);
        this.check();
      });
    });
    $(CKPT.deleteCancel).addEventListener("click", () => this.dialog.close());
  }

  open(set, index) {
    this.set = set;
    this.word = confirmWord(set);
    $(CKPT.deleteSummary).textContent = `${describe(set)}: ${plural(set.files.length, "file")}, `
      + `${formatBytes(set.bytes)}, ranks ${rankList(set.ranks_present) || "none readable"}.`;
    fillList($(CKPT.deleteFiles), set.files.map((f) => f.path));
    let why = null;
    if (set.id === index.newest_complete) {
      why = "This is the newest complete set: the newest step from which every rank can resume. "
        + "After deleting it, a resume starts from an older set.";
    } else if (set.id === index.bridge_resume) {
      why = "The bridge resumes from this set when the job is relaunched unchanged.";
    }
    this.protected = why !== null;
    $(CKPT.deleteProtected).hidden = !this.protected;
    $(CKPT.deleteProtectedWhy).textContent = why ?? "";
    this.inputs.force.checked = false;
    this.inputs.confirm.value = "";
    this.inputs.token.value = "";
    $(CKPT.deleteTokenLabel).hidden = Boolean(token.get());
    $(CKPT.deleteConfirmLabel).textContent = `Type ${this.word} to confirm`;
    this.showError(null);
    this.check();
    this.dialog.showModal();
  }

  check() {
    const i = this.inputs;
    this.submit.disabled = !(i.confirm.value.trim() === this.word && i.reason.value.trim()
      && (!this.protected || i.force.checked) && (token.get() || i.token.value.trim()));
  }

  showError(text) {
    const p = $(CKPT.deleteError);
    p.hidden = !text;
    p.textContent = text ?? "";
  }

  async send() {
    this.submit.disabled = true;
    if (!token.get()) {
      const typed = this.inputs.token.value.trim();
      if (!(await checkToken(typed))) {
        this.showError("That is not the operator token.");
        this.check();
        return;
      }
      token.set(typed);
    }
    const body = { set: this.set.id, reason: this.inputs.reason.value.trim() };
    if (this.inputs.who.value.trim()) body.who = this.inputs.who.value.trim();
    if (this.protected) body.force = this.inputs.force.checked;
    const r = await operatorFetch(this.url, body);
    if (r.status === 401) {
      // operatorFetch forgot the refused token (a restarted dashboard has a new one): ask again.
      $(CKPT.deleteTokenLabel).hidden = false;
    }
    if (!r.ok) {
      this.showError(r.body.error);
      this.check();
      return;
    }
    this.dialog.close();
    this.onDone(r.body, this.set);
  }
}

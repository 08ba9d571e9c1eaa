// Every DOM hook of the checkpoint page, in one place; templates/checkpoints.html
// and templates/_checkpoint_*.html must match.
export const CKPT = Object.freeze({
  config: "#checkpoints-config",
  answer: "#ckpt-answer",
  connection: "#ckpt-connection",
  headline: "#ckpt-headline",
  meta: "#ckpt-meta",
  headlineResume: "#ckpt-headline-resume",
  flash: "#ckpt-flash",
  errors: "#ckpt-errors",
  tableBody: "#ckpt-table tbody",
  held: "#ckpt-held",
  heldText: "#ckpt-held-text",
  heldShow: "#ckpt-held-show",
  empty: "#ckpt-empty",
  other: "#ckpt-other",
  otherList: "#ckpt-other-list",
  ages: "[data-mtime]",
  copyButtons: "[data-copy]",
  resumeDialog: "#resume-dialog",
  resumeTitle: "#resume-title",
  resumeHow: "#resume-how",
  resumeWarnings: "#resume-warnings",
  resumeCommand: "#resume-command",
  resumeCommandNotes: "#resume-command-notes",
  resumeCode: "#resume-code",
  deleteDialog: "#delete-dialog",
  deleteForm: "#delete-form",
  deleteSummary: "#delete-summary",
  deleteFiles: "#delete-files",
  deleteProtected: "#delete-protected",
  deleteProtectedWhy: "#delete-protected-why",
  deleteForce: "#delete-force",
  deleteReason: "#delete-reason",
  deleteWho: "#delete-who",
  deleteTokenLabel: "#delete-token-label",
  deleteToken: "#delete-token",
  deleteConfirmLabel: "#delete-confirm-label",
  deleteConfirm: "#delete-confirm",
  deleteError: "#delete-error",
  deleteCancel: "#delete-cancel",
  deleteSubmit: "#delete-submit",
});

// A new element with a class and text; server data only ever goes in as text.
export function el(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

// Every DOM hook the scripts use, in one place; templates/ must match.
export const SEL = Object.freeze({
  config: "#rankwatch-config",
  runStatus: "#run-status",
  runMessage: "#run-message",
  statePill: "#state-pill",
  connection: "#connection",
  summaryValue: "[data-summary]",
  summaryLabel: "[data-label]",
  verdictCounts: "#verdict-counts",
  tableHeadRow: "#rank-table thead tr",
  tableBody: "#rank-table tbody",
  tableEmpty: "#table-empty",
  // A node row's open/close button (table.js makes them: data-node-toggle).
  nodeToggle: "button[data-node-toggle]",
  filter: "#verdict-filter",
  pager: "#pager",
  pagePrev: "#page-prev",
  pageNext: "#page-next",
  pageInfo: "#page-info",
  chartStep: "#chart-step-time",
  chartLoss: "#chart-loss",
  chartHeatmap: "#chart-heatmap",
  chartStepEmpty: "#chart-step-empty",
  chartLossEmpty: "#chart-loss-empty",
  heatmapSection: "#heatmap-section",
  // Operator token and graceful stop (stop.js, token.js).
  operatorState: "#operator-state",
  tokenOpen: "#token-open",
  tokenDialog: "#token-dialog",
  tokenForm: "#token-form",
  tokenInput: "#token-input",
  tokenError: "#token-error",
  tokenDismiss: "#token-dismiss",
  tokenForget: "#token-forget",
  stopOpen: "#stop-open",
  stopDialog: "#stop-dialog",
  stopForm: "#stop-form",
  stopReason: "#stop-reason",
  stopWho: "#stop-who",
  stopError: "#stop-error",
  stopDismiss: "#stop-dismiss",
  stopConfirm: "#stop-confirm",
  estimateRanks: "#estimate-ranks",
  estimateSeconds: "#estimate-seconds",
  estimateDir: "#estimate-dir",
  estimateBasis: "#estimate-basis",
  stopPanel: "#stop-panel",
  stopHeadline: "#stop-headline",
  stopNote: "#stop-note",
  stopRequest: "#stop-request",
  stopRequestId: "#stop-request-id",
  stopRequestBy: "#stop-request-by",
  stopRequestReason: "#stop-request-reason",
  stopRequestAt: "#stop-request-at",
  stopStages: "#stop-stages",
  stopHolding: "#stop-holding",
  stopCancel: "#stop-cancel",
  stopRearm: "#stop-rearm",
  stopRanksWrap: "#stop-ranks-wrap",
  stopRanksBody: "#stop-ranks tbody",
  stopRanksMore: "#stop-ranks-more",
  auditBody: "#audit-table tbody",
  // Stacks, the stop policy and alerts (incidents.js).
  stackDialog: "#stack-dialog",
  stackDialogTitle: "#stack-dialog-title",
  stackMeta: "#stack-meta",
  stackPending: "#stack-pending",
  stackError: "#stack-error",
  stackText: "#stack-text",
  stackNative: "#stack-native",
  stackCopy: "#stack-copy",
  stackCapture: "#stack-capture",
  stackClose: "#stack-close",
  stacksLoad: "#stacks-load",
  stacksCaptureAll: "#stacks-capture-all",
  stacksCopy: "#stacks-copy",
  stacksText: "#stacks-text",
  stacksError: "#stacks-error",
  stacksGroups: "#stacks-groups",
  policyMode: "#policy-mode",
  policyNote: "#policy-note",
  policyRules: "#policy-rules",
  alertsNote: "#alerts-note",
  alertsBody: "#alerts-table tbody",
});

export function $(selector, root = document) {
  return root.querySelector(selector);
}

export function $all(selector, root = document) {
  return Array.from(root.querySelectorAll(selector));
}

// Text in which `backticked` names (function names in stack summaries) are
// shown as <code>: built from text nodes, never innerHTML, since the text
// comes from the ranks. Rewritten only when it changed.
export function setCodeText(el, value) {
  const str = value === null || value === undefined ? "" : String(value);
  if (el.dataset.codeText === str) return;
  el.dataset.codeText = str;
  const parts = str.split("`");
  if (parts.length < 3) {
    el.textContent = str;
    return;
  }
  el.replaceChildren(...parts.map((part, i) => {
    // An unmatched last backtick stays a backtick.
    if (i % 2 === 0 || i === parts.length - 1) return document.createTextNode(i % 2 ? `\`${part}` : part);
    const code = document.createElement("code");
    code.textContent = part;
    return code;
  }));
}

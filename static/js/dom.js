// Every DOM hook the scripts use, in one place; templates/ must match.
export const SEL = Object.freeze({
  config: "#rankwatch-config",
  runStatus: "#run-status",
  runMessage: "#run-message",
  connection: "#connection",
  summaryValue: "[data-summary]",
  summaryLabel: "[data-label]",
  verdictCounts: "#verdict-counts",
  tableHeadRow: "#rank-table thead tr",
  tableBody: "#rank-table tbody",
  tableEmpty: "#table-empty",
  filter: "#verdict-filter",
  pager: "#pager",
  pagePrev: "#page-prev",
  pageNext: "#page-next",
  pageInfo: "#page-info",
  chartStep: "#chart-step-time",
  chartLoss: "#chart-loss",
  chartHeatmap: "#chart-heatmap",
  heatmapSection: "#heatmap-section",
});

export function $(selector, root = document) {
  return root.querySelector(selector);
}

export function $all(selector, root = document) {
  return Array.from(root.querySelectorAll(selector));
}

// Turning row values into text, by the metric's unit (app/metrics.py).

// A shape per verdict, so that colour is never the only cue.
export const GLYPH = Object.freeze({
  healthy: "✓", straggler: "▲", stalled: "‖", dead: "✕",
  exited: "■", finished: "★", failed: "!", pending: "…",
});

export function headerLabel(metric) {
  // Bytes and seconds pick their own scale per cell (KiB..GiB, s..h).
  const own = metric.unit === "bytes" || metric.unit === "s";
  return metric.unit && !own ? `${metric.label} (${metric.unit})` : metric.label;
}

export function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

export function formatSeconds(s) {
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 120) return `${Math.round(s)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

export function formatNumber(n) {
  if (Number.isInteger(n)) return String(n);
  if (Math.abs(n) >= 100) return n.toFixed(0);
  if (Math.abs(n) >= 10) return n.toFixed(1);
  return n.toFixed(2);
}

// Cell text for a value; the unit sits in the column header, except bytes.
export function formatValue(metric, value) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  switch (metric.unit) {
    case "bytes": return formatBytes(value);
    case "s": return formatSeconds(value);
    case "%": return value.toFixed(0);
    case "samples/s": return formatNumber(Math.round(value));
    default:
      if (metric.name === "loss") return value.toPrecision(4);
      if (metric.name === "score") return value.toFixed(2);
      return formatNumber(value);
  }
}

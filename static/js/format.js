// Turning row values into text, by the metric's unit (app/ranks/metrics.py).

// A shape per verdict, so that colour is never the only cue.
export const GLYPH = Object.freeze({
  starting: "○", healthy: "✓", straggler: "▲", stalled: "‖", dead: "✕",
  exited: "■", finished: "★", failed: "!", pending: "…",
  node_lost: "⨯", agent_lost: "⊘", corrupt: "?",
});

// A verdict as people read it: "node_lost" is "node lost".
export function verdictLabel(name) {
  return String(name).replaceAll("_", " ");
}

// "1 rank", "2 ranks", "1,024 ranks": a real plural, never "rank(s)".
export function plural(n, word, many = `${word}s`) {
  return `${isNumber(n) ? n.toLocaleString("en") : n} ${n === 1 ? word : many}`;
}

export function headerLabel(metric) {
  // Bytes and seconds pick their own scale per cell (KiB..GiB, s..h).
  const own = metric.unit === "bytes" || metric.unit === "s";
  return metric.unit && !own ? `${metric.label} (${metric.unit})` : metric.label;
}

// Every formatter takes any value: what the API passes through comes from
// files any rank can write, so a string where a number belongs, or an
// object, must become text, never an exception that stops the page.
export function isNumber(v) {
  return typeof v === "number" && Number.isFinite(v);
}

// A value that is not what was expected, shown as text rather than trusted.
function other(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "object") return "?";
  return String(v);
}

export function formatBytes(n) {
  if (!isNumber(n)) return other(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i && Math.abs(n) < 10 ? 1 : 0)} ${units[i]}`;
}

export function formatSeconds(s) {
  if (!isNumber(s)) return other(s);
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 120) return `${Math.round(s)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

export function formatNumber(n) {
  if (!isNumber(n)) return other(n);
  if (Number.isInteger(n)) return String(n);
  if (Math.abs(n) >= 100) return n.toFixed(0);
  if (Math.abs(n) >= 10) return n.toFixed(1);
  return n.toFixed(2);
}

// A number with a fixed count of decimals ("0.05"), or the value as text.
export function formatFixed(n, digits) {
  return isNumber(n) ? n.toFixed(digits) : other(n);
}

// A count with thousands separators ("12,345"), or the value as text.
export function formatCount(n) {
  return isNumber(n) ? n.toLocaleString("en") : other(n);
}

const pad2 = (n) => String(n).padStart(2, "0");

// A Unix time as the local clock time, 24-hour HH:MM:SS as the charts' axes
// (withDate: YYYY-MM-DD HH:MM:SS), or "–". One style on every page.
export function formatClock(t, withDate = false) {
  if (!isNumber(t) || t <= 0) return other(t === 0 ? null : t);
  const d = new Date(t * 1000);
  if (Number.isNaN(d.getTime())) return "?";
  const time = `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
  return withDate ? `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${time}` : time;
}

// A loss as the page writes it: NaN or ±Inf when the rank's loss was not
// finite (the row's loss is then null and loss_nonfinite names it).
const NONFINITE = { nan: "NaN", inf: "Inf", "-inf": "-Inf" };
export function formatLoss(value, nonfinite, digits = 4) {
  if (Object.hasOwn(NONFINITE, nonfinite ?? "")) return NONFINITE[nonfinite];
  return isNumber(value) ? value.toPrecision(digits) : other(value);
}

// Cell text for a value; the unit sits in the column header, except bytes.
export function formatValue(metric, value) {
  if (!isNumber(value)) return other(value);
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

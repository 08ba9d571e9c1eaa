// The live console's entry point: wires the Socket.IO stream to the store,
// the summary, the table and the charts.

import { openSocket } from "./base.js";
import { SEL, $ } from "./dom.js";
import { RankStore } from "./store.js";
import { RankTable } from "./table.js";
import { SummaryStrip } from "./summary.js";
import { Charts } from "./charts.js";
import { StopControls } from "./stop.js";
import { Incidents } from "./incidents.js";
import { Attempts } from "./attempts.js";
import { Rollbacks } from "./spikes.js";

const config = JSON.parse($(SEL.config).textContent);
const store = new RankStore();
const table = new RankTable(store, config);
const summary = new SummaryStrip(store, config, (verdict) => table.setFilter(verdict));
const charts = new Charts(store, config);

function redraw() {
  summary.render();
  table.invalidate();
}

const socket = openSocket("ranks");
socket.on("connect", () => summary.setConnection("live", "live"));
socket.on("disconnect", () => summary.setConnection("down", "reconnecting…"));
// The attempts list polls every few seconds; a change of the run's status (a launch
// starting, the job ending) also ends or begins an attempt, so it is read again at once.
let runStatus = null;
function followRunStatus() {
  const now = store.run ? store.run.status : null;
  if (now !== runStatus) {
    runStatus = now;
    attempts.load();
  }
}
// Windowed (app/ranks/window.py), the table's pager, filter and sort ask the server.
table.onView = (view) => socket.emit("ranks_view", view, (ack) => {
  if (ack && ack.error) console.warn("rankwatch: window refused:", ack.error);
});
socket.on("ranks_snapshot", (msg) => {
  charts.addRows(store.applySnapshot(msg));
  seedCharts();
  table.syncView();
  redraw();
  followRunStatus();
});
const stop = new StopControls(socket, store);
stop.onStatus = () => summary.renderPill();
const incidents = new Incidents(socket);
const attempts = new Attempts(config.urls.attempts);
const rollbacks = new Rollbacks(config.urls.spikes, (marks) => charts.run.setSpikes(marks));
socket.on("ranks_delta", (msg) => {
  charts.addRows(store.applyDelta(msg));
  redraw();
  followRunStatus();
});

// After the first snapshot: a windowed job's history (every rank's) is not
// fetched, as its size grows with the job; its charts start from the windows seen.
let seeding = false;
function seedCharts() {
  if (seeding) return;
  seeding = true;
  if (store.window) {
    charts.seed(null);
    return;
  }
  fetch(config.urls.history)
    .then((r) => (r.ok ? r.json() : Promise.reject(new Error(`HTTP ${r.status}`))))
    .then((data) => charts.seed(data))
    .catch((err) => {
      console.error("rankwatch: chart history unavailable, starting empty:", err);
      charts.seed(null);
    });
}

// Ages move with the clock even when no data arrives.
setInterval(() => {
  summary.renderAges();
  table.invalidate();
}, 1000);

// For the scale benchmark and for looking around from the browser console.
window.rankwatch = { store, table, charts, socket, stop, summary, incidents, attempts };

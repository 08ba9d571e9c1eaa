// Where this page's JSON routes and pushes are: today's /api, or, on a run's
// console under --runs (or /runs/<id>/), /api/runs/<id> and that run's rooms.
// base.html writes both on <body> (app/runs/scoping.py).

import { token } from "./token.js";

const data = document.body.dataset;
export const API = data.api || "/api";
export const RUN = data.run === undefined ? null : data.run;
// How to run `rankwatch login` on the dashboard's machine (app/edge/login.py: by its path when it is
// not on PATH, as after `make demo`).
export const LOGIN = data.login || "rankwatch login";

// "/api/exit" -> API + "/exit".
export function api(path) {
  return path.startsWith("/api/") ? API + path.slice(4) : path;
}

// Socket.IO's auth for a page: its name, its run when it has one, and the
// operator token when this tab holds one (app/ranks/events.py).
export function socketAuth(page) {
  const auth = RUN === null ? { page } : { page, run: RUN };
  const held = token.get();
  return held ? { ...auth, token: held } : auth;
}

// The page's live socket (io comes from the vendored socket.io client loaded
// before the modules). WebSocket first (lowest latency); long-polling if a
// proxy refuses it. Its auth is read at every (re)connect: with the token the
// pushes name the run directory as the operator's answers do, without it as a
// viewer's (app/push.py). A token adopted or dropped reconnects at once; one
// the server refuses (a relaunched dashboard has a new one) is dropped, as
// operatorFetch drops it, and the page watches on without it.
export function openSocket(page) {
  const socket = io({
    transports: ["websocket", "polling"],
    tryAllTransports: true,
    auth: (cb) => cb(socketAuth(page)),
  });
  let held = token.get();
  window.addEventListener("rankwatch-token", () => {
    if (token.get() === held) return;
    held = token.get();
    socket.disconnect().connect();
  });
  socket.on("connect_error", (err) => {
    const status = err.data && err.data.status;
    if ((status === 401 || status === 429) && token.get()) token.clear(true);
  });
  return socket;
}

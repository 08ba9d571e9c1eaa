// Where this page's JSON routes and pushes are: today's /api, or, on a run's
// console under --runs (or /runs/<id>/), /api/runs/<id> and that run's rooms.
// base.html writes both on <body> (app/runs/scoping.py).

const data = document.body.dataset;
export const API = data.api || "/api";
export const RUN = data.run === undefined ? null : data.run;

// "/api/exit" -> API + "/exit".
export function api(path) {
  return path.startsWith("/api/") ? API + path.slice(4) : path;
}

// Socket.IO's auth for a page: its name, and its run when it has one.
export function socketAuth(page) {
  return RUN === null ? { page } : { page, run: RUN };
}

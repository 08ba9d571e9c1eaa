// The ranks table's server-side window, for jobs above PAGE_WINDOW_RANKS
// (app/ranks/window.py): the page holds only the rows on screen, and asks the
// server (the ranks_view event) for another page, verdict filter or order.

import { formatCount } from "./format.js";

// The server's largest window (app/ranks/window.py WINDOW_PER_PAGE_MAX).
const WINDOW_PER_PAGE_MAX = 200;
// The columns the server sorts by, and its name for each order.
export const SERVER_SORTS = Object.freeze({ rank: "rank", health: "worst" });

// The window a table with these choices asks for (page counted from 1).
export function wantedView(pageSize, filter, sortKey, page) {
  return {
    page,
    per_page: Math.min(pageSize, WINDOW_PER_PAGE_MAX),
    health: filter ? [filter] : [],
    sort: SERVER_SORTS[sortKey] || "rank",
  };
}

// Whether the server's window w differs from the choices in want (the page aside:
// the server keeps a page past the last one on the last).
export function differs(want, w) {
  return want.per_page !== w.per_page || want.sort !== w.sort || want.health.join() !== w.health.join();
}

// The pager's line: which ranks are shown, of how many, and who picked them.
export function windowInfo(w, shown) {
  const first = (w.page - 1) * w.per_page;
  const range = shown ? `${formatCount(first + 1)}–${formatCount(first + shown)}` : "none";
  const picked = w.health.length ? `${w.health.join(", ")} ranks` : "ranks";
  return `showing ${picked} ${range} of ${formatCount(w.total)}`
    + `${w.sort === "worst" ? ", worst first" : ""}; sorted and filtered by the server`;
}

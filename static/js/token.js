// The operator token: kept in this tab's sessionStorage, sent as a Bearer
// header by operatorFetch. No cookie ever authorises a request, so another
// site cannot make the browser act for the operator (CSRF).

const KEY = "rankwatch.token";
// Set when the server refused the token this tab held (a relaunched dashboard
// has a new one): the page then says how to get a new one, not "enter the token".
const STALE = "rankwatch.token.stale";

export const token = {
  get() {
    return sessionStorage.getItem(KEY);
  },
  set(value) {
    sessionStorage.setItem(KEY, value);
    sessionStorage.removeItem(STALE);
    window.dispatchEvent(new Event("rankwatch-token"));
  },
  // `refused`: the server no longer takes it, rather than the operator forgetting it.
  clear(refused = false) {
    sessionStorage.removeItem(KEY);
    if (refused) sessionStorage.setItem(STALE, "1");
    else sessionStorage.removeItem(STALE);
    window.dispatchEvent(new Event("rankwatch-token"));
  },
  // True once a token of this tab was refused, until a new one is adopted.
  stale() {
    return sessionStorage.getItem(STALE) !== null;
  },
  // On every (re)connect of the page's socket: the dashboard may have been
  // relaunched with a new token, and the tab must say so before the operator
  // presses Stop, not after. A network failure proves nothing: keep the token.
  async recheck() {
    const held = this.get();
    if (!held) return;
    try {
      if (!(await checkToken(held)) && this.get() === held) this.clear(true);
    } catch {
      // unreachable or rate-limited: the next reconnect checks again
    }
  },
  // Adopt a login code now and whenever one is pasted into this tab's address
  // bar later: a new `#login=` changes only the hash, which reloads nothing.
  follow() {
    window.addEventListener("hashchange", () => this.adoptFromUrl());
    return this.adoptFromUrl();
  },
  // `python -m app` prints a URL ending in #login=<code>: a single-use code
  // (app/edge/login.py). Drop it from the address bar at once, then trade it for
  // the token; what stays in the history is a code that no longer works.
  async adoptFromUrl() {
    const match = location.hash.match(/(?:^#|&)login=([^&]+)/);
    if (!match) return;
    history.replaceState(null, "", location.pathname + location.search);
    let code;
    try {
      code = decodeURIComponent(match[1]);
    } catch {
      return;
    }
    try {
      const r = await fetch("/api/login", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ code }),
      });
      const body = await r.json();
      if (r.ok && typeof body.token === "string") this.set(body.token);
      else window.dispatchEvent(new CustomEvent("rankwatch-login-failed", { detail: String(body.error) }));
    } catch (err) {
      window.dispatchEvent(new CustomEvent("rankwatch-login-failed", { detail: String(err.message) }));
    }
  },
};

// Checks a token with the server; resolves to true, false (wrong), or throws.
export async function checkToken(value) {
  const r = await fetch("/api/session", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token: value }),
  });
  if (r.status === 401) return false;
  if (!r.ok) throw new Error(`HTTP ${r.status}`);
  return true;
}

// A JSON request with the operator token; resolves to {ok, status, body}.
export async function operatorFetch(url, body) {
  const r = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${token.get() || ""}` },
    body: JSON.stringify(body),
  });
  let data = null;
  try {
    data = await r.json();
  } catch {
    data = { error: `HTTP ${r.status}`, status: r.status };
  }
  if (r.status === 401) token.clear(true);
  return { ok: r.ok, status: r.status, body: data };
}

// The operator token: kept in this tab's sessionStorage, sent as a Bearer
// header by operatorFetch. No cookie ever authorises a request, so another
// site cannot make the browser act for the operator (CSRF).

const KEY = "rankwatch.token";

export const token = {
  get() {
    return sessionStorage.getItem(KEY);
  },
  set(value) {
    sessionStorage.setItem(KEY, value);
    window.dispatchEvent(new Event("rankwatch-token"));
  },
  clear() {
    sessionStorage.removeItem(KEY);
    window.dispatchEvent(new Event("rankwatch-token"));
  },
  // `python -m app` prints a URL ending in #token=...: take it, then drop it
  // from the address bar and history so it is not shared by accident.
  adoptFromUrl() {
    const match = location.hash.match(/(?:^#|&)token=([^&]+)/);
    if (match) {
      this.set(decodeURIComponent(match[1]));
      history.replaceState(null, "", location.pathname + location.search);
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
  if (r.status === 401) token.clear();
  return { ok: r.ok, status: r.status, body: data };
}

"""The hub's copy of every agent's checkpoint listing, fetched only when a host's version changes.

Each digest names its host's listing version (``ckpt``, ``app/agent/digest.py``).
The hub notes the hosts whose version, or agent-lost state, changed
(``Hub.listings_changed``), and ``Listings.files`` (the checkpoint
service's ``remote``, through ``HubSource.checkpoint_files``) asks only
those agents for their listing (``app/agent/ask.py``), at most one request
per host outstanding. So at rest a tick posts no request and reads none,
whatever the number of hosts; a new checkpoint set costs one request per
host that saved a file of it.

A request names the version the hub holds (``base``), and the agent answers
what changed since (``ask.files_answer``): a new set costs its new files,
not the host's whole listing. The hub asks for the whole listing when it
holds none, or when it refused a change: one for a base it did not ask
for, or one that would leave the host more than ``ask.MAX_FILES`` files.

The merged files (every path's file, from the host ``ask.pick`` chooses)
are kept up to date path by path: an answer updates the paths it changed,
and only a rank changing host chooses every path again. ``files`` returns a
new ``Remote`` when a listing, a host's note or a rank's host changed, and
during a burst of answers (a new set on every host) only once they are in or
``timeout_s`` has passed; it names the paths changed since the last one, so
the checkpoint service groups only their sets again
(``trainer_bridge.rundir.ckptgroup``). Otherwise it returns the same
``Remote`` as the last call, which tells the service that nothing changed.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from app.agent import ask
from trainer_bridge.rundir import ckptindex

_NEVER = object()  # no listing held yet (None is a version: an agent that sends none)
# A listing request stays pending as long as the agent may still pop it (its queue expires then):
# the tick never waits for it, and re-asking a host that is merely slow (thousands answering
# after a new set) would only add requests and re-groupings to its queue.
PENDING_S = ask.ASK_TTL_S


class Remote(NamedTuple):
    """What ``Listings.files`` gives the checkpoint service."""

    files: dict[str, ckptindex.CheckpointFile]  # path -> the file chosen (kept up to date: read it at once)
    errors: list[str]
    changed: frozenset[str] | None  # the paths changed since the last ``Remote`` (None: any may have)


class Listings:
    """host -> its agent's last listing, each asked for again only when its version changed."""

    def __init__(self, hub, lock: threading.RLock | threading.Lock, timeout_s: float):
        self.hub = hub
        self._lock = lock  # the view's lock, under which the hub reads the digests
        self.timeout_s = timeout_s
        self._files: dict[str, dict[str, ckptindex.CheckpointFile]] = {}  # host -> path -> its file
        self._host_errors: dict[str, list[str]] = {}  # host -> what its listing says went wrong
        self._held: dict[str, object] = {}  # host -> the version of the listing held
        self._want: dict[str, object] = {}  # host -> the newer version to ask it for
        self._asked: dict[str, tuple[object, str | None]] = {}  # host -> (version asked for, base sent)
        self._whole: set[str] = set()  # hosts whose next answer must be their whole listing
        self._lost: set[str] = set()
        self._pending = ask.Pending()
        self._errors: dict[str, str] = {}  # host -> why its last request failed
        self._waited: set[str] = set()  # hosts a request already waited for, once
        self._notes: dict[str, str] = {}
        self._owner_changes = -1
        self._holders: dict[str, str | set[str]] = {}  # path -> the host or hosts that list it
        self._chosen: dict[str, ckptindex.CheckpointFile] = {}  # path -> its file as merged
        self._dirty: set[str] = set()  # paths whose holders changed since the last merge
        self._result = Remote({}, [], None)
        self._deferred = 0.0  # since when a change waits for the answers still pending (monotonic), or 0

    def files(self, wait: bool = True) -> Remote:
        """Every agent's checkpoint files and what is wrong with them (``CheckpointService._merged``).

        It takes the answers that came since the last call and asks each live
        agent whose listing version changed, so the watcher's tick (``wait``
        False) never waits. A request (``wait``) waits, within the bound, only
        for a host never listed yet, once. A host whose agent is lost or did
        not answer keeps its last listing, and a line in ``errors`` says so;
        one not listed yet is named there too.
        """
        with self._lock:
            hub = self.hub
            notices = {h: (hub.hosts[h].lost, hub.hosts[h].digest.get("ckpt")) for h in hub.listings_changed}
            hub.listings_changed.clear()
            owner_changes = hub.owner_changes
        touched = set(notices)
        for host, (lost, version) in notices.items():
            if lost:
                self._lost.add(host)
                self._pending.pop(host, None)  # its answer, if it comes, is not waited for
                self._asked.pop(host, None)
            else:
                self._lost.discard(host)
            if version == self._held.get(host, _NEVER):
                self._want.pop(host, None)
            else:
                self._want[host] = version
        pending = self._pending
        got = ask.collect(self.hub, pending) | ask.overdue(self.hub, pending, max(PENDING_S, self.timeout_s))
        listed = self._take(got)
        # Still waited for, but past the bound a page waits: its note says so meanwhile.
        now = time.monotonic()
        for host, (*_, sent) in pending.items():
            if now - sent >= self.timeout_s and host not in self._errors:
                self._errors[host] = f"the agent on host {host} did not answer within {self.timeout_s:g} s"
                touched.add(host)
        due = {h: v for h, v in self._want.items() if h not in pending and h not in self._lost}
        bases = {h: self._base(h) for h in due}
        later = ask.post(self.hub, dict.fromkeys(due, ("ckpt", None)), pending, bases)
        self._asked.update((h, (v, bases[h])) for h, v in due.items() if h in pending)
        first = [h for h in pending if h not in self._files and h not in self._waited]
        if first and wait:
            self._waited.update(first)
            deadline = time.monotonic() + self.timeout_s
            while any(h in pending for h in first) and time.monotonic() < deadline:
                time.sleep(ask.POLL_S)
                later |= ask.collect(self.hub, pending)
        listed |= self._take(later)  # the hosts not asked (Redis away), and the answers waited for
        touched.update(got, later)
        rebuild = listed or owner_changes != self._owner_changes
        for host in touched:
            note = self._note(host)
            if note != self._notes.get(host):
                rebuild = True
                if note is None:
                    del self._notes[host]
                else:
                    self._notes[host] = note
        if rebuild or self._deferred:
            if not wait and pending:
                # A new set reaches every host within a second or so, and their answers over a few
                # ticks: group the files once they are in (or the bound has passed), not at each tick.
                self._deferred = self._deferred or time.monotonic()
                if time.monotonic() - self._deferred < self.timeout_s:
                    self.hub.listings_pending = len(pending)
                    return self._result
            self._deferred = 0.0
            changed = self._merge(owner_changes)
            errors = [e for h in sorted(self._host_errors) for e in self._host_errors[h]]
            self._result = Remote(
                self._chosen, errors + [self._notes[h] for h in sorted(self._notes)], changed
            )
        self.hub.listings_pending = len(pending)
        return self._result

    def _base(self, host: str) -> str | None:
        """The version a request asks ``host`` for the changes since (None: its whole listing)."""
        held = self._held.get(host)
        return held if isinstance(held, str) and host in self._files and host not in self._whole else None

    def _take(self, got: dict[str, dict | str]) -> bool:
        """Keep the answers (host -> listing or its changes, or why none); whether a listing came."""
        listed = False
        for host, answer in got.items():
            version, base = self._asked.pop(host, (None, None))
            if not isinstance(answer, dict):
                self._errors[host] = answer  # still wanted: asked again on the next call
                continue
            why = self._apply(host, answer, base)
            if why is not None:
                # Refused, and counted with the hostile digests; the next request asks for it all.
                self.hub.refuse(f"a listing of host {host[:100]!r}: {why}")
                self._whole.add(host)
                self._errors[host] = f"the agent on host {host} sent a listing refused: {why}"
                continue
            self._whole.discard(host)
            version = answer.get("version", version)
            self._held[host] = version
            if self._want.get(host, _NEVER) == version:
                del self._want[host]
            self._errors.pop(host, None)
            listed = True
        return listed

    def _apply(self, host: str, answer: dict, base: str | None) -> str | None:
        """Take ``host``'s listing or its changes (checked by ``ask.check``); why not, if refused."""
        entries = answer["files"]
        self.hub.listing_entries += len(entries) + len(answer.get("removed", ()))
        held = self._files.setdefault(host, {})
        if answer.get("base") is None:
            new = {e["path"]: ckptindex.from_listing(e, host) for e in entries}
            changes = {p: new.get(p) for p in held.keys() | new.keys() if held.get(p) != new.get(p)}
        else:
            if answer["base"] != base:
                return f"changes since version {answer['base'][:64]}, not the one held"
            removed = set(answer.get("removed", ()))
            new_paths = {e["path"] for e in entries}
            gone = removed & held.keys()
            if len(held) - len(gone) + len(new_paths - held.keys()) + len(new_paths & gone) > ask.MAX_FILES:
                return f"it would leave more than {ask.MAX_FILES} files"
            changes = dict.fromkeys(gone - new_paths)
            changes.update((e["path"], ckptindex.from_listing(e, host)) for e in entries)
        for path, f in changes.items():
            self._hold(host, path, f)
        self._host_errors[host] = [f"host {host}: {e}" for e in answer["errors"]]
        return None

    def _hold(self, host: str, path: str, f: ckptindex.CheckpointFile | None) -> None:
        """``host`` now lists ``path`` as ``f`` (None: no longer lists it)."""
        held, holders = self._files[host], self._holders.get(path)
        if f is not None:
            held[path] = f
            if holders is None:
                self._holders[path] = host
            elif isinstance(holders, set):
                holders.add(host)
            elif holders != host:
                self._holders[path] = {holders, host}
        elif held.pop(path, None) is not None:
            if isinstance(holders, set):
                holders.discard(host)
                if len(holders) == 1:
                    self._holders[path] = holders.pop()
            else:
                del self._holders[path]
        self._dirty.add(path)

    def _merge(self, owner_changes: int) -> frozenset[str] | None:
        """Choose again the files of the paths that changed (of every path, when a rank changed
        host); the paths changed, or None for all."""
        if owner_changes != self._owner_changes:
            with self._lock:
                owner = dict(self.hub.owner)
            self._chosen.clear()
            for path in self._holders:
                self._choose(path, owner)
            self._owner_changes = owner_changes
            self._dirty.clear()
            return None
        ranks = {self._rank(path) for path in self._dirty}
        with self._lock:  # the hosts of the ranks concerned only, not a copy of every rank's
            owner = {rank: self.hub.owner.get(rank) for rank in ranks}
        for path in self._dirty:
            self._choose(path, owner)
        changed, self._dirty = frozenset(self._dirty), set()
        return changed

    def _rank(self, path: str) -> int | None:
        """The rank of ``path``'s file (the same for every copy: it comes from the path), if held."""
        holders = self._holders.get(path)
        if holders is None:
            return None
        return self._files[holders if isinstance(holders, str) else next(iter(holders))][path].rank

    def _choose(self, path: str, owner) -> None:
        holders = self._holders.get(path)
        if holders is None:
            self._chosen.pop(path, None)
            return
        if isinstance(holders, set):  # nodes sharing a directory list the same paths
            holders = ask.pick(holders, owner.get(self._rank(path)))
        self._chosen[path] = ask.placed(self._files[holders][path], owner)

    def _note(self, host: str) -> str | None:
        """What the checkpoint page says of ``host``'s listing, if anything is amiss."""
        why = f"the agent on host {host} is lost" if host in self._lost else self._errors.get(host)
        if why is not None:
            return f"{why}: its files as it last listed them" if host in self._files else why
        if host not in self._files:
            return f"the agent on host {host} has not listed its checkpoint files yet"
        return None

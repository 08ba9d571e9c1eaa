"""``ckptindex.build_index`` kept up to date: told which paths changed, it groups only their sets again.

A hub holds every node's checkpoint files (hundreds of thousands at 12,500
hosts); a new set on a node changes a few of them. ``Grouping.index`` takes
every file by path and the paths added, changed or gone since its last call,
and rebuilds only the sets those paths were or are in (``ckptindex._make_set``,
the same code as a full grouping). A layout holding a file whose global step
is unknown is grouped whole again when it changes, as the file's set comes
from its peers' names (``ckptindex._members``); so does everything when the
world size changes or is unknown, or when the caller cannot say what changed.
The result is ``build_index``'s for the same files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from trainer_bridge.rundir.ckptindex import (
    SET_FORMATS,
    CheckpointFile,
    CheckpointSet,
    Index,
    _make_set,
    _members,
    _order,
    build_index,
    set_key,
)

Layout = tuple[str, str]  # (origin, layout)


class Grouping:
    """The sets of every file by path, regrouped only where the paths changed."""

    def __init__(self):
        self._world: int | None = None
        self._files: dict[str, CheckpointFile] = {}
        self._layouts: dict[Layout, dict[str, CheckpointFile]] = {}
        self._loose: dict[Layout, int] = {}  # files of the layout whose global step is unknown
        self._keys: dict[Layout, dict[tuple, dict[str, CheckpointFile]]] = {}
        self._sets: dict[tuple[Layout, tuple], CheckpointSet] = {}
        self._others: dict[str, CheckpointFile] = {}
        self._ordered: tuple[tuple[CheckpointSet, ...], tuple[CheckpointFile, ...]] = ((), ())

    def index(
        self,
        run_dir: str,
        files: Mapping[str, CheckpointFile],
        changed: Iterable[str] | None,
        world_size: int | None,
        errors: Iterable[str],
        scanned_at: float,
    ) -> Index:
        """The index of ``files`` (path -> file); ``changed``: the paths added, changed or gone
        since the last call (None: any may have)."""
        if world_size is None:  # each layout's world is then its highest rank's: grouped whole
            self.__init__()
            return build_index(run_dir, list(files.values()), None, tuple(errors), scanned_at)
        if changed is None or world_size != self._world:
            self.__init__()
            self._world = world_size
            changed = files.keys()
        whole: set[Layout] = set()
        keys: set[tuple[Layout, tuple]] = set()
        others = False
        for path in changed:
            for f, add in ((self._files.pop(path, None), False), (files.get(path), True)):
                if f is None:
                    continue
                if add:
                    self._files[path] = f
                if f.meta.format not in SET_FORMATS:
                    others = True
                    if add:
                        self._others[path] = f
                    else:
                        del self._others[path]
                    continue
                lay = (f.origin, f.layout)
                members = self._layouts.setdefault(lay, {})
                if add:
                    members[path] = f
                else:
                    del members[path]
                if f.meta.global_step is None:
                    self._loose[lay] = self._loose.get(lay, 0) + (1 if add else -1)
                    whole.add(lay)
                    continue
                key = set_key(f)
                in_key = self._keys.setdefault(lay, {}).setdefault(key, {})
                if add:
                    in_key[path] = f
                else:
                    in_key.pop(path, None)
                keys.add((lay, key))
        whole |= {lay for lay, _ in keys if self._loose.get(lay)}
        for lay in whole:
            self._regroup(lay)
        for lay, key in keys:
            if lay not in whole:
                self._remake(lay, key)
        sets, other_files = self._ordered
        if whole or keys:
            sets = tuple(sorted(self._sets.values(), key=_order, reverse=True))
        if others:
            other_files = tuple(sorted(self._others.values(), key=lambda f: f.path))
        self._ordered = (sets, other_files)
        return Index(run_dir, scanned_at, world_size, sets, other_files, tuple(errors))

    def _regroup(self, lay: Layout) -> None:
        """Group every file of layout ``lay`` again (one of them has no global step of its own)."""
        for key in list(self._keys.get(lay, ())):
            self._sets.pop((lay, key), None)
        group = self._layouts.get(lay) or {}
        self._keys[lay] = {key: {f.path: f for f in fs} for key, fs in _members(group.values()).items()}
        for key in self._keys[lay]:
            self._remake(lay, key)
        if not group:
            self._layouts.pop(lay, None)
            self._keys.pop(lay, None)
            self._loose.pop(lay, None)

    def _remake(self, lay: Layout, key: tuple) -> None:
        members = self._keys.get(lay, {}).get(key)
        if not members:
            self._sets.pop((lay, key), None)
            self._keys.get(lay, {}).pop(key, None)
            return
        self._sets[(lay, key)] = _make_set(lay[0], lay[1], key, list(members.values()), self._world)

"""Agent lost, node lost: a host whose agent went silent, judged by the other hosts' progress.

A host whose agent sent no digest for ``lost_after_s`` (by this process's
clock, while Redis answers) is ``agent lost``: its ranks' rows say so, with
their last known figures, and they are not counted as ended, since only the agent is known to be gone,
not the ranks. The other hosts then tell the two cases apart, because the
ranks of a data-parallel job step together (every step's collective needs
every rank):

* if the other hosts' ranks stepped well after the silent host's last
  digest and still step, its ranks are training: only the agent is gone
  (``agent lost``, and the reason says how we know);
* if every other host's ranks are stalled, the silent node is the one
  nobody can see, and likely gone (a machine or network failure): ``node
  lost``.

Otherwise (one host, or no evidence yet) it stays ``agent lost``. The next
digest from that host ends either. While Redis is unreachable nobody can be
heard, so nobody is judged lost; the clocks restart when it returns.

``app.agent.hub.Hub`` keeps a ``HostView`` per host and asks these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from app.agent import digest as dg


@dataclass
class HostView:
    digest: dg.Digest
    heard_at: float  # this process's clock when the last digest came
    ranks: set[int] = field(default_factory=set)
    lost: bool = False
    # While lost: True when the node looks gone, False when its ranks evidently train, None unknown.
    gone: bool | None = None
    evidence: str = ""


def judge_lost(lost: list[HostView], hosts: Iterable[HostView], lost_after_s: float, now: float) -> set[int]:
    """Each lost host's verdict (node gone, only the agent, or unknown); the ranks whose shown row changed."""
    live = [v.digest for v in hosts if not v.lost]
    stepped = max((d["last_step_at"] for d in live if d["last_step_at"] is not None), default=None)
    # Every other host has ranks stalled and none still training at its pace.
    stalled = bool(live) and all(
        d["counts"].get("stalled", 0) > 0
        and not any(d["counts"].get(v, 0) for v in ("healthy", "straggler", "starting"))
        for d in live
    )
    changed: set[int] = set()
    for view in lost:
        silent_since = view.digest["time"]
        # Stepping well after its silence began, and still stepping now.
        if stepped is not None and stepped > max(silent_since + lost_after_s / 2, now - lost_after_s):
            gone = False
            evidence = (
                f"the other hosts' ranks stepped {stepped - silent_since:.0f} s after its last digest, "
                "which a data-parallel job cannot do without this host's ranks: they are training"
            )
        elif stalled:
            gone = True
            evidence = (
                f"its agent and ranks went silent {now - view.heard_at:.0f} s ago and every other "
                "host's ranks are stalled: the node is likely gone (a machine or network failure)"
            )
        else:
            gone, evidence = None, ""
        if gone != view.gone:  # the evidence's wording is kept from the moment the judgement changed
            changed |= view.ranks
            view.gone, view.evidence = gone, evidence
    return changed


def shown_row(row: dict, view: HostView, now: float) -> dict:
    """A rank's row as the page shows it: its agent's, or ``agent_lost`` (``node_lost``) with its last figures."""
    if not view.lost:
        return row
    ago = now - view.heard_at
    host = view.digest["host"]
    if view.gone:
        return {
            **row,
            "health": "node_lost",
            "reason": f"host {host}: {view.evidence} (last known: {row['health']})",
            "score": None,
        }
    known = (
        f"{view.evidence}; only the agent is gone"
        if view.gone is False
        else "it may still be training: the other hosts' progress shows which, once it is clear"
    )
    return {
        **row,
        "health": "agent_lost",
        "reason": (
            f"the agent on host {host} has sent no digest for {ago:.0f} s: this rank's "
            f"state is not reported (last known: {row['health']}); {known}"
        ),
        "score": None,
    }

"""How concurrent copies share one PCIe link direction: processor sharing in modelled time (pure).

A copy is a *flow* with `left` seconds of link work (its cost alone: latency + bytes / bandwidth,
pinned or pageable). While `n` flows are active each progresses at 1/n link-second per second, so a
copy alone ends exactly when the link model says, two at once each take about twice as long, and the
link is never idle while a flow waits. State changes only at arrivals and departures, which are
modelled times: the result does not depend on when the host threads that own the flows run.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Work below this is done (float rounding of repeated subtraction).
EPSILON = 1e-12


@dataclass
class Flow:
    flow_id: int
    left: float  # link seconds of work still to do
    owner: int = 0  # pid of the process that waits for it (dead owners' flows are dropped)


def finish_times(flows: list[Flow], now: float) -> dict[int, float]:
    """When each flow ends if no other flow arrives after `now`."""
    ends: dict[int, float] = {}
    t, done = now, 0.0
    active = sorted(flows, key=lambda f: f.left)
    for i, flow in enumerate(active):
        t += (flow.left - done) * (len(active) - i)
        done = flow.left
        ends[flow.flow_id] = t
    return ends


def advance(flows: list[Flow], since: float, until: float) -> tuple[list[Flow], dict[int, float]]:
    """The flows still active at `until` (with their work left) and the end time of each flow that
    finished in (since, until]."""
    ends = {fid: t for fid, t in finish_times(flows, since).items() if t <= until + EPSILON}
    active = [f for f in flows if f.flow_id not in ends]
    # Between departures the active count is constant: replay the departures in order.
    t = since
    remaining = sorted(flows, key=lambda f: f.left)
    progressed = 0.0
    for flow in remaining:
        if flow.flow_id in ends:
            progressed = flow.left
            t = ends[flow.flow_id]
    share = (until - t) / len(active) if active else 0.0
    return [Flow(f.flow_id, max(0.0, f.left - progressed - share), f.owner) for f in active], ends

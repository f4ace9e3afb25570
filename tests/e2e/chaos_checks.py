"""The invariants of the randomized fault test (tests/e2e/test_chaos.py), computed from what
the workers, the clients and Redis saw; each check returns its figures and its violations.

- Load at a worker, from the worker's own view (`GET /sim/peak`, read every ~150 ms): the
  peak in flight (running + waiting) of every window, and the span of every request
  [start, end]. From the spans the exact number in flight at any instant is known, on one
  clock (time.monotonic() is the host's), so an overshoot is placed in time exactly and
  compared with the faults' times.
- An account's requests in flight, from the same spans (request ids tell the account): the
  workers can only run what the gateway admitted, so more of one account at the workers at
  once than its `max_concurrency` means the gateway broke the account's limit.
- A client hang-up reaches the worker as a closed connection that the worker notices some
  event-loop turns later (later still on a busy host); meanwhile the gateway may already
  have given the slot to the next request, which the worker may count first. The gateway
  cannot give the slot away before the client left, so a hung-up request's span is taken
  to end when the client was due to hang up (`hung_up`). Any other span is taken whole.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from tests.e2e.chaos_fleet import Fault
from tests.e2e.chaos_traffic import Outcome

SpanRow = tuple[str, float, float, bool]  # request id, start, end, aborted


@dataclass(frozen=True)
class Window:
    worker: str
    since: float
    until: float
    peak: int  # most requests in flight (running + waiting) at the worker in the window


@dataclass
class Seen:
    windows: list[Window] = field(default_factory=list)
    spans: dict[str, list[SpanRow]] = field(default_factory=lambda: defaultdict(list))
    dropped: int = 0


async def watch(sims: dict[str, str], stop: asyncio.Event, every_s: float) -> Seen:
    """Read every worker's `/sim/peak` each `every_s` until `stop` is set, then once more."""
    seen = Seen()
    since = dict.fromkeys(sims, time.monotonic())
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            last = stop.is_set()
            for worker, url in sims.items():
                load = (await http.get(url + "/sim/peak")).json()
                now = time.monotonic()
                seen.windows.append(Window(worker, since[worker], now, int(load["peak_inflight"])))
                since[worker] = now
                seen.spans[worker] += [tuple(row) for row in load["spans"]]
                seen.dropped += int(load["spans_dropped"])
            if last:
                return seen
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


def covered(faults: Sequence[Fault], spans: Iterable[SpanRow], grace_s: float, mark: str) -> int:
    """How many empty restarts found a request whose id contains `mark` (a long stream) at a
    worker from the kill until the grace ended: those test the write-back for real."""
    long = [(start, end) for rid, start, end, _ in spans if mark in rid]
    return sum(
        1
        for f in faults
        if f.kind == "restart_empty" and any(a <= f.start and f.end + grace_s <= b for a, b in long)
    )


def graces(faults: Sequence[Fault], grace_s: float) -> list[tuple[float, float]]:
    """When Redis may have forgotten what is in flight: from the kill of each empty restart
    until `grace_s` after it answered again (its replicas write everything back by then);
    overlapping windows merged."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((f.start, f.end + grace_s) for f in faults if f.kind == "restart_empty"):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def hung_up(spans: Iterable[SpanRow], due: dict[str, float]) -> list[SpanRow]:
    """The spans, those of requests the client hung up ending when it was due to (`due`
    by request id), if the worker saw them end later."""
    settled = []
    for rid, start, end, aborted in spans:
        if aborted and rid in due:
            end = min(end, max(start, due[rid]))
        settled.append((rid, start, end, aborted))
    return settled


def _inside(t: float, grace: Iterable[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in grace)


def crowding(
    spans: Iterable[SpanRow], limit: int, grace: list[tuple[float, float]]
) -> list[tuple[float, float, int, int]]:
    """The stretches of time in which more than `limit` spans overlap: (from, to, how many,
    how many of those began within a grace window)."""
    # The grace windows' edges cut stretches, so each lies inside one or outside all.
    events: list[tuple[float, int, int]] = [(t, 0, 0) for window in grace for t in window]
    for _, start, end, _ in spans:
        if end > start:
            late = int(_inside(start, grace))
            events += [(start, 1, late), (end, -1, -late)]
    events.sort()  # at equal times an end (-1) sorts before a start
    found: list[tuple[float, float, int, int]] = []
    count = carried = 0
    for i, (t, step, late) in enumerate(events[:-1]):
        count, carried = count + step, carried + late
        after = events[i + 1][0]
        if count > limit and after > t:
            found.append((t, after, count, carried))
    return found


@dataclass
class Overshoot:
    """Most in flight above a limit: inside the grace windows after empty restarts; past
    them, by requests admitted within them; and otherwise (a violation)."""

    inside: int = 0
    carried: int = 0
    outside: int = 0
    # How long after its restart's kill the last overshoot inside a grace window ended.
    settled_s: float = 0.0
    where: list[str] = field(default_factory=list)


def overshoot(
    what: str,
    spans: Iterable[SpanRow],
    limit: int,
    grace: list[tuple[float, float]],
    t0: float,
) -> Overshoot:
    """docs/api.md: never above `limit` by more than what was admitted while Redis had forgotten
    what is in flight. So at any instant: at most twice the limit; outside the grace
    windows, at most the limit plus the requests still running that began within one."""
    found = Overshoot()
    stretch: list[float] = []  # an overshoot not so explained: [from, to, most at once]
    for start, end, count, carried in crowding(spans, limit, grace):
        if count > 2 * limit:
            found.where.append(f"{what}: {count} in flight > 2 x {limit} at {start - t0:.3f}s")
        within = [a for a, b in grace if a <= start and end <= b]
        if within:
            found.inside = max(found.inside, count - limit)
            found.settled_s = max(found.settled_s, end - within[0])
            continue
        if count - carried <= limit:
            found.carried = max(found.carried, count - limit)
            continue
        found.outside = max(found.outside, count - carried - limit)
        if stretch and stretch[1] == start:
            stretch[1:] = [end, max(stretch[2], count - carried)]
            continue
        if stretch:
            found.where.append(_outside(what, limit, stretch, grace, t0))
        stretch = [start, end, count - carried]
    if stretch:
        found.where.append(_outside(what, limit, stretch, grace, t0))
    return found


def _outside(
    what: str, limit: int, stretch: list[float], grace: list[tuple[float, float]], t0: float
) -> str:
    start, end, most = stretch
    return (
        f"{what}: {most:.0f} in flight > {limit} (not counting what began in a grace window) "
        f"from {start - t0:.3f}s to {end - t0:.3f}s {_near(start, grace, t0)}"
    )


def _near(t: float, grace: list[tuple[float, float]], t0: float) -> str:
    before = [(a, b) for a, b in grace if a <= t]
    if not before:
        return "(no empty restart before)"
    a, b = before[-1]
    return f"(the last grace window was {a - t0:.3f}s to {b - t0:.3f}s)"


def peaks_over(
    windows: Iterable[Window],
    limit: int,
    grace: list[tuple[float, float]],
    spans: dict[str, list[SpanRow]],
    due: dict[str, float],
    t0: float,
) -> list[str]:
    """The polled check, throughout: each window's peak at a worker is at most `limit`
    (twice that when the window meets a grace window), plus the requests at that worker
    that began within a grace window and ran into this one, plus those hung up that it saw
    end within the window (it may count them after the slot was given away)."""
    ends: dict[str, list[float]] = {
        w: sorted(end for rid, _, end, aborted in rows if aborted and rid in due)
        for w, rows in spans.items()
    }
    carried = {
        w: [(start, end) for _, start, end, _ in rows if _inside(start, grace)]
        for w, rows in spans.items()
    }
    bad = []
    for w in windows:
        overlaps = any(a <= w.until and w.since <= b for a, b in grace)
        late = ends.get(w.worker, [])
        lagging = bisect.bisect_right(late, w.until) - bisect.bisect_left(late, w.since)
        running = sum(1 for a, b in carried.get(w.worker, []) if a <= w.until and w.since <= b)
        bound = (2 * limit if overlaps else min(2 * limit, limit + running)) + lagging
        if w.peak > bound:
            bad.append(
                f"worker {w.worker}: peak {w.peak} in flight > {bound} in "
                f"[{w.since - t0:.2f}, {w.until - t0:.2f}]s{' (grace)' if overlaps else ''}"
            )
    return bad


@dataclass
class Waits:
    longest_s: float = 0.0
    fail_fast_s: float = 0.0  # the longest wait of a request that may not queue
    overrun_s: float = 0.0  # the most a queued request waited past its queue timeout
    late: list[str] = field(default_factory=list)


def waits(
    outcomes: Iterable[Outcome],
    queue_timeout: dict[str, float],
    slack_s: float,
    starved: Callable[[float, float], float] = lambda start, end: 0.0,
) -> Waits:
    """Every answer came within its tier's queue timeout (none for fail_fast) plus `slack_s`
    (a Redis call's deadline, one sweep, a margin): nobody waits on a stalled Redis. Time a
    process on the path spent waiting for a CPU meanwhile (`starved`, tests/e2e/
    starvation.py) is not the gateway waiting: it does not count."""
    found = Waits()
    for out in outcomes:
        if out.status is None:
            continue
        took = out.answered - out.sent - starved(out.sent, out.answered)
        found.longest_s = max(found.longest_s, took)
        allowed = 0.0 if out.spec.fail_fast else queue_timeout[out.spec.tier]
        if out.spec.fail_fast:
            found.fail_fast_s = max(found.fail_fast_s, took)
        else:
            found.overrun_s = max(found.overrun_s, took - allowed)
        if took > allowed + slack_s:
            found.late.append(
                f"{out.spec.rid}: answered {out.status} after {took:.2f}s > "
                f"{allowed + slack_s:.2f}s"
            )
    return found


def outages(
    outcomes: Iterable[Outcome], faults: Sequence[Fault], margin_s: float, t0: float
) -> tuple[int, list[str]]:
    """A 503 (Redis unreachable) only while Redis was killed or stalled, or within
    `margin_s` after it answered again; how many 503s there were."""
    spells = [(f.start, f.end + margin_s) for f in faults if f.kind != "kill_replica"]
    count, bad = 0, []
    for out in outcomes:
        if out.status != 503:
            continue
        count += 1
        if not any(a <= out.answered and out.sent <= b for a, b in spells):
            bad.append(
                f"{out.spec.rid}: 503 at {out.answered - t0:.3f}s (sent at {out.sent - t0:.3f}s) "
                f"from {out.replica.name}, Redis was well: {out.message}"
            )
    return count, bad


def unanswered(outcomes: Iterable[Outcome]) -> list[str]:
    """Every request gets a whole answer (a 2xx read to its end, or an error), except when
    the client hangs up or the replica it was talking to was killed."""
    bad = []
    for out in outcomes:
        if out.code == "hangup":
            continue
        killed = out.replica.killed
        if out.code == "connection" and killed is not None and killed <= out.ended:
            continue
        if out.code in ("connection", "timeout"):
            bad.append(f"{out.spec.rid}: {out.code} (status {out.status}) from {out.replica.name}")
        elif out.status == 200 and not out.completed:
            bad.append(f"{out.spec.rid}: a 200 that did not end well from {out.replica.name}")
    return bad


@dataclass
class Records:
    missing: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    checked: int = 0  # requests that must have exactly one record
    # One record (one attempt) in two Redis epochs: Redis ran a release whose reply never
    # came (killed or stalled), so the gateway spooled the record and sent it again, to the
    # Redis that replaced the one that had it. Production, which lost that Redis, sees it
    # once; only this test reads the lost one. Allowed only if the lost copy was written
    # shortly before its Redis was lost (else the record was simply sent twice).
    resurrected: list[str] = field(default_factory=list)


def records(
    outcomes: Sequence[Outcome],
    epochs: Sequence[Sequence[dict[str, str]]],
    lost_at: Sequence[float],
    reached: set[str],
    margin_s: float,
) -> Records:
    """Usage records against what the clients and workers saw, over every Redis of the run:
    `epochs[0]` the last, `epochs[n]` the one an empty restart emptied at `lost_at[n]`
    (the wall clock):
    - a request that reached a worker or got a 2xx, from a replica that lived `margin_s`
      past the request's end (its release had time to be sent or spooled), has a record;
    - none has two: not two in one Redis, nor two admissions (`attempt`) anywhere, nor one
      in two Redis unless the first was written within `margin_s` before it was lost;
    - none for a request refused before admission (429, 503): it never reached a worker;
      a flex request preempted before its first byte (429 `preempted`) was admitted: it has
      a record, and that record says `preempted`;
    - a record names one of this run's requests, and a complete 2xx says status 200."""
    found = Records()
    per_rid: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
    for n, epoch in enumerate(epochs):
        for record in epoch:
            per_rid[record["request_id"]].append((n, record))
    by_rid = {out.spec.rid: out for out in outcomes}
    for rid, seen in per_rid.items():
        if rid not in by_rid:
            found.unexpected.append(f"{rid}: a record for no request of this run")
        if len(seen) > 1:
            _twice(found, rid, seen, lost_at, margin_s)
    for out in outcomes:
        rid, recs = out.spec.rid, [r for _, r in per_rid.get(out.spec.rid, [])]
        preempted = out.status == 429 and out.code == "preempted"
        admitted = preempted or rid in reached or (out.status is not None and out.status < 300)
        killed = out.replica.killed
        if admitted and (killed is None or killed > out.ended + margin_s):
            found.checked += 1
            if not recs:
                found.missing.append(f"{rid}: {out.status} from {out.replica.name}, no record")
        if preempted and recs and not any(r.get("preempted") in ("1", "true") for r in recs):
            found.unexpected.append(f"{rid}: preempted, yet no record says so")
        if not preempted and out.status in (429, 503) and (recs or rid in reached):
            found.unexpected.append(f"{rid}: refused {out.status} {out.code} yet admitted/billed")
        if out.completed and recs and recs[0].get("status") != "200":
            found.unexpected.append(f"{rid}: completed 2xx, record says {recs[0].get('status')}")
    return found


def _twice(
    found: Records,
    rid: str,
    recs: list[tuple[int, dict[str, str]]],
    lost_at: Sequence[float],
    margin_s: float,
) -> None:
    where = Counter(n for n, _ in recs)
    attempts = {r.get("attempt", "") for _, r in recs}
    # Every copy but the newest (epoch 0 is the last Redis) was written just before its
    # Redis was lost.
    older = sorted(recs, key=lambda nr: nr[0] or len(lost_at))[:-1]
    late = all(0 <= lost_at[n] - float(r["_at"]) <= margin_s for n, r in older if n)
    described = f"{rid}: {len(recs)} records (per epoch {dict(where)}, attempts {attempts}"
    if max(where.values()) == 1 and len(attempts) == 1 and late and 0 not in dict(older):
        found.resurrected.append(f"{described})")
    else:
        ages = [round(lost_at[n] - float(r["_at"]), 3) for n, r in older if n]
        found.duplicated.append(f"{described}, written {ages}s before their Redis was lost)")

"""How long Redis keeps what a replica holds without hearing from it, and how often its
sweeps name its waiters: each derived from the sweep interval and the command timeout."""

from __future__ import annotations

from dataclasses import dataclass

# A replica's sweeps name each of its waiters once, at the first sweep after it queued,
# whenever Redis may have lost them (routing/admission/keeper.py), and every this many
# rounds anyway: a last net for what no sign shows (a key evicted, a subscription that
# broke without a word and before its probe saw it: routing/admission/wakeups.py).
NAME_EVERY = 30


@dataclass(frozen=True, slots=True)
class Timing:
    """How long Redis keeps what a replica holds without hearing from it."""

    lease_ttl_ms: int
    # A slot granted to a waiter lasts this long until its replica's next sweep keeps it
    # (as every lease it holds), or goes back: a grant to a replica that died returns
    # quickly. The wake-up may come just after a sweep left, which takes at most the command
    # timeout (else it fails as an outage); the next starts at most an interval after it
    # ended and lands within the timeout too: two intervals and two timeouts cover it; one
    # interval more makes `trust_ms` (what is left once the next sweep is allowed for) two
    # intervals, so a wake-up read on time needs no call.
    claim_ms: int
    # A waiter stays queued this long past its replica's last sweep of the model (the
    # replica's entry in `alive`, prelude `bury`).
    waiter_ttl_ms: int
    # Once Redis is found to have lost a model's state, grants pause this long: every
    # replica's next sweep (and write-back) lands within it. A sweep starts at most an
    # interval after the last one ended and takes at most the command timeout (else it
    # fails as an outage): a slow Redis delays write-backs by its round trip.
    rebuild_ms: int = 1500
    # A woken waiter uses its grant without asking Redis while its wake-up is read within
    # this long of its grant (the time the wake-up says, routing/admission/wakeups.py), or
    # else of the last call that found it queued (`Waiter.kept`): its replica's next
    # sweep (one already on its way may not name it: at most a timeout, an interval, and a
    # timeout again) keeps the grant before its claim time ends. Later (its replica was
    # stopped, its loop stalled), the grant may have gone back and another request taken the
    # slot: it asks Redis first (routing/admission/waiting.py `wait`). 0: it always asks.
    trust_ms: int = 0
    # The longest a Redis call may take before it counts as an outage.
    command_timeout_ms: int = 0

    @classmethod
    def of(cls, lease_ttl_s: float, sweep_interval_s: float, command_timeout_s: float) -> Timing:
        sweep_ms = int(sweep_interval_s * 1000)
        timeout_ms = int(command_timeout_s * 1000)
        claim_ms = max(3000, 3 * sweep_ms + 2 * timeout_ms)
        waiter_ttl_ms = max(3000, 3 * sweep_ms)
        return cls(
            int(lease_ttl_s * 1000),
            claim_ms,
            waiter_ttl_ms,
            sweep_ms * 3 // 2 + timeout_ms,
            max(0, claim_ms - sweep_ms - 2 * timeout_ms),
            timeout_ms,
        )

"""One admitted request's life as the benchmarks of Redis's cost see it: a config of
models, the usage record the gateway writes, the batches captured at the store's `send`,
and their replay with a fresh lease id each time (bench/redis_cost.py, bench/cluster_cost.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any

from rediskit import TAG

from routing.admission.admit import Admission
from routing.store.base import Store
from routing.store.wire import Transaction
from tiers.usage import UsageRecord, cost_usd

Command = tuple[Any, ...]
# One captured life: the batches it sent (one round trip each) and its lease id.
Captured = tuple[list[list[Command]], str]


def config_text(models: Sequence[str]) -> str:
    rows = "".join(
        f"  {m}: {{endpoints: [{{url: 'http://127.0.0.1:9/a', max_concurrency: 16, model: m}},"
        f" {{url: 'http://127.0.0.1:9/b', max_concurrency: 16, model: m}}]}}\n"
        for m in models
    )
    return f"redis: {{url: 'redis://unused', lease_ttl_s: 30}}\nmodels:\n{rows}"


@contextlib.contextmanager
def recording(store: Any) -> Iterator[list[list[Command]]]:
    """Every batch the store sends (one round trip each), as sent. Wraps the store's own
    `send` (routing/store/resp.py, routing/store/cluster.py), under whatever Scripts calls it."""
    batches: list[list[Command]] = []
    original = store.send

    def send(commands: Sequence[Sequence[Any]]) -> Any:
        batches.append([c if isinstance(c, Transaction) else tuple(c) for c in commands])
        return original(commands)

    store.send = send
    try:
        yield batches
    finally:
        del store.send  # the class's method again


def usage_fields(model: str, lease: Any, account: str = TAG) -> dict[str, str]:
    """A usage record as the gateway writes one for a completed, non-streamed request."""
    return UsageRecord(
        request_id=f"{TAG}-7f3c2a9e41d04b6f", ts=dt.datetime.now(dt.UTC).isoformat(),
        account=account, key_id="3f2a9c1b7d4e", user="user-4711", source="bench",
        requested_model=model, served_model=model, fallback_index=0,
        requested_tier="default", tier="default", prompt_tokens=812, completion_tokens=256,
        estimated=False, status=200, outcome="complete", duration_ms=1834.25,
        queue_ms=round(lease.queued_ms, 3), ttft_ms=212.5,
        cost_usd=cost_usd(812, 256, 0.5, 1.5, 1.0),
    ).to_fields()  # fmt: skip


async def one_life(admission: Admission, plan: Any, account: str = TAG) -> str:
    """admit, then release with a usage record, as the completion route does; the lease id."""
    model = plan[0].model.name
    admitted = await admission.admit(plan, account, 1000)
    await admission.release(admitted.lease, usage_fields(model, admitted.lease, account))
    return admitted.lease.id


def per_second(batches: list[list[Command]]) -> bool:
    """Whether a captured life carries what a replica sends once a second, whatever its
    traffic: the expiry of the second's set of record identities (routing/ledger/records.py
    `FirstSends`). A busy replica sends it once in many lives, so a life that carries it
    (the first of its second) is captured again: the next is in the same second."""
    for batch in batches:
        for command in batch:
            inner = command if isinstance(command, Transaction) else [command]
            if any(c[0] == "PEXPIREAT" for c in inner):
                return True
    return False


def renamed(batches: list[list[Command]], lease_id: str, fresh: str) -> list[Command]:
    """The captured commands, flat, with `fresh` for the lease id wherever it appears (the
    scripts' arguments, the account entry, the record's attempt and its dedupe key)."""
    return [_renamed(command, lease_id, fresh) for batch in batches for command in batch]


def _renamed(command: Command, lease_id: str, fresh: str) -> Command:
    if isinstance(command, Transaction):
        return Transaction(_renamed(c, lease_id, fresh) for c in command)
    return tuple(a.replace(lease_id, fresh) if isinstance(a, str) else a for a in command)


async def replay_lives(
    store: Store, lives: Sequence[Captured], acquire: str, n: int, batch: int, tag: str
) -> None:
    """`n` lives back to back, `batch` per round trip, the i-th a replay of `lives[i % k]`.
    Each must be granted its slot and give everything back, or the benchmark measures
    something else (`acquire`: what a call of the acquire script names, its function or its
    sha: routing/store/scripts.py `called_as`)."""
    granted = 0
    for start in range(0, n, batch):
        commands: list[Command] = []
        for i in range(start, min(n, start + batch)):
            batches, lease_id = lives[i % len(lives)]
            commands += renamed(batches, lease_id, f"{lease_id}-{tag}{i}")
        replies = await store.send(commands)
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            scripted = command[0] in ("EVALSHA", "FCALL")
            if scripted and command[1] == acquire and isinstance(reply, bytes):
                granted += 1
    if granted != n:
        raise RuntimeError(f"replay: {granted} of {n} admissions granted")

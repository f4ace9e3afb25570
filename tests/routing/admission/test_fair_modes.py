"""Fair share by tokens (`tiers.<tier>.fairness: tokens`) through every script that moves a
waiter or a lease: an account's place in its tier's index is always what it holds by the
tier's own measure (docs/config.md `fairness`, docs/api.md fair share inside a tier)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from routing.admission.slots import GRANTED, QUEUED, ModelSlots, make_lease_id
from routing.store.wire import text
from tests.routing.admission.test_slots import TIMING, A, Model
from tiers.policy import Tier

# Every test here runs on both bindings of the scripts (tests/routing/conftest.py).
pytestmark = pytest.mark.usefixtures("script_modes")

UTILIZATION = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 1.0}


def by_tokens(size: int = 4) -> ModelSlots:
    made = ModelSlots("m", UTILIZATION, 100, TIMING, {t: "tokens" for t in Tier})
    made.set_endpoints([(A, size, 0.0, None)])
    return made


def lid(name: str, tokens: int, account: str) -> str:
    return make_lease_id(f"r-{name}", 1, account, tokens)


async def test_a_cancelled_account_head_keeps_its_claim_in_tokens(
    real_redis: aioredis.Redis,
) -> None:
    """`big` reserves 2000 tokens, `small` 200: a waiter of `big` leaving (its caller gone,
    or its queue timeout) must not turn big's claim into its count of leases (2)."""
    m = Model(real_redis, by_tokens())
    big = [lid(f"B{i}", 1000, "big") for i in range(2)]
    small = [lid(f"S{i}", 100, "small") for i in range(2)]
    for lease in big + small:
        assert (await m.acquire(lease)).status == GRANTED
    wb = [lid(f"wb{i}", 10, "big") for i in range(2)]
    ws = lid("ws", 10, "small")
    for waiter in [*wb, ws]:
        assert (await m.acquire(waiter, may_wait=True)).status == QUEUED
    assert isinstance(await m.run(m.slots.cancel(wb[0])), int)  # still queued: it leaves
    await m.release(small[0])  # small holds 100 tokens now, big 2000
    assert ws in await m.leases()
    assert wb[1] not in await m.leases()


async def queued_both(m: Model) -> tuple[str, str]:
    """A waiter of `big` and one of `small` (big queued first)."""
    wb, ws = lid("wb", 10, "big"), lid("ws", 10, "small")
    for waiter in (wb, ws):
        assert (await m.acquire(waiter, may_wait=True)).status == QUEUED
    return wb, ws


async def test_a_lease_written_back_counts_its_tokens(real_redis: aioredis.Redis) -> None:
    """A sweep keeping a grant and a lease Redis lost writes the lost one back: `big` holds
    2000 tokens again, not 2 leases' worth."""
    m = Model(real_redis, by_tokens(5))
    small = [lid(f"S{i}", 100, "small") for i in range(2)]
    fillers = [lid(f"F{i}", 1, "filler") for i in range(2)]
    for lease in [lid("B0", 1000, "big"), *small, *fillers]:
        assert (await m.acquire(lease)).status == GRANTED
    wb, ws = await queued_both(m)
    ws2 = lid("ws2", 10, "small")
    assert (await m.acquire(ws2, may_wait=True)).status == QUEUED
    await m.release(fillers[0])  # b holds 1000, s 200: s's turn
    assert ws in await m.leases()
    found = await m.sweep(leases=[(ws, A), (lid("B1", 1000, "big"), A)])  # B1's was lost
    assert found.restored == [lid("B1", 1000, "big")]
    await real_redis.delete(m.slots.keys[7])  # the rebuild window the write-back opened ends
    await m.release(small[0])  # 5 leases on 5 slots (B1 came back): no grant
    await m.release(fillers[1])  # small holds 110 tokens (ws's 10 and S1's 100), big 2000
    assert ws2 in await m.leases()
    assert wb not in await m.leases()


async def test_a_move_reclaiming_leases_keeps_tokens_claims(real_redis: aioredis.Redis) -> None:
    """A move reclaims expired leases first: `big` left holding 2000 tokens must not be
    scored by its 2 leases."""
    m = Model(real_redis, by_tokens(5))
    big = [lid(f"B{i}", 1000, "big") for i in range(3)]
    small = [lid(f"S{i}", 100, "small") for i in range(2)]
    for lease in big + small:
        assert (await m.acquire(lease)).status == GRANTED
    wb, ws = await queued_both(m)
    await m.expire_lease(big[2])
    assert (
        text(await m.run(m.slots.move(small[0], A, tier=Tier.DEFAULT))) == ""
    )  # nowhere else to go
    await m.sweep()  # one slot free: small holds 200 tokens, big 2000
    assert ws in await m.leases()
    assert wb not in await m.leases()


async def test_a_reload_to_another_fairness_rescores_the_waiting_accounts(
    real_redis: aioredis.Redis,
) -> None:
    """`tokens` -> `accounts` mid-queue: big's entry was scored by its 1000 tokens, small's
    by its 30. Once the replicas swept (within a second of the reload), big holding one
    lease against small's three gets the next slot, not only after its own lease ends."""
    m = Model(real_redis, by_tokens())
    small = [lid(f"S{i}", 10, "small") for i in range(3)]
    for lease in [lid("B0", 1000, "big"), *small]:
        assert (await m.acquire(lease)).status == GRANTED
    ws = [lid(f"ws{i}", 10, "small") for i in range(2)]
    wb = lid("wb", 10, "big")
    for waiter in [*ws, wb]:
        assert (await m.acquire(waiter, may_wait=True)).status == QUEUED
    m.slots.configure(UTILIZATION, 100, {t: "accounts" for t in Tier})
    await m.sweep()
    await m.release(small[0])  # small holds 2 leases, big 1
    assert wb in await m.leases()

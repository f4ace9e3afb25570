"""Token budgets at the Redis level (docs/architecture.md, token budgets): each lease
reserves the tokens its id carries on its endpoint, an endpoint's budget holds the sum of
its leases' (its tier's share of it: flex 0.8), the least loaded by tokens or count is
chosen, a waiter too large for the room there is waits (first come first served), and
every way a lease ends gives its tokens back: release, hand-off, expiry, the write-back
after an empty restart, a reload that shrinks a budget."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from routing.admission.slots import BUSY, GRANTED, QUEUED, ModelSlots, make_lease_id
from routing.store.wire import text
from tests.routing.admission.test_slots import TIMING, A, B, Model
from tiers.policy import Tier

# Every test here runs on both bindings of the scripts (tests/routing/conftest.py).
pytestmark = pytest.mark.usefixtures("script_modes")

UTILIZATION = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 0.8}
C = "http://c:8000"


def budgeted(
    budgets: tuple[int | None, int | None] = (1000, 1000),
    size: int = 8,
    fairness: str = "accounts",
) -> ModelSlots:
    made = ModelSlots("m", UTILIZATION, 100, TIMING, {t: fairness for t in Tier})
    made.set_endpoints([(A, size, 0.0, budgets[0]), (B, size, 0.0, budgets[1])])
    return made


def lid(name: str, tokens: int, account: str = "acme") -> str:
    return make_lease_id(f"r-{name}", 1, account, tokens)


async def reserved(m: Model) -> dict[str, int]:
    """Tokens reserved per endpoint (`ep_tok`), zeros left out."""
    raw = await m.client.hgetall(m.slots.keys[10])
    return {text(k): int(v) for k, v in raw.items() if int(v)}


async def test_the_ids_reservation_is_held_on_its_endpoint_and_given_back(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, budgeted())
    big = await m.acquire(lid("big", 600))
    other = await m.acquire(lid("other", 600))
    assert {big.endpoint, other.endpoint} == {A, B}  # the one with more room each time
    assert await reserved(m) == {big.endpoint: 600, other.endpoint: 600}
    # Slots are left by count (8 each), not by tokens: 600 more fits nowhere.
    assert (await m.acquire(lid("third", 600))).status == BUSY
    small = await m.acquire(lid("small", 400))  # 400 does, and fills one budget exactly
    assert small.status == GRANTED
    assert (await reserved(m))[small.endpoint] == 1000
    for lease in (lid("big", 600), lid("other", 600), lid("small", 400)):
        await m.release(lease)
    assert await reserved(m) == {}
    assert await m.leases() == set()


async def test_a_tier_fills_at_most_its_share_of_a_budget(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, budgeted((1000, None)))
    m.slots.set_endpoints([(A, 8, 0.0, 1000)])
    assert (await m.acquire(lid("default", 100))).status == GRANTED
    assert (await m.acquire(lid("flex", 800), Tier.FLEX)).status == BUSY  # 900 > 800
    assert (await m.acquire(lid("flex-ok", 700), Tier.FLEX)).status == GRANTED
    assert (await m.acquire(lid("default2", 200))).status == GRANTED  # default: all of it
    assert await reserved(m) == {A: 1000}


async def test_alone_on_an_endpoint_a_request_fits_its_share_of_the_whole_budget(
    real_redis: aioredis.Redis,
) -> None:
    """A budget that adapts may shrink below a request its whole budget holds: with nothing
    else reserved there, it runs (as vLLM runs one sequence its cache holds), up to its
    tier's share of the whole budget (flex: 0.8 x 1000)."""
    m = Model(real_redis, budgeted((1000, None)))
    m.slots.set_endpoints([(A, 8, 0.0, 400, 1000)])  # adapted down from its whole 1000
    assert (await m.acquire(lid("big", 900))).status == GRANTED
    assert (await m.acquire(lid("small", 10))).status == BUSY  # not beside it
    await m.release(lid("big", 900))
    assert (await m.acquire(lid("flex-big", 801), Tier.FLEX)).status == BUSY  # > 0.8 x 1000
    assert (await m.acquire(lid("flex", 800), Tier.FLEX)).status == GRANTED
    assert await reserved(m) == {A: 800}


@pytest.mark.parametrize(("tier", "share"), [(Tier.FLEX, 0.8), (Tier.DEFAULT, 0.5)])
async def test_a_lone_request_never_takes_more_than_its_tiers_share(
    real_redis: aioredis.Redis, tier: Tier, share: float
) -> None:
    """docs/api.md: a tier fills at most its max_utilization of a budget, alone on an idle
    endpoint too (issue 41: one flex request of 2,000 tokens took a whole budget of 2,000;
    default at 0.5 took 1,900); the most it may reserve is what admission refuses above."""
    fair = dict.fromkeys(Tier, "accounts")
    made = ModelSlots("m", {**UTILIZATION, tier: share}, 100, TIMING, fair)
    made.set_endpoints([(A, 8, 0.0, 2000)])
    m = Model(real_redis, made)
    most = int(2000 * share)
    assert made.largest_budget(tier) == most
    assert made.largest_budget() == 2000
    for over in (2000, 1900, most + 1):
        assert (await m.acquire(lid(f"over-{over}", over), tier)).status == BUSY, over
    assert await reserved(m) == {}
    assert (await m.acquire(lid("share", most), tier)).status == GRANTED
    assert await reserved(m) == {A: most}


async def test_a_whole_budget_that_shrinks_holds_a_lone_request_to_it(
    real_redis: aioredis.Redis,
) -> None:
    """A worker restarted with a smaller cache (`auto`): its whole budget is the new one,
    not the largest it ever had; a request alone there gets no more than that."""
    m = Model(real_redis, budgeted((1000, None)))
    m.slots.set_endpoints([(A, 8, 0.0, 1000, 1000)])
    assert m.slots.largest_budget() == 1000
    m.slots.set_endpoints([(A, 8, 0.0, 400, 400)])
    assert m.slots.largest_budget() == 400
    assert (await m.acquire(lid("big", 900))).status == BUSY
    assert await reserved(m) == {}


async def test_an_endpoint_without_a_budget_takes_any_reservation(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, budgeted((100, None)))
    got = await m.acquire(lid("huge", 50_000))
    assert (got.status, got.endpoint) == (GRANTED, B)
    assert await reserved(m) == {B: 50_000}  # counted there too, to give back exactly
    await m.release(lid("huge", 50_000))
    assert await reserved(m) == {}


async def test_a_waiter_too_large_for_the_room_waits_and_those_behind_it_too(
    real_redis: aioredis.Redis,
) -> None:
    """First come first served, as vLLM's scheduler: a head that fits nowhere yet holds
    the queue until enough is given back; then it goes first."""
    m = Model(real_redis, budgeted((1000, 1000), size=2))
    held = [lid(f"h{i}", 400) for i in range(4)]
    for lease in held:
        assert (await m.acquire(lease)).status == GRANTED  # 2 x 400 on each
    big, small = lid("big", 900), lid("small", 100)
    assert (await m.acquire(big, may_wait=True)).status == QUEUED
    assert (await m.acquire(small, may_wait=True)).status == QUEUED
    assert await m.release(held[0]) == 0  # 600 free on one endpoint: big does not fit
    assert await m.queue() == [big, small]
    await m.release(held[1])  # one endpoint empty now (whichever held both)
    leases = await m.leases()
    if big not in leases:  # the two given back sat on different endpoints
        await m.release(held[2])
    assert big in await m.leases()
    assert (await reserved(m))[text(await m.member(big)).split(" ")[1]] == 900


async def test_a_release_hands_its_slot_on_only_where_the_waiters_tokens_fit(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, budgeted((1000, 1000), size=1))
    first, second = lid("a", 500), lid("b", 500)
    for lease in (first, second):
        assert (await m.acquire(lease)).status == GRANTED
    waiter = lid("w", 800)
    assert (await m.acquire(waiter, may_wait=True)).status == QUEUED
    assert await m.release(first) == 1  # handed on: 800 in place of 500 fits 1000
    member = await m.member(waiter)
    assert member is not None
    endpoint = member.split(" ")[1]
    assert (await reserved(m))[endpoint] == 800
    await m.release(second, waiter)
    assert await reserved(m) == {}
    assert await m.load() == {A: 0, B: 0}


async def test_a_dead_replicas_reservations_come_back_with_its_leases(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, budgeted())
    lease = lid("dead", 700)
    got = await m.acquire(lease)
    await m.expire_lease(lease)
    await m.sweep()
    assert await reserved(m) == {}
    assert (await m.load())[got.endpoint] == 0


async def test_an_empty_restart_counts_the_reservations_again_from_the_holders(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, budgeted())
    lease = lid("kept", 700)
    got = await m.acquire(lease)
    await real_redis.flushdb()
    await m.sweep(leases=[(lease, got.endpoint)])  # this replica writes back what it holds
    assert await reserved(m) == {got.endpoint: 700}
    await m.release(lease)
    assert await reserved(m) == {}


async def test_a_budget_shrunk_under_its_leases_admits_nothing_until_they_fit(
    real_redis: aioredis.Redis,
) -> None:
    """A reload (or adaptation) that lowers a budget: the leases there run on, none is
    added until the reservations are back under it, and nothing is left behind."""
    m = Model(real_redis, budgeted((1000, None)))
    m.slots.set_endpoints([(A, 8, 0.0, 1000)])
    held = [lid(f"h{i}", 300) for i in range(3)]
    for lease in held:
        assert (await m.acquire(lease)).status == GRANTED
    m.slots.set_endpoints([(A, 8, 0.0, 500)])
    assert (await m.acquire(lid("new", 100))).status == BUSY  # 900 held on 500
    await m.release(held[0], held[1])
    assert (await m.acquire(lid("new2", 100))).status == GRANTED  # 400 held: 100 fits
    await m.release(held[2], lid("new2", 100))
    assert await reserved(m) == {}


async def test_a_release_under_a_shrunk_budget_hands_its_slot_on_only_when_it_fits(
    real_redis: aioredis.Redis,
) -> None:
    """A budget that shrank under its leases (a worker restarted smaller): a release hands
    its slot to a smaller waiter only if the budget then holds what is reserved there, not
    because the waiter reserves less than the lease it replaces."""
    m = Model(real_redis, budgeted((1000, None)))
    m.slots.set_endpoints([(A, 2, 0.0, 1000)])
    held = [lid("h0", 500), lid("h1", 500)]
    for lease in held:
        assert (await m.acquire(lease)).status == GRANTED
    waiter = lid("w", 300)
    assert (await m.acquire(waiter, may_wait=True)).status == QUEUED
    m.slots.set_endpoints([(A, 2, 0.0, 400)])
    await m.write_index()
    # As the gateway releases a lease: naming its endpoint (prelude `hand_on`).
    assert int(await m.run(m.slots.release([held[0]], endpoint=A))) == 0  # 500 + 300 > 400
    assert await m.queue() == [waiter]
    assert await reserved(m) == {A: 500}
    assert await m.release(held[1]) == 1  # alone, 300 fits 400
    assert await reserved(m) == {A: 300}
    await m.release(waiter)
    assert await reserved(m) == {}


async def test_a_release_on_an_endpoint_without_a_budget_hands_its_slot_on(
    real_redis: aioredis.Redis,
) -> None:
    """A model where one endpoint has a budget and another none (or `auto` not read yet):
    requests carry reservations, and a release on the one without hands its slot to a
    waiter of another size (prelude `hand_on`), where it failed (comparing with the
    whole budget it has not: the release's script error left the slot counted)."""
    m = Model(real_redis, budgeted((None, 1000), size=1))
    first, second = lid("h0", 100), lid("h1", 100)
    on = {(await m.acquire(lease)).endpoint: lease for lease in (first, second)}
    assert set(on) == {A, B}
    waiter = lid("w", 50)
    assert (await m.acquire(waiter, may_wait=True)).status == QUEUED
    assert int(await m.run(m.slots.release([on[A]], endpoint=A))) == 1
    assert await m.queue() == []
    assert await reserved(m) == {A: 50, B: 100}
    assert await m.release(waiter, on[B]) == 0
    assert await reserved(m) == {}
    assert await m.leases() == set()


async def test_fair_share_by_tokens_serves_the_account_holding_fewer_tokens(
    real_redis: aioredis.Redis,
) -> None:
    """fairness: tokens weighs what each account's leases reserve; fairness: accounts
    their number. One account holds one large lease, the other two small ones."""
    for fairness, first in (("tokens", "small"), ("accounts", "large")):
        await real_redis.flushdb()
        m = Model(real_redis, budgeted((None, None), size=2, fairness=fairness))
        m.slots.set_endpoints([(A, 3, 0.0, None)])
        await m.acquire(lid("L1", 800, "large"))
        await m.acquire(lid("S1", 100, "small"))
        await m.acquire(lid("S2", 100, "small"))
        wl, ws = lid("wl", 10, "large"), lid("ws", 10, "small")
        assert (await m.acquire(wl, may_wait=True)).status == QUEUED
        assert (await m.acquire(ws, may_wait=True)).status == QUEUED
        await m.release(lid("S1", 100, "small"))
        granted = wl if first == "large" else ws
        assert granted in await m.leases(), fairness


async def test_a_move_holds_the_lease_to_its_tiers_share_of_a_budget(
    real_redis: aioredis.Redis,
) -> None:
    """A flex lease moved off an unreachable endpoint reserves on the next one at most
    flex's share of its budget (0.8 here), as an acquire would: not the whole budget."""
    m = Model(real_redis, budgeted())
    flex = lid("flex", 700)
    assert (await m.acquire(flex, Tier.FLEX, affinity=[A])).endpoint == A
    assert (await m.acquire(lid("there", 200), affinity=[B])).endpoint == B
    moved = await m.run(m.slots.move(flex, A, [B], tier=Tier.FLEX))  # 900 > 0.8 x 1000
    assert text(moved) == ""
    assert await reserved(m) == {A: 700, B: 200}  # it stays where it was
    assert text(await m.run(m.slots.move(flex, A, [B], tier=Tier.DEFAULT))) == B


@pytest.mark.parametrize("only", [None, [B, C]], ids=["any", "known"])
async def test_a_move_passes_an_endpoint_that_lacks_only_the_tokens(
    real_redis: aioredis.Redis, only: list[str] | None
) -> None:
    """The least loaded endpoint lacks the tokens for the moved lease but keeps room for
    smaller requests (it stays in `free`): the move tries the next one, not it again."""
    made = ModelSlots("m", UTILIZATION, 100, TIMING)
    made.set_endpoints([(A, 8, 0.0, 1000), (B, 8, 0.0, 1000), (C, 8, 0.0, 1000)])
    m = Model(real_redis, made)
    moving = lid("moving", 600)
    assert (await m.acquire(moving, affinity=[A])).endpoint == A
    assert (await m.acquire(lid("b", 500), affinity=[B])).endpoint == B  # B: 0.5 used
    for i in range(5):  # C: 5 of 8 slots, no tokens, 0.625 used
        assert (await m.acquire(lid(f"c{i}", 0), affinity=[C])).endpoint == C
    assert text(await m.run(m.slots.move(moving, A, only, tier=Tier.DEFAULT))) == C
    assert await reserved(m) == {B: 500, C: 600}
    assert await m.load() == {A: 0, B: 1, C: 6}

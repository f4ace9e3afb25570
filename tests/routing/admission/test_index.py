"""The endpoint index in Redis (routing/store/lua/index.lua, docs/architecture.md): endpoints
added, removed and resized while leases are held, expiry, an empty Redis (the index written
again), two replicas with different views, and calls whose size does not grow with the
endpoints."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from routing.admission.replies import attempt
from routing.admission.slots import BUSY, NO_INDEX, QUEUED, RANK
from routing.store.wire import text
from tests.routing.admission.test_slots import A, B, Model, slots
from tiers.policy import Tier

# Every test here runs on both bindings of the scripts (tests/routing/conftest.py).
pytestmark = pytest.mark.usefixtures("script_modes")

C = "http://c:8000"


# The long entry each endpoint key holds beside the endpoints (prelude `WIDE`).
WIDE = "~" + "-" * 64


async def with_room(m: Model) -> set[str]:
    """The endpoints the index holds as having room (`free`)."""
    return {text(u) for u in await m.client.zrange(m.slots.keys[9], 0, -1)} - {WIDE}


async def in_rotation(m: Model) -> dict[str, str]:
    raw = await m.client.hgetall(m.slots.keys[8])
    return {text(k): text(v) for k, v in raw.items() if text(k) != WIDE}


async def test_a_resize_mid_load_holds_each_endpoint_to_its_new_size(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 2), (B, 2)]))
    held = {f"l{i}": (await m.acquire(f"l{i}")).endpoint for i in range(4)}
    on_a = [i for i, ep in held.items() if ep == A]
    assert len(on_a) == 2 and await with_room(m) == set()
    m.slots.set_endpoints([(A, 1, 0.0), (B, 2, 0.0)])  # A shrinks under its two leases
    await m.release(on_a[0])
    assert await with_room(m) == set()  # 1 lease on a size of 1: full
    assert (await m.acquire("n1")).status == BUSY
    await m.release(on_a[1])
    assert await with_room(m) == {A}
    assert (await m.acquire("n2")).endpoint == A
    assert (await in_rotation(m))[A].split()[0] == "1"


async def test_an_endpoint_added_mid_load_takes_the_next_requests(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 1)]))
    assert (await m.acquire("l1")).endpoint == A
    assert (await m.acquire("l2")).status == BUSY
    m.slots.set_endpoints([(A, 1, 0.0), (C, 2, 0.0)])
    assert [(await m.acquire(f"n{i}")).endpoint for i in range(2)] == [C, C]
    assert (await m.acquire("n3")).status == BUSY
    assert await m.load() == {A: 1, C: 2}


async def test_an_endpoint_removed_mid_load_takes_no_more_but_its_leases_release(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 3), (B, 3)]))
    held = {f"l{i}": (await m.acquire(f"l{i}")).endpoint for i in range(2)}
    assert set(held.values()) == {A, B}
    m.slots.set_endpoints([(A, 3, 0.0)])  # B out of rotation (health)
    assert (await m.acquire("n1")).endpoint == A
    # B's lease still counts against the 3 left: its request may be moved onto A.
    assert (await m.acquire("n2")).status == BUSY
    await m.release(next(i for i, ep in held.items() if ep == B))
    assert await m.load() == {A: 2, B: 0}
    assert B not in await in_rotation(m) and B not in await with_room(m)
    assert (await m.acquire("n3")).endpoint == A
    assert (await m.acquire("n4")).status == BUSY


async def test_a_lease_that_expires_gives_its_endpoint_room_again(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 1)]))
    await m.acquire("l1")
    assert await with_room(m) == set()
    await m.expire_lease("l1")
    await m.sweep()  # the dead holder's lease reclaimed
    assert await with_room(m) == {A}
    assert (await m.acquire("l2")).endpoint == A


async def test_an_empty_redis_gets_the_index_written_again(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots([(A, 1), (B, 1)]))
    endpoint = (await m.acquire("l1")).endpoint
    await m.sweep()
    for key in m.slots.keys:
        await real_redis.delete(key)
    # This replica still thinks Redis holds its index: the acquire takes nothing and says so.
    call = m.slots.acquire("l2", Tier.DEFAULT, may_wait=False)
    reply = attempt(await m.scripts.call(m.store, call))
    assert reply.status == NO_INDEX
    assert await real_redis.zcard(m.slots.keys[0]) == 0
    # The sweep writes back the lease it holds, finds no version and has the index rewritten.
    found = await m.sweep([("l1", endpoint)])
    assert found.restored == ["l1"]
    await m.write_index()
    assert set(await in_rotation(m)) == {A, B}
    assert await with_room(m) == {A, B} - {endpoint}
    assert (await m.acquire("l2")).endpoint != endpoint


async def test_a_change_is_never_written_over_an_index_it_was_not_made_for(
    real_redis: aioredis.Redis,
) -> None:
    """Redis restarted empty, then a penalty changed: the change alone must not become the
    index (it would carry the whole's version and nothing would write the rest again)."""
    m = Model(real_redis, slots([(A, 1), (B, 1), (C, 1)]))
    await m.write_index()
    for key in m.slots.keys:
        await real_redis.delete(key)
    m.slots.set_endpoints([(A, 1, 0.5), (B, 1, 0.0), (C, 1, 0.0)])
    change = m.slots.index()
    assert change is not None and change[2][1] != ""  # a change, not the whole
    reply = await m.scripts.call(m.store, change)
    assert reply == 0 and await in_rotation(m) == {}
    m.slots.indexed(reply)
    await m.write_index()
    assert set(await in_rotation(m)) == {A, B, C}
    assert (await in_rotation(m))[A] == "1 0.5"


async def test_the_last_view_written_is_mended_by_the_next_sweep(
    real_redis: aioredis.Redis,
) -> None:
    """Two replicas with different views (one saw B go down): the index holds the last
    writer's, and a sweep of the other finds another version and writes its own whole."""
    one = Model(real_redis, slots([(A, 1), (B, 1)]))
    other = Model(real_redis, slots([(A, 1)]))
    await one.write_index()
    await other.write_index()
    assert set(await in_rotation(one)) == {A}
    await one.sweep()  # another version than its own
    await one.write_index()
    assert set(await in_rotation(one)) == {A, B}
    assert text(await real_redis.hget(one.slots.keys[3], "~v")) == one.slots.version


@pytest.mark.parametrize("n", [1, 1000])
def test_an_acquire_and_a_release_do_not_grow_with_the_endpoints(n: int) -> None:
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n)]
    made = slots([(u, 2) for u in urls])
    acquire = made.acquire("l1", Tier.DEFAULT, may_wait=True, affinity=urls[:4])
    release = made.release(["l1"], endpoint=urls[0])
    # id, ttl, rank, ceiling, share of a token budget, preemptible, k, preferred, packed
    assert len(acquire[2]) == 8 + min(n, 4)
    assert len(release[2]) == 4  # spec, count, id, endpoint


async def test_an_older_replica_filling_an_endpoint_unseen_by_free_is_not_overfilled(
    real_redis: aioredis.Redis,
) -> None:
    """A rolling update: a replica of the release before counts its leases in `ep_load`
    but never touches `free`. A grant checks the endpoint's own count, so A is not given
    past its size; A leaves `free`, and once the older replica's lease ends (its release
    leaves `free` as it is) a sweep puts A back."""
    m = Model(real_redis, slots([(A, 1), (B, 1)]))
    await m.write_index()
    await real_redis.hincrby(m.slots.keys[3], A, 1)  # the older replica's lease on A
    first = await m.acquire("l1", affinity=[A])
    assert first.endpoint == B
    assert (await m.acquire("l2", affinity=[A])).status == BUSY
    assert await m.load() == {A: 1, B: 1}
    await real_redis.hincrby(m.slots.keys[3], A, -1)  # its release: `free` not told
    assert A not in await with_room(m)
    await m.sweep()
    assert A in await with_room(m)
    assert (await m.acquire("l3")).endpoint == A


async def test_a_move_past_an_endpoint_free_had_wrong_takes_the_next(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 1), (B, 1), (C, 1)]))
    assert (await m.acquire("l1", affinity=[C])).endpoint == C
    await real_redis.hincrby(m.slots.keys[3], A, 1)  # an older replica's lease on A
    moved = text(await m.run(m.slots.move("l1", C, [A, B], tier=Tier.DEFAULT)))
    assert moved == B
    assert await m.load() == {A: 1, B: 1, C: 0}
    assert A not in await with_room(m)


async def test_a_slot_the_sweep_finds_again_goes_to_a_waiter_in_the_same_sweep(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 1)]))
    await real_redis.hincrby(m.slots.keys[3], A, 1)  # an older replica fills A unseen
    await m.write_index()
    waiter = await m.acquire("w1", may_wait=True)
    assert waiter.status == QUEUED
    await real_redis.hincrby(m.slots.keys[3], A, -1)  # and frees it, `free` untold
    await m.sweep(waiters=[("w1", waiter.place + Tier.DEFAULT.rank * RANK)])
    assert await m.queue() == []  # granted by this sweep's pump (its wake-up published)
    assert await m.leases() == {"w1"} and await m.load() == {A: 1}


async def test_the_endpoint_keys_never_are_flat_lists(real_redis: aioredis.Redis) -> None:
    """Redis keeps a small sorted set or hash as one flat list searched end to end (a
    listpack): `free`, `ep_load` and `eps` hold a long entry beside the endpoints, so they
    are a skip list and hash tables from the first index write, stay so when the model is
    full (`free` keeps its entry: it never goes), and the entry is no endpoint."""
    m = Model(real_redis, slots([(A, 1), (B, 1)]))
    await m.write_index()
    keys = m.slots.keys
    encodings = [text(await real_redis.object("ENCODING", keys[i])) for i in (9, 3, 8)]
    assert encodings == ["skiplist", "hashtable", "hashtable"]
    assert (await m.acquire("l1")).endpoint != (await m.acquire("l2")).endpoint
    assert await with_room(m) == set() and await real_redis.zcard(keys[9]) == 1
    assert (await m.acquire("l3")).status == BUSY
    await real_redis.zrem(keys[9], WIDE)  # an older replica took it for an endpoint
    await m.release("l1")
    await m.sweep()  # puts it back
    assert text(await real_redis.object("ENCODING", keys[9])) == "skiplist"
    assert await with_room(m) == {A} and set(await in_rotation(m)) == {A, B}


# An acquire's seat as the release before the long entry wrote it (routing/store/lua/
# prelude at 270779b: parse_ep, fits, rescore, take_slot, take_any and seat, verbatim
# but for the comments): it knows nothing of WIDE. KEYS[1] the model's leases; ARGV: the
# lease id, its expiry. Returns the endpoint, or false.
OLDER_SEAT = """
local LEASES = KEYS[1]
local BASE = string.sub(LEASES, 1, -7)
local EPS, FREE = BASE .. 'eps', BASE .. 'free'
local EP_LOAD, EP_TOK = BASE .. 'ep_load', BASE .. 'ep_tok'
local full, clock, touched = false, nil, nil
local function parse_ep(spec)
  local size, penalty, budget, whole = string.match(spec, '^(%S+) (%S+) ?(%S*) ?(%S*)')
  budget = tonumber(budget)
  return tonumber(size), tonumber(penalty), budget, tonumber(whole) or budget
end
local function fits(t, tok, budget, whole, frac)
  return not budget or t == 0 or tok <= budget * frac or (tok == t and t <= whole)
end
local function rescore(ep, load, spec, tok)
  spec = spec or redis.call('HGET', EPS, ep)
  if not spec then return nil end
  local size, penalty, budget = parse_ep(spec)
  local used = load / size
  if budget then
    tok = tok or tonumber(redis.call('HGET', EP_TOK, ep)) or 0
    if tok / budget > used then used = tok / budget end
  end
  if used < 1 then
    if not touched then
      clock = clock or redis.call('TIME')
      local t = clock
      touched = ((t[1] % 100) * 1e6 + t[2]) * 1e-14
    end
    redis.call('ZADD', FREE, used + penalty + touched, ep)
    full = false
    return true
  end
  redis.call('ZREM', FREE, ep)
  return false
end
local function take_slot(ep, t, frac)
  local spec = redis.call('HGET', EPS, ep)
  if not spec then
    redis.call('ZREM', FREE, ep)
    return false, false
  end
  local size, _, budget, whole = parse_ep(spec)
  local load = redis.call('HINCRBY', EP_LOAD, ep, '1')
  local tok = t > 0 and redis.call('HINCRBY', EP_TOK, ep, t) or nil
  if load <= size and fits(t, tok, budget, whole, frac) then
    rescore(ep, load, spec, tok)
    return true, true
  end
  load = redis.call('HINCRBY', EP_LOAD, ep, '-1')
  if t > 0 then tok = redis.call('HINCRBY', EP_TOK, ep, -t) end
  return false, rescore(ep, load, spec, tok)
end
local function take_any(t, frac, try)
  local few = t > 0 and '3' or '0'
  for _ = 1, 8 do
    if full then return nil end
    local heads = redis.call('ZRANGE', FREE, '0', few)
    if not heads[1] then
      full = true
      return nil
    end
    local dropped = false
    for _, ep in ipairs(heads) do
      local ok, kept
      if try then ok, kept = try(ep) else ok, kept = take_slot(ep, t, frac) end
      if ok then return ep end
      dropped = dropped or not kept
    end
    if not dropped then return nil end
  end
  return nil
end
local id, expiry = ARGV[1], ARGV[2]
local function try(ep)
  local m = id .. ' ' .. ep
  redis.call('ZADD', LEASES, expiry, m)
  local ok, kept = take_slot(ep, 0, 1)
  if not ok then redis.call('ZREM', LEASES, m) end
  return ok, kept
end
return take_any(0, 1, try) or false
"""


async def test_an_older_replica_finding_the_model_full_is_refused_cleanly(
    real_redis: aioredis.Redis,
) -> None:
    """A rolling update: a replica of the release before the long entry takes `free`'s head
    for an endpoint. On a full model that is WIDE, which `eps` names too: its take_slot must
    find it full (and drop it from `free`, which the next sweep mends), not fail midway
    with a lease on WIDE written (counted in the model's leases, and whose reclaim then
    failed every script that ran it)."""
    m = Model(real_redis, slots([(A, 1)]))
    assert (await m.acquire("l1")).endpoint == A
    keys = m.slots.keys
    expiry = await m.now_ms() + 100
    assert await real_redis.eval(OLDER_SEAT, 1, keys[0], "old-1", expiry) is None
    assert await m.leases() == {"l1"}
    assert (await real_redis.hgetall(keys[3]))[WIDE.encode()] == b"0"
    await m.sweep()  # puts WIDE back in `free`
    assert await real_redis.zrange(keys[9], 0, -1) == [WIDE.encode()]
    await m.release("l1")
    assert await with_room(m) == {A}
    assert (await m.acquire("l2")).endpoint == A

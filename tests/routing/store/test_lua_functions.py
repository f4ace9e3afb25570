"""Single functions of the prelude, called one by one through a harness (the whole prelude
around a one-line body, run by EVAL on the run's Redis): the id a replica makes in Python
(routing/admission/slots.py `make_lease_id`) is read the same way by every script."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from routing.admission.slots import make_lease_id
from routing.store.keys import account_tag, model_keys
from routing.store.scripts import Prelude, prelude_text
from routing.store.wire import text

PRELUDE = Prelude(prelude_text())


async def call(client: aioredis.Redis, expression: str, *args: Any) -> list[str]:
    """`expression` (Lua, over ARGV) evaluated with the prelude bound to a model's keys;
    each of its values as text (a Lua number would come back truncated to an integer)."""
    body = f"local r = {{{expression}}}\nfor i = 1, #r do r[i] = tostring(r[i]) end\nreturn r\n"
    script = PRELUDE.around(body)
    replies = await client.eval(script, 1, model_keys("t-harness")[0], *args)
    return [text(r) for r in replies]


@pytest.mark.parametrize(("weight", "tokens"), [(1.0, 0), (2.5, 120), (0.25, 7)])
async def test_an_id_reads_back_as_python_made_it(
    real_redis: aioredis.Redis, weight: float, tokens: int
) -> None:
    lease_id = make_lease_id("r1-7", weight, "acme", tokens)
    account, read_weight = await call(real_redis, "account_of(ARGV[1])", lease_id)
    assert (account, float(read_weight)) == (account_tag("acme"), weight)
    assert await call(real_redis, "tokens_of(ARGV[1])", lease_id) == [str(tokens)]
    assert await call(real_redis, "replica_of(ARGV[1])", lease_id) == ["r1"]
    assert await call(real_redis, "number_of(ARGV[1], 'r1-')", lease_id) == ["7"]


async def test_a_replica_whose_id_starts_with_anothers_is_not_it(
    real_redis: aioredis.Redis,
) -> None:
    """ "r1-2-5~..." is replica r1-2's fifth id, not replica r1's."""
    lease_id = make_lease_id("r1-2-5", 1.0, "acme")
    assert await call(real_redis, "replica_of(ARGV[1])", lease_id) == ["r1-2"]
    assert await call(real_redis, "number_of(ARGV[1], 'r1-2-')", lease_id) == ["5"]
    assert await call(real_redis, "number_of(ARGV[1], 'r1-') or 'none'", lease_id) == ["none"]


async def test_a_lease_member_splits_into_its_id_and_endpoint(
    real_redis: aioredis.Redis,
) -> None:
    lease_id = make_lease_id("r1-3", 1.0, "acme", 10)
    found = await call(real_redis, "split(ARGV[1])", f"{lease_id} http://a:8000")
    assert found == [lease_id, "http://a:8000"]
    # An id alone (a grant not claimed yet): its endpoint from `ep_of`, false when none.
    assert await call(real_redis, "split(ARGV[1])", lease_id) == [lease_id, "false"]


async def test_an_endpoints_entry_parses_its_size_penalty_and_budget(
    real_redis: aioredis.Redis,
) -> None:
    assert (await call(real_redis, "parse_ep(ARGV[1])", "4 0.5"))[:2] == ["4", "0.5"]
    size, penalty, budget, *_ = await call(real_redis, "parse_ep(ARGV[1])", "8 0 2000 4000")
    assert (size, penalty, budget) == ("8", "0", "2000")

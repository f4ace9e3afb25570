"""Every key the gateway keeps in Redis, declared once: its name, its type and what it holds.

The Python callers build their keys from here; the Lua scripts get a model's key names from
here too (routing/store/scripts.py writes them into the prelude's `bind`), so a key a
script names is one this table declares, and on a Redis Cluster every declared key of the
model is passed (routing/admission/slots.py `declare_all`). tests/routing/store/test_keys.py
checks that every name a script makes is declared and every declared key is used, and that
docs/architecture.md's table is this one (`python -m routing.store.keys` prints it).

Per model, every key shares the hash tag `{<model>}` (one Cluster slot: each script call
touches one). Per account, the tag is the account's 64-bit digest (`account_tag`), which
ends its lease ids too: a script that drops a dead replica's lease finds its account's key
from the id, and no account's name shows in Redis.
"""

from __future__ import annotations

import functools
import hashlib
from typing import NamedTuple

# The admission layout's version, in the name of every key it keeps (a model's, an
# account's, the replicas'): a release that changes the layout (a key's name, type or what
# it holds, a lease id's format, a script's arguments) moves to the next version, so
# replicas of two layouts never read each other's state (docs/redis.md, "Rolling updates
# and the key layout"). The API keys and the usage records are kept across layouts: their
# names carry no version.
LAYOUT = "gw:v2:"


class Key(NamedTuple):
    name: str  # within its scope (a model's keys: after the model's tag)
    type: str
    holds: str


# A model's keys, after its tag `gw:v2:{<model>}:`, in the order the scripts take them on a
# Cluster (KEYS[1] is always the leases; on one Redis a script is given only those, and
# names the rest itself from this table).
MODEL: tuple[Key, ...] = (
    Key("leases", "ZSET", 'lease id, or "<id> <endpoint url>" -> expiry (ms, Redis\'s clock)'),
    Key("queue", "ZSET", "waiter id -> place (tier rank x 10^15 + sequence)"),
    Key("ep_of", "HASH", "granted waiter id -> its endpoint, until its replica claims it"),
    Key("ep_load", "HASH", "endpoint url -> leases on it; `~`-marks: state, waits per tier"),
    Key("seq", "STRING", "the queue's last sequence number"),
    Key("held", "HASH", "account tag -> leases it holds (`t:<tag>`: tokens), fair share"),
    Key("qexp", "ZSET", "waiter id -> liveness expiry, of waiters that name no replica"),
    Key("rebuild", "STRING", "present while replicas write back what Redis lost"),
    Key("eps", "HASH", 'endpoint url in rotation -> "max_concurrency penalty [budget]"'),
    Key("free", "ZSET", "endpoint url with room -> load / size + penalty"),
    Key("ep_tok", "HASH", "endpoint url -> tokens its leases reserve of its budget"),
    Key("pre", "ZSET", '"<lease id> <endpoint>" of a preemptible lease -> when granted'),
    Key("doomed", "ZSET", "preempted lease -> when its request must stop"),
    Key("alive", "ZSET", "replica id -> when its waiters' liveness ends"),
    Key("gone", "HASH", "dead replica id -> how far the look for its waiters reached"),
)
# In detail (the scripts' own words):
# leases   ZSET "lease_id url" -> expiry (ms, Redis TIME): each names its endpoint (an id
#          or a URL holds no space), so nothing else records where a lease runs
# queue    ZSET waiter_id -> rank * 1e15 + sequence (rank 0 priority, 1 default, 2 flex)
# ep_of    HASH lease_id -> endpoint url, of the slots granted to waiters by a release
#          before this one until their replica claimed them: read (`find_lease`), never
#          written now (a sweep that finds no lease at all drops what is left). A grant is
#          found from its member "id endpoint" like every lease; from its id alone (a
#          wake-up lost, a cancel that crossed it) only by trying every endpoint, a rare
#          case. (An older release still wrote a grant's member as the id
#          alone: `split` reads it.)
# eps      HASH endpoint url -> "max_concurrency penalty", or "max_concurrency penalty
#          budget" for one that holds its requests' reserved tokens to a budget (`parse_ep`),
#          of the endpoints in rotation: the endpoint index, written by a replica at start,
#          on reload and when health changes (index.lua), never passed per call
# free     ZSET endpoint url -> load / max_concurrency (or its tokens / budget, the larger)
#          + penalty, of the endpoints in rotation that have room: the least loaded is its
#          head (one ZRANGE, whatever the number of endpoints), kept by `rescore` at every
#          change of a load
# ep_tok   HASH endpoint url -> tokens its leases reserve (the sum of `tokens_of` their ids,
#          kept for every lease that carries a reservation, whatever its endpoint's budget)
# ep_load  HASH endpoint url -> leases held on it; and the field `~s`, present while Redis
#          holds this model's state (a replica that has seen it before and finds it gone
#          knows Redis restarted empty or failed over): '0', or '00' while a rebuild window
#          may be open (`rebuild`); and `~f`: 2 x the slots freed so far (releases and
#          expiries, for Retry-After), plus 1 while someone may wait in `queue` (set when
#          it turns empty or not, mended by every sweep): so a release counts its free and
#          learns whether to pump in one HINCRBY, and the acquire reads it with the loads;
#          `~v`: the version of the endpoint index (index.lua), absent until it is written;
#          and `~w0` `~w1` `~w2`: the waiters queued per tier (`waiting_counts`), which
#          every change of the queue keeps and every sweep sets from the queue itself;
#          `~m`: the tiers' ways of sharing the fair indexes were last scored by (sweep.lua)
# seq      STRING queue sequence
# qexp     ZSET waiter_id -> liveness expiry (ms), of the waiters of a release before this
#          one (its sweeps extend it, so they leave the queue within its TTL once their
#          replica died); this release's waiters live by their replica (`alive`, `live`)
# alive    ZSET replica -> when the liveness its last sweep of the model gave its waiters
#          ends (`bury`); gone: HASH replica -> how far the look for a dead one's waiters
#          has reached
# rebuild  STRING, present for a short while after Redis lost this model's state: no slot
#          is granted until every replica has written back its own
# wake     the channel granted waiters are woken on ("id endpoint"), and the holders of
#          preempted leases told ("!id endpoint")
# pre      ZSET "lease_id url" -> when granted (ms), of the leases of a tier that may be
#          preempted (flex) whose request has not sent its first byte yet (start.lua takes
#          it out then): what a newcomer of a tier that may preempt takes a slot from
# doomed   ZSET lease_id -> when preempted (ms): leases whose holder was told to give them
#          back (it does, after cutting its request at the worker short)
# A model's names made per call (never passed: one per tier, or per tier and account).
MODEL_MADE: tuple[Key, ...] = (
    Key("fq:<rank>:<tag>", "ZSET", "an account's waiters in a fair tier -> sequence"),
    Key("fi:<rank>", "ZSET", "a fair tier's waiting accounts, by what each holds / weight"),
)
# The model's pub/sub channel (a name, not a key): grants and preemptions, by waiter id.
MODEL_CHANNEL = Key("wake", "channel", '"@<ms> <waiter> <endpoint>" grants, "!<lease>" preemptions')

ACCOUNT = Key(
    LAYOUT + "acct:{<tag>}", "ZSET", "an account's requests running or waiting: id -> expiry"
)
RATES = Key(LAYOUT + "rl:{<tag>}", "HASH", "the account's and its keys' GCRA buckets (rpm, tpm)")
REPLICAS = Key(LAYOUT + "replicas", "ZSET", "replica id -> when its heartbeat lapses")
BEAT = Key(LAYOUT + "beat:<replica>", "STRING", "the mark a replica's last heartbeat left")
API_KEYS = Key("gw:keys", "HASH", "SHA-256 digest of an API key -> its record (`gateway keys`)")
USAGE = Key("usage", "STREAM", "usage records, one per admitted request (billing)")
DEDUPE = Key("{usage}:rids:<second>", "SET", "record identities of that second, against resends")

# Where each of those begins (the part before its first `<`).
ACCOUNT_PREFIX, RATES_PREFIX = LAYOUT + "acct:{", LAYOUT + "rl:{"
REPLICAS_KEY, BEAT_PREFIX, API_KEYS_HASH = REPLICAS.name, LAYOUT + "beat:", API_KEYS.name
USAGE_STREAM, DEDUPE_PREFIX = USAGE.name, "{usage}:rids:"


def model_tag(model: str) -> str:
    return LAYOUT + "{" + model + "}:"


def model_keys(model: str) -> list[str]:
    """The model's keys, in `MODEL`'s order."""
    tag = model_tag(model)
    return [tag + key.name for key in MODEL]


def model_key(model: str, name: str) -> str:
    """One of the model's keys by its name (a `MODEL` key, or the channel)."""
    if name not in _MODEL_NAMES:
        raise KeyError(f"{name!r} is not a declared key of a model")
    return model_tag(model) + name


_MODEL_NAMES = frozenset([*(key.name for key in MODEL), MODEL_CHANNEL.name])


@functools.lru_cache(maxsize=1 << 14)
def account_tag(account: str) -> str:
    """The account's name in Redis: a 64-bit digest (two accounts of a million share one
    with odds of 3 in 100 million), in its lease ids and as its keys' hash tag. Asked for
    up to three times per request (its lease id, its count, its rate buckets): a digest
    each time is kept, for the accounts in use (bounded)."""
    return hashlib.blake2b(account.encode(), digest_size=8).hexdigest()


def account_key(account: str) -> str:
    return ACCOUNT_PREFIX + account_tag(account) + "}"


def rate_key(account: str) -> str:
    """The account's buckets, under the same hash tag as its count (one Cluster node)."""
    return RATES_PREFIX + account_tag(account) + "}"


def lua_names() -> str:
    """The prelude's key names (routing/store/lua/prelude_*.lua `bind`, at `-- @keys`): each
    model key but the leases (KEYS[1], which the others follow), its name upper-cased."""
    rest = [key.name for key in MODEL[1:]]
    lines = [f"    {name.upper()} = BASE .. '{name}'\n" for name in rest]
    lines.append(f"    CHANNEL = BASE .. '{MODEL_CHANNEL.name}'\n")
    return "".join(lines)


def lua_declarations() -> str:
    """The prelude's locals for those names (at `-- @key-names`)."""
    names = ["LEASES", "BASE", *(key.name.upper() for key in MODEL[1:]), "CHANNEL"]
    return f"local {', '.join(names)}\nlocal ACCOUNT_PREFIX = '{ACCOUNT_PREFIX}'\n"


def lua_tiers(ranks: int) -> str:
    """The prelude's count of tiers and their waiters' fields in `ep_load` (at `-- @tiers`),
    for `ranks` tiers."""
    fields = ", ".join(f"'~w{rank}'" for rank in range(ranks))
    return f"local RANKS = {ranks}\nlocal WAIT_FIELDS = {{{fields}}}\n"


def markdown() -> str:
    """The table of every key, for docs/architecture.md."""
    rows = ["| key | type | holds |", "|---|---|---|"]
    for key in MODEL:
        rows.append(f"| `{model_tag('<model>')}{key.name}` | {key.type} | {key.holds} |")
    for key in MODEL_MADE:
        rows.append(f"| `{model_tag('<model>')}{key.name}` | {key.type} | {key.holds} |")
    channel = MODEL_CHANNEL
    rows.append(f"| `{model_tag('<model>')}{channel.name}` | {channel.type} | {channel.holds} |")
    for key in (ACCOUNT, RATES, REPLICAS, BEAT, API_KEYS, USAGE, DEDUPE):
        rows.append(f"| `{key.name}` | {key.type} | {key.holds} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

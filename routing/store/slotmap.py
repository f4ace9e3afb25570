"""Which master of a Redis Cluster a command goes to: the hash slot of its first key (for a
script, the first of its KEYS), any master for a keyless command, every master for SCRIPT;
and what a redirect reply (MOVED, ASK, TRYAGAIN) says."""

from __future__ import annotations

import functools
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from routing.store.wire import Command, Transaction

Node = tuple[str, int]  # (host, port)
ANY = -1  # a keyless command: any master answers it
EVERY = -2  # a SCRIPT command: every master must run it
_SCRIPTED = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO"})
_KEYLESS = frozenset({"TIME", "PING", "ECHO", "INFO", "ROLE", "CLUSTER", "ASKING"})


def _name(command: Command) -> str:
    name = command[0]
    return (name.decode() if isinstance(name, bytes) else str(name)).upper()


@functools.lru_cache(maxsize=65536)
def _key_slot(key: Any) -> int:
    # A gateway names few keys (its models', accounts', usage's): CRC16 once per name.
    return key_slot(key if isinstance(key, bytes) else str(key).encode())


def slot_of(command: Command) -> int:
    """The hash slot of the command's first key, or `ANY` / `EVERY` (a transaction's: its
    first command's; all its keys share one slot)."""
    if isinstance(command, Transaction):
        return slot_of(command[0])
    name = _name(command)
    if name in _SCRIPTED:
        numkeys = int(command[2])
        return _key_slot(command[3]) if numkeys > 0 else ANY
    if name in ("SCRIPT", "FUNCTION"):
        return EVERY
    if name in _KEYLESS or len(command) < 2:
        return ANY
    return _key_slot(command[1])


def redirect_of(reply: Any) -> tuple[str, int, Node | None] | None:
    """("MOVED" | "ASK", slot, node) of a redirect reply, ("TRYAGAIN", -1, None), or None."""
    if not isinstance(reply, ResponseError):
        return None
    parts = str(reply).split()
    if parts and parts[0] == "TRYAGAIN":
        return ("TRYAGAIN", -1, None)
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = parts[2].rpartition(":")
    return (parts[0], int(parts[1]), (host, int(port)))

"""A private 3-master Redis Cluster for the tests, on loopback, never shared.

Three `redis-server --cluster-enabled yes` processes (tests/redis_server.py), joined by
`redis-cli --cluster create` with no replicas. Each node also listens on its cluster bus
port, its own port + 10000: ports are picked so that both are free, so two test runs on one
machine never meet. `stop` stops every node and nothing is left on disk but the directory
the caller gave.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from tests.redis_server import STARTUP_DEADLINE_S, RedisServer, free_port

BUS_OFFSET = 10000
MASTERS = 3


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + BUS_OFFSET <= 65535 and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _redis_cli() -> str:
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("the cluster tests need redis-cli (Debian: apt-get install redis-tools)")
    return found


class RedisCluster:
    """Three masters on 127.0.0.1, the 16384 slots split evenly by `redis-cli`. `tls`: a
    certificate and its key (e.g. `self_signed`) to serve TLS only, the bus included."""

    def __init__(
        self,
        directory: Path,
        masters: int = MASTERS,
        extra: Sequence[str] = (),
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.dir = directory
        self.nodes: list[RedisServer] = []
        self.masters = masters
        self.extra = list(extra)
        self.tls = tls

    def _node(self, more: Sequence[str] = ()) -> RedisServer:
        port = cluster_port()
        conf = self.dir / f"nodes-{port}.conf"
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(conf),
                 "--cluster-node-timeout", "5000", *self.extra, *more]  # fmt: skip
        if self.tls is not None:
            extra += ["--tls-cluster", "yes", "--tls-ca-cert-file", str(self.tls[0])]
        return RedisServer(self.dir, port=port, extra=extra, tls=self.tls)

    def start(self) -> RedisCluster:
        try:
            for _ in range(self.masters):
                self.nodes.append(self._node().start())
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            tls = ["--tls", "--cacert", str(self.tls[0])] if self.tls else []
            subprocess.run(
                [_redis_cli(), *tls, "--cluster", "create", *addresses,
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        """Until every node says cluster_state:ok and knows every other node (polled: the
        nodes gossip on their own schedule, no event reaches this process)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if all(self._ok(node) for node in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not settle in {deadline_s}s")

    def _ok(self, node: RedisServer) -> bool:
        with self.client(node) as client:
            info = client.cluster("INFO")
            known = len(client.cluster("NODES"))
        return info.get("cluster_state") == "ok" and known == len(self.nodes)

    def client(self, node: RedisServer) -> redis.Redis:
        """A plain (not Cluster) client of one node."""
        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.tls[0])} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5.0, **tls)

    @property
    def url(self) -> str:
        """The address of one node: what a gateway is given."""
        return self.urls()[0]

    def urls(self) -> list[str]:
        query = f"?ssl_ca_certs={self.tls[0]}" if self.tls else ""
        return [n.url.removesuffix("/0") + query for n in self.nodes]

    def node_of(self, key: str) -> RedisServer:
        """The node serving `key`'s hash slot now."""
        return self.node_of_slot(self.slot(key))

    def node_id(self, node: RedisServer) -> str:
        with self.client(node) as client:
            return str(client.execute_command("CLUSTER MYID").decode())

    def slot(self, key: str) -> int:
        with self.client(self.nodes[0]) as client:
            return int(client.cluster("KEYSLOT", key))

    def begin_move(self, slot: int, target: RedisServer) -> RedisServer:
        """Mark `slot` migrating from its master to `target` (importing there); the keys stay
        where they are until `migrate_keys`. Returns the source."""
        source = self.node_of_slot(slot)
        with self.client(target) as dst, self.client(source) as src:
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self.node_id(source))
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(target))
        return source

    def migrate_keys(self, slot: int, source: RedisServer, target: RedisServer) -> int:
        """Move every key of `slot` still on `source` to `target`; how many moved."""
        moved = 0
        with self.client(source) as src:
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
        return moved

    def end_move(self, slot: int, target: RedisServer) -> None:
        """`slot` belongs to `target` now, on every node (the target first, as redis-cli does)."""
        target_id = self.node_id(target)
        for node in sorted(self.nodes, key=lambda n: n is not target):
            with self.client(node) as client:
                client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)

    def move_slot(self, slot: int, target: RedisServer) -> None:
        source = self.begin_move(slot, target)
        self.migrate_keys(slot, source, target)
        self.end_move(slot, target)

    def node_of_slot(self, slot: int) -> RedisServer:
        with self.client(self.nodes[0]) as client:
            for start, end, (_host, port, *_), *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def add_replica(self, master: RedisServer, extra: Sequence[str] = ()) -> RedisServer:
        """A new node, a replica of `master`, in sync with it (polled: replication and
        gossip run on the nodes' own schedule, no event reaches this process)."""
        replica = self._node(extra).start()
        self.nodes.append(replica)  # stopped with the cluster
        subprocess.run(
            [_redis_cli(), "--cluster", "add-node", f"127.0.0.1:{replica.port}",
             f"127.0.0.1:{master.port}", "--cluster-slave", "--cluster-master-id",
             self.node_id(master)],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        with self.client(replica) as client:
            while client.execute_command("ROLE")[3:4] != [b"connected"]:
                assert time.monotonic() < deadline, "the replica did not sync"
                time.sleep(0.05)
        return replica

    def flush(self) -> None:
        for node in self.nodes:
            with self.client(node) as client:
                client.flushall()
                client.script_flush()
                client.function_flush()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_cluster(
    directory: Path, extra: Sequence[str] = (), tls: tuple[Path, Path] | None = None
) -> RedisCluster:
    """A started cluster under `directory` (created), or RuntimeError with why not; `extra`:
    more arguments for every node."""
    directory.mkdir(parents=True, exist_ok=True)
    return RedisCluster(directory, extra=extra, tls=tls).start()

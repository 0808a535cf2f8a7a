"""A real Redis server on a loopback port for the tier tests: the binary `make redis`
installs (.redis/bin/redis-server), `$KVRS_REDIS_SERVER`, or one on PATH. It can be
killed and restarted on the same port to test a server that goes away."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]


def server_binary() -> str | None:
    """Where the redis-server binary is, or None."""
    for candidate in (os.environ.get("KVRS_REDIS_SERVER"), str(ROOT / ".redis/bin/redis-server")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process: no persistence, LRU eviction past 512 MiB, DEBUG enabled
    (the slow-server test blocks it with DEBUG SLEEP)."""

    def __init__(self, binary: str, port: int | None = None):
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvrs-redis-")
        self.proc: subprocess.Popen | None = None
        self.extra: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def args(self) -> list[str]:
        """The server's command line."""
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--maxmemory", "512mb",
                "--maxmemory-policy", "allkeys-lru", "--enable-debug-command", "yes",
                *self.extra]  # fmt: skip

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Kills the server at once (SIGKILL), as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def cli_binary(server: str) -> str | None:
    """The redis-cli next to `server` (as `make redis` installs both), or one on PATH."""
    candidate = Path(server).with_name("redis-cli")
    if os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("redis-cli")


class RedisCluster:
    """A real Redis Cluster on loopback ports: `masters` masters with one replica each
    (redis-server processes with `--cluster-enabled yes`, a 1 s node timeout, no
    persistence), created by `redis-cli --cluster create`. `nodes[i]` is a RedisServer;
    masters first. A master can be killed (SIGKILL) to test a failover."""

    def __init__(self, binary: str, cli: str, masters: int = 3):
        self.cli = cli
        self.nodes = [ClusterNode(binary) for _ in range(2 * masters)]
        self.masters = masters

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self) -> None:
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [self.cli, "--cluster", "create", *addrs, "--cluster-replicas", "1", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=60,
        )  # fmt: skip
        self.wait_ok(self.nodes)
        # Every replica synced, so that a killed master's replica can take over.
        deadline = time.monotonic() + 20
        while not all(self.synced(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster replicas did not sync")
            time.sleep(0.05)

    @staticmethod
    def synced(node: RedisServer) -> bool:
        info = node.client().info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def wait_ok(self, nodes: list[RedisServer], timeout: float = 20) -> None:
        """Waits until each of `nodes` says `cluster_state:ok` and sees every slot served by
        a live master."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self.ok(n) for n in nodes):
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def ok(self, node: RedisServer) -> bool:
        c = node.client()
        if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
            return False
        live = {n.port for n in self.nodes if n.running()}
        served = 0
        for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
            if int(master[1]) not in live:
                return False
            served += end - start + 1
        return served == 16384

    def master_of(self, key: str) -> RedisServer:
        """The node serving `key`'s slot now."""
        c = next(n for n in self.nodes if n.running()).client()
        slot = c.execute_command("CLUSTER", "KEYSLOT", key)
        for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise KeyError(key)

    def live_masters(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running() and n.client().info("replication")["role"] == "master"]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class ClusterNode(RedisServer):
    """A redis-server started as a cluster node."""

    def start(self) -> None:
        # The bus port on its own free port (by default it is port + 10000).
        self.extra = ["--cluster-enabled", "yes", "--cluster-config-file", f"{self.dir}/nodes.conf",
                      "--cluster-node-timeout", "1000", "--cluster-port", str(free_port())]  # fmt: skip
        super().start()


TLS = ROOT / "tests/redis/tls"


class TlsRedisServer(RedisServer):
    """A server on a TLS port only (`rediss://`), with one of the certificates of
    tests/redis/tls (`cert`: "server" for 127.0.0.1 and localhost, "wrong-name" for
    another name); `auth_clients`: clients must show a certificate the test CA signed."""

    def __init__(self, binary: str, cert: str = "server", auth_clients: bool = False):
        super().__init__(binary)
        self.cert, self.auth_clients = cert, auth_clients

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = super().args()
        args[args.index("--port") + 1] = "0"
        return args + ["--tls-port", str(self.port), "--tls-ca-cert-file", str(TLS / "ca.pem"),
                       "--tls-cert-file", str(TLS / f"{self.cert}.pem"),
                       "--tls-key-file", str(TLS / f"{self.cert}.key"),
                       "--tls-auth-clients", "yes" if self.auth_clients else "no"]  # fmt: skip

    def client(self) -> redis.Redis:
        """redis-py over TLS, with the client certificate (the name is not checked: the
        wrong-name server is the test's)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, ssl=True,
                           ssl_ca_certs=str(TLS / "ca.pem"), ssl_certfile=str(TLS / "client.pem"),
                           ssl_keyfile=str(TLS / "client.key"), ssl_check_hostname=False)  # fmt: skip

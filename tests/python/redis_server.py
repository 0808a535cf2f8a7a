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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def args(self) -> list[str]:
        """The server's command line."""
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--maxmemory", "512mb",
                "--maxmemory-policy", "allkeys-lru", "--enable-debug-command", "yes"]  # fmt: skip

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

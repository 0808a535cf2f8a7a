"""RedisTier against servers that misbehave: a reply trickled byte by byte (the timeout
bounds the whole request), a short MGET reply (nothing is deleted), a password in the URL
(never shown), and a fork (the child opens its own connection)."""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings

import pytest
from test_tiers import PROMPT, check_contents, evict_everything, pool, serve

import kvrs


class StandIn:
    """A fake Redis server on a loopback port: each command the client sends (parsed from
    RESP) is recorded and answered by `reply(args) -> bytes`, written one byte every
    `trickle` seconds when given."""

    def __init__(self, reply, trickle: float | None = None):
        self.reply = reply
        self.trickle = trickle
        self.commands: list[list[bytes]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        f = conn.makefile("rb")
        try:
            while not self.stopped.is_set():
                line = f.readline()
                if not line.startswith(b"*"):
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:n])
                self.commands.append(args)
                out = self.reply(args)
                if self.trickle is None:
                    conn.sendall(out)
                    continue
                for b in out:
                    if self.stopped.is_set():
                        return
                    conn.sendall(bytes([b]))
                    time.sleep(self.trickle)
        except OSError:
            pass
        finally:
            conn.close()

    def names(self) -> list[bytes]:
        return [c[0].upper() for c in self.commands]

    def close(self):
        self.stopped.set()
        self.listener.close()
        self.thread.join(5)


def bulk(v: bytes | None) -> bytes:
    return b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v)


def nils(args) -> bytes:
    """An MGET reply of nils for every key asked, +OK for anything else."""
    if args[0].upper() == b"MGET":
        return b"*%d\r\n" % (len(args) - 1) + b"".join(bulk(None) for _ in args[1:])
    return b"+OK\r\n"


@pytest.fixture
def stand_in():
    made = []

    def make(reply, trickle=None):
        made.append(StandIn(reply, trickle))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_trickled_reply_costs_one_timeout_not_one_per_byte(stand_in):
    # 4 keys: a 24-byte reply, 50 ms a byte: 1.2 s if each read had its own timeout.
    server = stand_in(nils, trickle=0.05)
    tier = kvrs.RedisTier(server.url, timeout=0.2, retry_after=5.0)
    p = pool([tier])
    t0 = time.monotonic()
    s = p.new_sequence(tokens=PROMPT)
    again = p.new_sequence(tokens=PROMPT)  # skipped for retry_after
    took = time.monotonic() - t0
    assert took < 0.6, took
    assert s.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert tier.stats()["errors"] == 2
    assert server.names() == [b"MGET"]
    t0 = time.monotonic()
    assert kvrs.RedisTier(server.url, timeout=0.2).get([f"k{i}" for i in range(4)]) == [None] * 4
    assert time.monotonic() - t0 < 0.6


def test_a_short_mget_reply_deletes_nothing(redis_server, redis_url, stand_in):
    real = kvrs.RedisTier(redis_url)
    p = pool([real])
    serve(p, PROMPT).free()
    evict_everything(p)
    client = redis_server.client()
    stored = {k: client.get(k) for k in client.keys("kvrs:*")}
    assert len(stored) == 4

    def short(args):
        if args[0].upper() != b"MGET":
            return b":1\r\n"
        values = [stored.get(k) for k in args[1:]]
        return b"*%d\r\n" % (len(values) - 1) + b"".join(bulk(v) for v in values[1:])

    server = stand_in(short)
    tier = kvrs.RedisTier(server.url, timeout=2.0)
    q = pool([tier])
    s = q.new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 0
    st = tier.stats()
    assert (st["errors"], st["rejected"], st["hits"]) == (1, 0, 0)
    assert server.names() == [b"MGET"], server.names()  # no UNLINK
    # The same payloads served in full are loaded.
    r = pool([real])
    s = r.new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 16
    check_contents(s, PROMPT)


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:s3cret@127.0.0.1:1/0",
        "redis://:s3cret@127.0.0.1:1/0",
    ],
)
def test_the_password_is_never_shown(url):
    tier = kvrs.RedisTier(url)
    assert "s3cret" not in repr(tier) and "s3cret" not in tier.url
    assert "***" in tier.url and tier.url.endswith("@127.0.0.1:1/0")
    assert "s3cret" not in tier.stats()["name"]
    p = pool([tier])
    assert "s3cret" not in repr(p.stats())


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:s3cret@127.0.0.1:notaport/0",
        "redis://user:s3cret@127.0.0.1:1/notadb",
        "http://user:s3cret@example.com",
    ],
)
def test_a_malformed_url_error_hides_the_password(url):
    with pytest.raises(ValueError, match="url") as e:
        kvrs.RedisTier(url)
    assert "s3cret" not in str(e.value)


def test_a_forked_child_opens_its_own_connection(redis_server, redis_url):
    tier = kvrs.RedisTier(redis_url, timeout=2.0)
    p = pool([tier])
    serve(p, PROMPT).free()
    evict_everything(p)
    del p  # no pool (and no pool thread) crosses the fork
    client = redis_server.client()
    keys = [k.decode() for k in client.keys("kvrs:*")]
    want = [client.get(k) for k in keys]
    assert tier.get(keys) == want and None not in want  # a pooled connection now
    before = int(client.info("stats")["total_connections_received"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:
        # The child asks the tier directly: a pool's lookup in a forked child is another
        # matter (its worker threads are not the child's).
        code = 1
        try:
            # (No redis-py call here: its pool would connect anew after the fork.)
            if tier.get(keys) == want and tier.stats()["errors"] == 0:
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    status = done[1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    after = int(client.info("stats")["total_connections_received"])
    assert after >= before + 1  # the child did not use the parent's socket
    # The parent's connection still works, with its own replies.
    assert tier.get(keys) == want
    q = pool([tier])
    s = q.new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 16
    check_contents(s, PROMPT)
    assert tier.stats()["errors"] == 0

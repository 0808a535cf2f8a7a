"""Offload tiers that processes share: payloads authenticated under a shared secret (a
writer without it cannot make any pool load its bytes, and one namespace's or model's
blocks never pass as another's), a tiered pool that works in a child after fork(), and a
write-back queue bounded in bytes."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from blake3_ref import blake3, derive_key
from test_tiers import BS, PROMPT, check_contents, evict_everything, pool, serve, tier_stats

import kvrs

HERE = Path(__file__).resolve().parent
SECRET = b"a-secret-the-pools-share-0123456789"
MAC_CONTEXT = "kvrs 2026-11 tier payload MAC root key"


def payload_files(tier_dir: Path) -> list[Path]:
    return sorted(tier_dir.rglob("*.kvb"))


def forge(payload: bytes, secret: bytes) -> bytes:
    """What a writer who knows the format (and `secret`, b"" for none) makes of a
    genuine payload: other K/V, re-signed under the namespace key it derives."""
    body = bytearray(payload[:-32])
    fp, root = body[8:24], body[56:72]
    tokens_end = 112 + 4 * BS  # the header, then the token ids
    body[tokens_end:] = bytes(len(body) - tokens_end)  # zero K/V
    config = blake3(b"config" + bytes(fp), key=derive_key(MAC_CONTEXT, secret))
    namespace = blake3(bytes(root), key=config)
    return bytes(body) + blake3(bytes(body), key=namespace)


def cached_then_evicted(tmp_path, **kw):
    """A disk tier holding PROMPT's blocks, written by a pool made with `kw`."""
    disk = kvrs.DiskTier(tmp_path / "tier", "1MiB")
    p = pool([disk], **kw)
    serve(p, PROMPT).free()
    evict_everything(p)
    files = payload_files(tmp_path / "tier")
    assert len(files) == len(PROMPT) // BS
    return disk, files


def test_pools_sharing_a_secret_share_blocks_and_other_secrets_miss(tmp_path):
    disk, _ = cached_then_evicted(tmp_path, tier_key=SECRET)
    same = pool([disk], tier_key=SECRET.decode())  # a str is its UTF-8 bytes
    s = same.new_sequence(tokens=PROMPT)
    assert s.seq_len == 16 and tier_stats(same)["hits"] == 4
    check_contents(s, PROMPT)
    for other in (b"another-secret-of-sixteen-bytes", None):
        q = pool([disk], tier_key=other)
        assert q.new_sequence(tokens=PROMPT).seq_len == 0
        # Another secret files its blocks elsewhere: misses, not rejections.
        assert tier_stats(q)["rejected"] == 0


@pytest.mark.parametrize("keyed", [True, False])
def test_a_forged_payload_loads_only_where_no_secret_was_set(tmp_path, keyed):
    kw = {"tier_key": SECRET} if keyed else {}
    disk, files = cached_then_evicted(tmp_path, **kw)
    # The attacker can write to the directory and knows the format, not the secret.
    for f in files:
        f.write_bytes(forge(f.read_bytes(), b""))
    p = pool([disk], **kw)
    s = p.new_sequence(tokens=PROMPT)
    if keyed:
        assert s.seq_len == 0
        # Every block is refused and removed; the prompt is computed.
        assert tier_stats(p)["rejected"] == 4 and tier_stats(p)["hits"] == 0
        assert payload_files(tmp_path / "tier") == []
    else:
        # Without a secret, whoever can write to the store is trusted (README).
        assert s.seq_len == 16
        assert not s.get(0)[0].any()


def test_a_payload_of_another_namespace_never_passes(tmp_path):
    disk = kvrs.DiskTier(tmp_path / "tier", "1MiB")
    p = pool([disk], tier_key=SECRET)
    files = {}
    for ns in ("alice", "bob"):
        serve(p, PROMPT, namespace=ns).free()
        evict_everything(p)
        new = [
            f for f in payload_files(tmp_path / "tier") if all(f not in v.values() for v in files.values())
        ]
        # Each block by its token ids (header, then 4 * BS bytes of tokens).
        files[ns] = {f.read_bytes()[112 : 112 + 4 * BS]: f for f in new}
    assert files["alice"].keys() == files["bob"].keys() and len(files["bob"]) == 4
    # Alice's payloads at Bob's paths, their block fields (key, parent, root) made Bob's:
    # everything the pool checks matches but the MAC, made under Alice's namespace key.
    for tokens, b in files["bob"].items():
        raw = bytearray(files["alice"][tokens].read_bytes())
        raw[24:76] = b.read_bytes()[24:76]
        b.write_bytes(bytes(raw))
    fresh = pool([disk], tier_key=SECRET)
    assert fresh.new_sequence(tokens=PROMPT, namespace="bob").seq_len == 0
    assert tier_stats(fresh)["rejected"] == 4 and tier_stats(fresh)["hits"] == 0
    s = fresh.new_sequence(tokens=PROMPT, namespace="alice")
    assert s.seq_len == 16
    check_contents(s, PROMPT)


def test_tier_key_and_queue_bytes_are_checked(tmp_path):
    disk = kvrs.DiskTier(tmp_path / "tier", "1MiB")
    with pytest.raises(ValueError, match=r"tier_key.*at least 16 bytes"):
        pool([disk], tier_key=b"short")
    with pytest.raises(TypeError, match="tier_key"):
        pool([disk], tier_key=1234)
    with pytest.raises(ValueError, match=r"tier_queue_bytes.*at least one payload"):
        pool([disk], tier_queue_bytes=16)
    assert "a-secret" not in repr(pool([disk], tier_key=SECRET))


def stalled_server(answer_lookups=False):
    """A loopback server that accepts connections and never answers, except (with
    `answer_lookups`) an `MGET` request alone on its connection, which it answers with
    misses: lookups go on while stores wait forever."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns = []

    def answer(c):
        while True:
            try:
                data = c.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            if answer_lookups and b"MGET" in data and b"SET" not in data.replace(b"MGET", b""):
                keys = int(data.split(b"\r\n", 1)[0][1:]) - 1
                c.sendall(b"*%d\r\n" % keys + b"$-1\r\n" * keys)

    def accept():
        while True:
            try:
                c = srv.accept()[0]
            except OSError:
                return
            conns.append(c)
            threading.Thread(target=answer, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv, conns


def test_the_write_back_queue_is_bounded_in_bytes():
    srv, conns = stalled_server(answer_lookups=True)
    try:
        url = f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
        tier = kvrs.RedisTier(url, timeout=3.0)
        payload = 112 + 4 * BS + 2 * (2 * BS * 2 * 8 * 4) + 32  # header, tokens, K/V, MAC
        p = pool([tier], num_blocks=64, tier_queue=1000, tier_queue_bytes=3 * payload)
        for i in range(12):
            serve(p, [10_000 * (i + 1) + t for t in range(17)]).free()
        p.evict_all()  # 48 blocks leave while the writer waits for the stalled server
        q = p.stats()["tier_queue"]
        # Payloads count until written, so a batch in the writer's hands counts too.
        assert q["queued_bytes"] == 3 * payload
        assert (q["queued"], q["dropped"]) == (3, 45)
    finally:
        srv.close()
        for c in conns:
            c.close()


FORK_CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    sys.path.insert(0, {here!r})
    import kvrs
    from test_tiers import PROMPT, pool, serve, check_contents, evict_everything

    disk = kvrs.DiskTier({tier!r}, "1MiB")
    p = pool([disk], num_blocks=8, tier_key={secret!r})
    serve(p, PROMPT).free()
    evict_everything(p)
    p.prefetch([7] * 17, wait=False)  # work under way in the parent's threads
    {start}
    """
)

CHILD_BODY = """
def child():
    p.flush_tiers()
    assert p.prefetch(PROMPT, wait=False) >= 0
    s = p.new_sequence(tokens=PROMPT)
    check_contents(s, PROMPT)
    q = np.ones((3, 2, 8), np.float32)
    s.attention(0, q)
    s.free()
    serve(p, [900 + t for t in range(17)]).free()
    p.evict_all()
    p.flush_tiers()
"""


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_a_tiered_pool_works_in_a_forked_child_that_exits_normally(tmp_path, how):
    if how == "os.fork":
        start = CHILD_BODY + textwrap.dedent(
            """
            pid = os.fork()
            if pid == 0:
                child()
                sys.exit(0)  # a normal exit: finalizers and the pool's Drop run
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
            """
        )
    else:
        start = CHILD_BODY + textwrap.dedent(
            """
            import multiprocessing as mp
            proc = mp.get_context("fork").Process(target=child)
            proc.start()
            proc.join(60)
            assert proc.exitcode == 0, proc.exitcode
            """
        )
    start += "\np.flush_tiers()\ns = p.new_sequence(tokens=PROMPT)\ncheck_contents(s, PROMPT)\nprint('ok')\n"
    script = FORK_CHILD.format(here=str(HERE), tier=str(tmp_path / "tier"), secret=SECRET, start=start)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout, r.stderr)
    assert time.monotonic() - t0 < 60


def test_attention_runs_in_a_forked_child_after_the_parent_ran_it():
    # The parent's worker threads do not exist in a child: the child must build its own.
    script = textwrap.dedent(
        """
        import os, sys
        import numpy as np
        import kvrs
        p = kvrs.BlockPool(1, 2, 64, block_size=16, num_blocks=300, dtype="float32")
        s = p.new_sequence()
        x = np.ones((4000, 2, 64), np.float32)
        s.append(0, x, x)
        s.advance(4000)
        q = np.ones((64, 2, 64), np.float32)
        want = s.attention(0, q)
        pid = os.fork()
        if pid == 0:
            got = s.attention(0, q)
            os._exit(0 if np.array_equal(got, want) else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "0", (r.stdout, r.stderr)


def test_a_slow_tier_lookup_holds_neither_the_pool_nor_the_gil():
    srv, conns = stalled_server()
    try:
        url = f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
        p = pool([kvrs.RedisTier(url, timeout=1.0)], num_blocks=32)
        done = threading.Event()
        waited = []

        def lookup():
            t0 = time.monotonic()
            s = p.new_sequence(tokens=PROMPT)  # misses in the pool: asks the stalled server
            waited.append(time.monotonic() - t0)
            assert s.seq_len == 0
            done.set()

        t = threading.Thread(target=lookup)
        t.start()
        time.sleep(0.1)
        worst, calls = 0.0, 0
        while not done.is_set():
            t0 = time.monotonic()
            s = p.new_sequence()  # the pool's lock, with the GIL
            s.free()
            p.stats()
            worst = max(worst, time.monotonic() - t0)
            calls += 1
        t.join()
        assert waited[0] >= 0.8  # the lookup did wait for the server
        assert calls > 100 and worst < 0.2, (calls, worst)
    finally:
        srv.close()
        for c in conns:
            c.close()

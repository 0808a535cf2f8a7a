"""DiskTier against what else may be in its shared directory: a FIFO at a block path
(a lookup must not hang), other processes writing at the same time (the bound holds for
them together), and the temporary file of a killed writer (counted, then swept)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_tiers import PROMPT, check_contents, evict_everything, pool, serve

import kvrs


def store(p, tokens):
    """Serves `tokens` and pushes its blocks to the tiers."""
    serve(p, tokens).free()
    evict_everything(p)


def key_of(root: Path, f: Path) -> str:
    """The tier key of the block file `f` (`{root}/{fp}/{root}/{block}.kvb`)."""
    return "kvrs:" + ":".join(f.relative_to(root).with_suffix("").parts)


def within(seconds, fn, fifo):
    """fn() on a thread; fails (after unblocking a reader stuck on `fifo`) if it has not
    returned in time."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        pytest.fail(f"blocked on a FIFO for {seconds} s")
    return out["r"]


def test_a_fifo_at_a_block_path_does_not_hang_lookups(tmp_path):
    disk = kvrs.DiskTier(tmp_path, "1MiB")
    store(pool([disk]), PROMPT)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 4
    fifo = files[0]
    size = fifo.stat().st_size
    fifo.unlink()
    os.mkfifo(fifo)
    start = time.monotonic()
    # A raw lookup that accepts any length, and a pool's (its exact payload length).
    assert within(5, lambda: disk.get([key_of(tmp_path, fifo)]), fifo) == [None]
    s = within(5, lambda: serve(pool([disk]), PROMPT), fifo)
    assert time.monotonic() - start < 2
    assert s.num_cached_tokens < 16
    check_contents(s, PROMPT)
    assert disk.stats()["rejected"] >= 2
    # The next store of that block replaces the FIFO with the block.
    store(pool([disk], num_blocks=8), PROMPT)
    assert fifo.is_file() and fifo.stat().st_size == size
    assert pool([disk]).new_sequence(tokens=PROMPT).num_cached_tokens == 16


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {here!r})
    import kvrs
    from test_tier_disk_faults import pool, store
    go = Path({go!r})
    while not go.exists():
        time.sleep(0.005)
    disk = kvrs.DiskTier({dir!r}, {bound})
    p = pool([disk])
    for i in range(40):
        store(p, [{me} * 100_000 + i * 100 + t for t in range(17)])
    print(disk.stats()["stores"], disk.stats()["evictions"])
    """
)


def test_two_processes_writing_at_once_keep_the_bound_together(tmp_path):
    """Each process writes 160 blocks (about 8 times the bound): alone, each process's
    own count stayed under the bound while the directory grew past it."""
    bound = 20_000
    go = tmp_path / "go"
    d = tmp_path / "tier"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER.format(here=str(Path(__file__).parent), go=str(go), dir=str(d), bound=bound, me=me),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in (1, 2)
    ]
    time.sleep(0.5)  # both importing: they start writing together
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    stores = [tuple(map(int, o.split())) for o, _ in outs]
    assert all(s == 160 for s, _ in stores), stores
    assert sum(e for _, e in stores) > 0
    disk = kvrs.DiskTier(d, bound)
    assert 0 < disk.used_bytes() <= bound
    assert sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and f.suffix == ".kvb") <= bound
    assert not list(d.rglob(".tmp-*")), "no temporary file left behind"


def test_a_killed_writers_temporary_file_is_counted_then_swept(tmp_path):
    tmp_dir = tmp_path / "ab" / "cd"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        d = Path({str(tmp_dir)!r})
        d.mkdir(parents=True)
        with open(d / f".tmp-{{os.getpid()}}-0", "wb") as f:
            f.write(b"\\0" * 5000)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30)
    assert out.returncode == -9
    (temp,) = tmp_dir.iterdir()
    # Fresh, it may be a live writer's (in another PID namespace): kept, and counted.
    disk = kvrs.DiskTier(tmp_path, 6_000)
    assert temp.exists() and disk.used_bytes() == 5000
    # Once it has not changed for a while, the next rescan (the next store finds the
    # directory full) removes it, and the blocks fit without evicting anything.
    old = time.time() - 60
    os.utime(temp, (old, old))
    store(pool([disk]), PROMPT)
    assert not temp.exists()
    st = disk.stats()
    assert (st["stores"], st["evictions"]) == (4, 0), st
    assert disk.used_bytes() == sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))

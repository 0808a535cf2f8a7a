"""Huge sizes are errors, never a crash: each constructor runs in a child process under
an address-space limit (RLIMIT_AS), and must end normally with the documented exception
(ValueError past the address space or a cap, MemoryError when the host refuses), never
with SIGABRT ("memory allocation of N bytes failed") or pyo3's PanicException."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
import kvrs
try:
    {call}
except BaseException as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("no error")
"""


def run_limited(call: str, limit: int = 8 << 30) -> str:
    """Runs `call` in a child under an address-space `limit`; returns what it raised as
    'Type: message'. Fails when the child dies (a signal) or exits non-zero."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(limit=limit, call=call)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, f"{call}: exit {child.returncode}\n{child.stderr[-3000:]}"
    return child.stdout.strip().splitlines()[-1]


CASES = [
    # SIGABRT: 17 GB of per-layer bookkeeping (and over 60 s without a limit).
    ("kvrs.KVCache(2**32, 1, 1, 1)", r"ValueError: num_layers=4294967296: must be <= 65536"),
    ("kvrs.EncoderCache(2**32, 1, 1, 1)", r"ValueError: num_layers=4294967296: must be <= 65536"),
    # SIGABRT: the scales (4 TiB of them) were allocated before the storage.
    ("kvrs.KVCache(1, 2**40, 1, 1)", r"MemoryError: cannot allocate 4398046511104 bytes for the K/V storage"),
    ("kvrs.EncoderCache(1, 2**40, 1, 1)", r"MemoryError: cannot allocate \d+ bytes"),
    (
        "kvrs.KVCache(1, 1, 2**40, 2**30)",
        r"ValueError: head_dim=1099511627776: the cache's K and V of float16 \(.*\) would exceed the "
        r"address space \(at most 9223372036854775807 bytes\)",
    ),
    # PanicException "attempt to divide by zero": the size of a block wrapped to 0.
    (
        "kvrs.BlockPool(1, 1, 2**62, block_size=4, memory_bytes='1GiB')",
        r"ValueError: head_dim=4611686018427387904: one block's K and V of float16 .* address space",
    ),
    (
        "kvrs.BlockPool(1, 2**62, 4, block_size=1, num_blocks=1)",
        r"ValueError: num_kv_heads=4611686018427387904: one block's K and V .* address space",
    ),
    # PanicException "capacity overflow": the write-back queue's channel.
    (
        "kvrs.BlockPool(1, 1, 4, num_blocks=4, seed=1, tiers=[kvrs.HostTier(1 << 20)], model_id='m', "
        "tier_queue=2**62)",
        r"ValueError: tier_queue=4611686018427387904: must be in \[1, 1048576\]",
    ),
    (
        "kvrs.BlockPool(1, 1, 4, num_blocks=4, seed=1, tiers=[kvrs.HostTier(1 << 20)], model_id='m', "
        "tier_queue=0)",
        r"ValueError: tier_queue=0: must be in \[1, 1048576\]",
    ),
]


@pytest.mark.parametrize(("call", "raised"), CASES, ids=[c for c, _ in CASES])
def test_huge_sizes_raise_the_documented_error_in_a_limited_child(call, raised):
    got = run_limited(call)
    assert re.match(raised, got), got


def test_pool_bookkeeping_the_host_refuses_is_a_memory_error():
    # SIGABRT in BlockAllocator::new ("memory allocation of ... bytes failed"): 100M
    # blocks need 400 MB of reference counts, 400 MB of generations and 400 MB of free
    # list, allocated before the storage.
    call = (
        "kvrs.BlockPool(1, 1, 1, block_size=1, num_blocks=100_000_000, dtype='fp8_e4m3', "
        "prefix_caching=False)"
    )
    got = run_limited(call, limit=512 << 20)
    assert re.match(r"MemoryError: cannot allocate 400000000 bytes for the (block|free-block)", got), got


def test_a_huge_prefix_cached_pool_is_a_memory_error():
    # The review's reproduction under its 8 GiB limit: the bookkeeping (allocated before
    # the storage) is refused, never an abort.
    call = "kvrs.BlockPool(1, 1, 1, block_size=1, num_blocks=700_000_000)"
    got = run_limited(call, limit=8 << 30)
    assert got.startswith("MemoryError: cannot allocate"), got

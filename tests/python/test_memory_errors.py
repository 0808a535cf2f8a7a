"""Allocations the host refuses are MemoryError, never an abort: saving and loading a
prefix cache, and copying the token ids (or other integers) passed in. Each scenario runs
in a child process whose address space is limited (RLIMIT_AS, soft limit only) to a bit
more than it uses once set up, so the one big allocation of the call is refused. The
child must end normally with MemoryError (not SIGABRT: "memory allocation of N bytes
failed"); then it lifts the limit and checks that the pool is unchanged and still works.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/status; RLIMIT_AS as Linux enforces it"
)

# A 64 MiB pool (1024 blocks of 64 KiB) with every block cached, and the helpers.
SETUP = """
import os, resource, sys
import numpy as np
import kvrs

BS = 16
p = kvrs.BlockPool(1, 8, 128, block_size=BS, num_blocks=1024, dtype="float32", seed=7, model_id="m")
k = np.ones((BS, 8, 128), np.float32)
for i in range(p.num_blocks if FILL else 0):
    s = p.new_sequence(list(range(i * BS, i * BS + BS + 1)))
    s.append(0, k, k)
    s.advance(BS)
    s.free()


def limit(headroom):
    for line in open("/proc/self/status"):
        if line.startswith("VmSize"):
            used = int(line.split()[1]) * 1024
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (used + headroom, hard))


def unlimit():
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def refused(call):
    before = p.stats()
    limit(24 << 20)
    try:
        call()
    except MemoryError as e:
        unlimit()
        assert str(e).startswith("cannot allocate"), e
        assert p.stats() == before, (before, p.stats())
        p.check_invariants()
        return str(e)
    unlimit()
    raise AssertionError("no MemoryError")
"""


def run_child(body: str, fill: bool, tmp_path) -> str:
    """Runs SETUP (with every block cached when `fill`), then `body`; returns the child's
    last line of output. Fails when the child dies of a signal or exits non-zero."""
    code = f"FILL = {fill}\nDIR = {str(tmp_path)!r}\n" + SETUP + textwrap.dedent(body)
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stdout[-2000:]}\n{child.stderr[-3000:]}"
    return child.stdout.strip().splitlines()[-1]


def test_a_snapshot_the_host_refuses_is_a_memory_error_and_writes_nothing(tmp_path):
    # SIGABRT: save_prefix_cache built the whole file in memory with vec! (twice: the
    # snapshot, then safetensors' serialization).
    out = run_child(
        """
        path = os.path.join(DIR, "c.kvc")
        print(refused(lambda: p.save_prefix_cache(path)))
        assert os.listdir(DIR) == [], os.listdir(DIR)
        assert p.save_prefix_cache(path) == 1024
        q = kvrs.BlockPool(1, 8, 128, block_size=BS, num_blocks=1024, dtype="float32", seed=7, model_id="m")
        assert q.load_prefix_cache(path) == {"loaded": 1024, "skipped": 0}
        print("ok")
        """,
        True,
        tmp_path,
    )
    assert out == "ok"


def test_a_file_the_host_cannot_read_is_a_memory_error_and_loads_nothing(tmp_path):
    out = run_child(
        """
        path = os.path.join(DIR, "c.kvc")
        print(p.save_prefix_cache(path))
        """,
        True,
        tmp_path,
    )
    assert out == "1024"
    out = run_child(
        """
        path = os.path.join(DIR, "c.kvc")
        message = refused(lambda: p.load_prefix_cache(path))
        assert "for the prefix-cache file" in message, message
        assert p.load_prefix_cache(path) == {"loaded": 1024, "skipped": 0}
        print("ok")
        """,
        False,
        tmp_path,
    )
    assert out == "ok"


TOKEN_CALLS = {
    "new_sequence": "p.new_sequence(t)",
    "match_prefix": "p.match_prefix(t)",
    "pin": "p.pin(t)",
    "unpin": "p.unpin(t)",
    "start_forward": "p.start_forward([seq], tokens=t)",
    "advance": "seq.advance(1, tokens=t)",
    "reserve": "p.reserve([seq], t)",
}
# 64 MiB of ids (uint32, read straight from memory), 64 MiB of int64 (range-checked, then
# narrowed), or a list (64 MiB of pointers to one int). reserve's counts take no uint32
# fast path: numpy converts them (and raises its own MemoryError).
ARRAYS = {
    "uint32": "np.ones(1 << 24, np.uint32)",
    "int64": "np.ones(1 << 23, np.int64)",
    "list": "[1] * (1 << 23)",
}


@pytest.mark.parametrize("array", sorted(ARRAYS))
def test_token_ids_the_host_cannot_copy_are_a_memory_error(tmp_path, array):
    # SIGABRT: the ids were copied with to_vec / collect.
    skip = "reserve" if array == "uint32" else None
    calls = {name: call for name, call in TOKEN_CALLS.items() if name != skip}
    out = run_child(
        f"""
        seq = p.new_sequence()
        t = {ARRAYS[array]}
        for name, call in {calls!r}.items():
            message = refused(lambda: eval(call))
            assert message.endswith(("for tokens", "for counts")), (name, message)
        seq.free()
        s = p.new_sequence(list(range(40)))
        assert s.num_cached_tokens == 0
        print("ok")
        """,
        False,
        tmp_path,
    )
    assert out == "ok"


def test_a_prompt_is_copied_once(tmp_path):
    # The sequence keeps the ids read from the array: a prompt whose one copy fits the
    # address space starts (a second copy would not have fitted).
    out = run_child(
        """
        t = np.ones(5 << 20, np.uint32)  # 20 MiB under the 24 MiB of headroom
        limit(24 << 20)
        s = p.new_sequence(t)
        unlimit()
        assert s.num_cached_tokens == 0
        print("ok")
        """,
        False,
        tmp_path,
    )
    assert out == "ok"

"""Random calls with hostile arguments: only the documented exceptions may come out.

A Rust panic would surface as pyo3's PanicException (a BaseException, not an
Exception); it must never happen, whatever the arguments. The pool's invariants must
hold after every call.

Every public method and constructor of every class is called (the classes' methods are
found by introspection, so a new method without a fuzz entry fails
test_every_public_method_has_a_fuzz_entry) with extreme integers, floats, arrays and
wrong types. Constructors with huge sizes run in a child process under an address-space
limit, where a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvrs

ALLOWED = (ValueError, IndexError, TypeError, OverflowError, MemoryError, kvrs.KvrsError)

ints = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([-(2**63), 2**63 - 1, 2**31, -1, 0, 2**40]),
)
arrays = st.one_of(
    st.builds(
        lambda n, h, d: np.ones((n, h, d), np.float32),
        st.integers(0, 5),
        st.integers(1, 3),
        st.integers(1, 5),
    ),
    st.builds(lambda n: np.ones(n, np.float16), st.integers(0, 6)),
    st.just(np.ones((2, 2, 4), np.float64)),
    st.just(np.ones((2, 2, 4), np.int8)),
    st.just(np.zeros((0, 2, 4), np.float32)),
    st.just("not an array"),
    st.just(None),
    st.just([1.0, 2.0]),
)
int_lists = st.one_of(
    st.lists(ints, max_size=6),
    st.just(np.array([1.5, 2.5])),
    st.just("123"),
    st.just(None),
)

CALLS = [
    ("append", lambda o, a, b, c: o.append(a, b, c), (ints, arrays, arrays)),
    ("advance", lambda o, a, b, c: o.advance(a), (ints, ints, ints)),
    ("truncate", lambda o, a, b, c: o.truncate(a), (ints, ints, ints)),
    ("remove", lambda o, a, b, c: o.remove(a, b), (ints, st.one_of(ints, st.none()), ints)),
    ("get", lambda o, a, b, c: o.get(a), (ints, ints, ints)),
    ("views", lambda o, a, b, c: o.views(a), (ints, ints, ints)),
    ("extract_block", lambda o, a, b, c: o.extract_block(a, b, c), (ints, ints, ints)),
    ("inject_block", lambda o, a, b, c: o.inject_block(a, b, 2, c, c), (ints, ints, arrays)),
    ("set_seq_len", lambda o, a, b, c: o.set_seq_len(a), (ints, ints, ints)),
    ("advance_tokens", lambda o, a, b, c: o.advance(a, tokens=b), (ints, int_lists, ints)),
    ("fork_free", lambda o, a, b, c: o.fork().free(), (ints, ints, ints)),
]

POOL_CALLS = [
    ("reserve", lambda p, s, a, b: p.reserve([s], a), (int_lists, ints)),
    (
        "write",
        lambda p, s, a, b: p.write(b, np.ones((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32), a),
        (int_lists, ints),
    ),
    ("start_forward", lambda p, s, a, b: p.start_forward([s] * 2, a).cancel(), (int_lists, ints)),
    ("match_prefix", lambda p, s, a, b: p.match_prefix(a), (int_lists, ints)),
    ("pin", lambda p, s, a, b: p.pin(a), (int_lists, ints)),
    ("unpin", lambda p, s, a, b: p.unpin(a), (int_lists, ints)),
    ("new_sequence", lambda p, s, a, b: p.new_sequence(tokens=a).free(), (int_lists, ints)),
    ("copy_prefix", lambda p, s, a, b: p.copy_prefix(s, p.new_sequence(), b), (int_lists, ints)),
    ("kv_cache", lambda p, s, a, b: p.kv_cache(b), (int_lists, ints)),
    ("block_tables", lambda p, s, a, b: p.block_tables([s], pad=b), (int_lists, ints)),
]


def call(fn, *args):
    try:
        fn(*args)
    except ALLOWED:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_sequence_and_pool_calls_never_panic(data):
    pool = kvrs.BlockPool(2, 2, 4, block_size=4, num_blocks=6, dtype="float16", rope=kvrs.RoPE(), events=True)
    seq = pool.new_sequence(tokens=list(range(10)))
    for _ in range(data.draw(st.integers(1, 12))):
        if data.draw(st.booleans()):
            _, fn, strategies = data.draw(st.sampled_from(CALLS))
            call(fn, seq, *(data.draw(s) for s in strategies))
        else:
            _, fn, strategies = data.draw(st.sampled_from(POOL_CALLS))
            call(fn, pool, seq, *(data.draw(s) for s in strategies))
        pool.check_invariants()
    pool.drain_events()


def cache_calls(cache, enc, rope, a, b, c, positions):
    """One call of each kind on a KVCache, an EncoderCache, a RoPE and the constructors."""
    return [
        lambda: cache.append(a, c, c),
        lambda: cache.store_key(a, b, 0, c),
        lambda: cache.keys_for(a, b, b),
        lambda: cache.extract_block(a, b, 3),
        lambda: cache.inject_block(a, b, 2, c, c),
        lambda: cache.set_seq_len(a),
        lambda: enc.set(a, c, c),
        lambda: enc.get(a),
        lambda: rope.apply(c, positions),
        lambda: kvrs.BlockPool(a, 2, 4, num_blocks=b, block_size=max(1, min(abs(a), 64))),
    ]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_kv_cache_and_encoder_cache_calls_never_panic(data):
    cache = kvrs.KVCache(2, 2, 4, 8, dtype="bfloat16")
    enc = kvrs.EncoderCache(2, 2, 4, 8)
    rope = kvrs.RoPE()
    for _ in range(data.draw(st.integers(1, 12))):
        a, b, c = data.draw(ints), data.draw(ints), data.draw(arrays)
        calls = cache_calls(cache, enc, rope, a, b, c, data.draw(int_lists))
        call(calls[data.draw(st.integers(0, len(calls) - 1))])
    assert cache.seq_len <= cache.max_seq_len


# Every public method and constructor, with extreme arguments. ENTRIES names a fuzz call
# for each public method of each class; test_every_public_method_has_a_fuzz_entry fails
# when a class gains a method without one. Properties are read after every call.

EXTREME_INTS = [0, -1, 1, 2, 3, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -(2**63), 2**64, -(2**64)]
EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-30, 0.5, 3.4e38, 1e308, -1e308, math.nan, math.inf, -math.inf]
WRONG = [None, "x", "", b"\xff", [], [[]], {}, object(), 1.5, True, 1j]


def pick(values: list) -> st.SearchStrategy:
    """One of `values` (which need not be hashable, unlike st.sampled_from's)."""
    return st.integers(0, len(values) - 1).map(values.__getitem__)


wrong = pick(WRONG)


def mostly(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """`strategy`, or one time in ten a value of a wrong type."""
    return st.integers(0, 9).flatmap(lambda k: wrong if k == 0 else strategy)


big_ints = st.one_of(st.integers(-2, 9), st.sampled_from(EXTREME_INTS))
I = mostly(big_ints)  # noqa: E741
OPT_I = st.one_of(st.none(), I)
F = mostly(st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(-4, 4)))
OPT_F = st.one_of(st.none(), F)
B = mostly(st.booleans())
KEY = mostly(st.one_of(st.none(), st.text(max_size=3), st.binary(max_size=3)))
FLOATS = st.one_of(
    st.none(),
    st.lists(st.sampled_from(EXTREME_FLOATS), max_size=4),
    pick([np.full(2, np.nan, np.float32), np.ones((2, 2)), np.array(["a"]), np.ones(4, ">f8")]),
    wrong,
)
L = mostly(
    st.one_of(
        st.lists(big_ints, max_size=6),
        st.lists(st.integers(0, 40), max_size=12),
        pick(
            [
                np.array([2**63 - 1, -1], np.int64),
                np.array([2**64 - 1], np.uint64),
                np.array([1.5]),
                np.array([[1, 2]]),
                np.array([], np.float64),
                np.array([1, 2], ">i8"),
                np.arange(3, dtype=np.int32)[::-1],
                "123",
                b"12",
                range(3),
            ]
        ),
    )
)
OPT_L = st.one_of(st.none(), L)
# Custom masks (tree attention): bools of any length, packed bytes, other dtypes and shapes.
MASK = st.one_of(
    st.none(),
    st.lists(st.booleans(), max_size=40).map(lambda x: np.array(x, dtype=bool)),
    st.lists(st.integers(0, 255), max_size=6).map(lambda x: np.array(x, dtype=np.uint8)),
    pick([np.ones((2, 3), bool), np.ones(4, np.float32), [True, False], np.array(["a"])]),
    wrong,
)


def _extreme_arrays() -> list:
    """Inputs of every awkward kind: non-finite and extreme values, odd strides, shapes,
    dtypes and byte orders, huge zero-stride broadcasts, unaligned and read-only memory."""
    base = np.arange(16, dtype=np.float32).reshape(2, 2, 4)
    unaligned = np.frombuffer(bytes(1 + 32), np.uint8)[1:].view(np.float32).reshape(1, 2, 4)
    read_only = np.ones((1, 2, 4), np.float32)
    read_only.setflags(write=False)
    return [
        np.full((1, 2, 4), np.nan, np.float32),
        np.full((2, 2, 4), np.inf, np.float32),
        np.full((1, 2, 4), np.finfo(np.float32).max, np.float32),
        np.full((1, 2, 4), -65504.0, np.float16),
        base[::-1],
        base[:, :, ::-2],
        base.transpose(1, 0, 2),
        np.broadcast_to(np.float32(1), (2**20, 2, 4)),
        np.broadcast_to(np.float32(1), (2, 2**20, 4)),
        np.zeros((0, 2, 4), np.float32),
        np.zeros((2, 0, 4), np.float32),
        np.zeros((1, 2, 0), np.float32),
        np.array(1.0, np.float32),
        np.ones((1, 1, 2, 4), np.float32),
        np.ones((1, 2, 4), ">f4"),
        np.ones((1, 2, 4), ">f2"),
        np.ones((1, 2, 4), ml_dtypes.bfloat16),
        np.ones((1, 2, 4), ml_dtypes.float8_e4m3fn),
        np.ones((1, 2, 4), np.float64),
        np.ones((1, 2, 4), np.int64),
        np.ones((1, 2, 4), bool),
        np.array([None] * 8, object).reshape(1, 2, 4),
        memoryview(np.ones((1, 2, 4), np.float32)).toreadonly(),
        memoryview(np.ones((1, 2, 4), ">f4")).toreadonly(),
        memoryview(b"\x00" * 32),
        unaligned,
        read_only,
    ]


A = mostly(
    st.one_of(
        pick(_extreme_arrays()),
        st.builds(
            lambda n, dt: np.ones((n, 2, 4), dt), st.integers(0, 5), st.sampled_from([np.float32, np.float16])
        ),
        st.builds(lambda n: np.ones((2, n, 4), np.float32), st.integers(0, 5)),
    )
)

# Stacked per-layer inputs ([layers, n_tokens, heads, head_dim]) and every awkward 3-D one.
A4 = mostly(
    st.one_of(
        A,
        st.builds(
            lambda nl, n, dt: np.ones((nl, n, 2, 4), dt),
            st.integers(0, 3),
            st.integers(0, 5),
            st.sampled_from([np.float32, np.float16]),
        ),
    )
)


def _outputs() -> list:
    """Destinations: right and wrong shapes, dtypes, byte orders, read-only memory."""
    read_only = np.zeros((1, 4, 4), np.float32)
    read_only.setflags(write=False)
    return [
        np.zeros((1, 4, 4), np.float32),
        np.zeros((2, 4, 4), np.float32),
        np.zeros((1, 4, 4), ">f4"),
        np.zeros((1, 4, 4), np.float64),
        np.zeros((2, 8, 4), np.float32),
        np.zeros((2, 8, 4), np.float16)[:, ::2],
        np.zeros(8, np.float32),
        read_only,
    ]


OUT = st.one_of(st.none(), pick(_outputs()), wrong)
OUT_PAIR = st.one_of(st.none(), st.tuples(pick(_outputs()), pick(_outputs())), wrong)
SEQS = st.sampled_from(["live", "two", "none", "freed", "foreign", "dup", "wrong", "not a list"])
SEQ = st.sampled_from(["live", "other", "freed", "foreign", "wrong"])
CACHE = st.sampled_from(["float", "int8", "wrong"])
PATH = st.sampled_from(["saved", "junk", "dir", "missing", "", "nul", "wrong"])
ATTN = {"out": OUT, "scale": OPT_F, "softcap": OPT_F, "sinks": FLOATS, "alibi_slopes": FLOATS}


# PageStore: keys, pages (and buffers) of 16 bytes, or anything else; namespaces.
PAGE_KEYS = mostly(st.lists(st.text(max_size=4), max_size=3))
PAGES = mostly(
    st.lists(
        st.one_of(
            st.builds(lambda: np.zeros(16, np.uint8)),
            st.builds(lambda: bytearray(16)),
            st.binary(max_size=20),
            st.builds(lambda: np.zeros(4, np.float32)),
        ),
        max_size=3,
    )
)
NS = mostly(st.one_of(st.none(), st.text(max_size=3)))


class Env:
    """The objects a fuzz run calls, and the arguments that name them."""

    def __init__(self, tmp: Path, dtype: str):
        tier = kvrs.HostTier(1 << 20)
        self.pool = kvrs.BlockPool(
            2,
            2,
            4,
            block_size=4,
            num_blocks=8,
            dtype=dtype,
            rope=kvrs.RoPE(),
            events=True,
            tiers=[tier],
            model_id="fuzz",
            seed=1,
        )
        self.foreign_pool = kvrs.BlockPool(2, 2, 4, block_size=4, num_blocks=2)
        self.foreign = self.foreign_pool.new_sequence()
        self.freed = self.pool.new_sequence()
        self.freed.free()
        self.seq = self.other = self.batch = None
        self.cache = kvrs.KVCache(2, 2, 4, 8, dtype="float32")
        self.int8_cache = kvrs.KVCache(2, 2, 4, 8, dtype="int8")
        self.enc = kvrs.EncoderCache(2, 2, 4, 8, dtype=dtype)
        self.rope = kvrs.RoPE(rotary_dim=2, style="gptj")
        self.tiers = [tier, kvrs.DiskTier(tmp / "disk", "1MiB"), kvrs.RedisTier("redis://127.0.0.1:1/0")]
        self.pages = kvrs.PageStore(
            [kvrs.HostTier(1 << 16), self.tiers[1]], fingerprint={"model": "fuzz", "page_bytes": 16}
        )
        self.suffix = kvrs.SuffixIndex(max_tokens=64, max_depth=4)
        self.suffix.add([1, 2, 3, 1, 2, 4])
        self.paths = {
            "saved": str(tmp / "saved.safetensors"),
            "junk": str(tmp / "junk.safetensors"),
            "dir": str(tmp),
            "missing": str(tmp / "no" / "such" / "dir" / "x"),
            "": "",
            "nul": "a\0b",
            "wrong": 7,
        }
        (tmp / "junk.safetensors").write_bytes(b"\xff" * 64)
        self.refresh()

    def refresh(self):
        """Replaces freed sequences (with some K/V in them) and a closed batch."""
        for name in ("seq", "other"):
            s = getattr(self, name)
            if s is None or s.is_freed:
                s = self.pool.new_sequence(tokens=list(range(10)))
                kv = np.ones((3, 2, 4), np.float32)
                for layer in range(2):
                    checked("Sequence.append", s.append, layer, kv, kv)
                checked("Sequence.advance", s.advance, 3)
                setattr(self, name, s)
        if self.batch is None:
            self.batch = checked("BlockPool.start_forward", self.pool.start_forward, [self.seq, self.other])

    def seqs(self, which: str):
        return {
            "live": [self.seq],
            "two": [self.seq, self.other],
            "none": [],
            "freed": [self.freed],
            "foreign": [self.foreign],
            "dup": [self.seq, self.seq],
            "wrong": [1, "x"],
            "not a list": 5,
        }[which]

    def one(self, which: str):
        return {
            "live": self.seq,
            "other": self.other,
            "freed": self.freed,
            "foreign": self.foreign,
            "wrong": "x",
        }[which]

    def kv_cache(self, which: str):
        return {"float": self.cache, "int8": self.int8_cache, "wrong": self.pool}[which]

    def closed(self):
        self.batch = None


def entry(*args, extra=(), after=None, **kwargs):
    """A fuzz entry: positional and keyword argument strategies (strategies given as a
    function of the Env are resolved through it), other exceptions it may raise (OSError
    for files), and what to do after the call."""
    return (args, kwargs, tuple(extra), after)


def env_arg(resolve, strategy):
    """An argument drawn from `strategy` and resolved through the Env by `resolve`."""
    return ("env", resolve, strategy)


SEQS_ARG = env_arg(Env.seqs, SEQS)
SEQ_ARG = env_arg(Env.one, SEQ)
CACHE_ARG = env_arg(Env.kv_cache, CACHE)
PATH_ARG = env_arg(lambda e, w: e.paths[w], PATH)

ENTRIES: dict[str, dict[str, tuple]] = {
    "KVCache": {
        "advance": entry(I),
        "advance_counter": entry(I),
        "append": entry(I, A, A),
        "append_at_counter": entry(I, A, A),
        "attention": entry(I, A, window=OPT_I, **ATTN),
        "clear": entry(),
        "extract_block": entry(I, I, I),
        "get": entry(I, dequantize=B),
        "gpu_counter_ptr": entry(),
        "inject_block": entry(I, I, I, A, A),
        "keys_for": entry(I, I, OPT_I),
        "layer_len": entry(I),
        "memory_bytes": entry(),
        "scales": entry(I),
        "set_seq_len": entry(I),
        "set_stream": entry(OPT_I),
        "store_key": entry(I, I, I, A),
        "store_value": entry(I, I, I, A),
        "sync_counter_from_gpu": entry(),
        "truncate": entry(I),
        "utilization_ratio": entry(),
        "values_for": entry(I, I, OPT_I),
    },
    "BlockPool": {
        "bind_model": entry(mostly(st.one_of(st.text(max_size=4), st.none(), st.binary(max_size=2)))),
        "block_tables": entry(SEQS_ARG, I, OPT_I),
        "check_invariants": entry(),
        "close": entry(),
        "copy_prefix": entry(SEQ_ARG, SEQ_ARG, I),
        "drain_events": entry(),
        "drop_tier_namespace": entry(KEY),
        "evict_all": entry(),
        "flush_tiers": entry(),
        "keep": entry(SEQS_ARG),
        "kv_cache": entry(I),
        "kv_cache_parts": entry(I),
        "layer_group": entry(I),
        "load_prefix_cache": entry(PATH_ARG, extra=[OSError]),
        "match_prefix": entry(L, KEY, KEY),
        "new_sequence": entry(OPT_L, KEY, KEY, after=lambda s: s.free()),
        "pack_states": entry(SEQS_ARG),
        "page_table": entry(SEQS_ARG, OPT_I),
        "pin": entry(L, KEY, KEY),
        "prefetch": entry(L, KEY, KEY, B),
        "reserve": entry(SEQS_ARG, L),
        "save_prefix_cache": entry(PATH_ARG, extra=[OSError]),
        "scale_cache": entry(I),
        "set_stream": entry(OPT_I),
        "start_forward": entry(SEQS_ARG, OPT_L, OPT_L, draft=B, after=lambda b: b.cancel()),
        "state_cache": entry(I),
        "stats": entry(),
        "store_to_tiers": entry(SEQS_ARG),
        "unpin": entry(L, KEY, KEY),
        "write": entry(I, A, A, L),
        "write_layers": entry(A4, A4, L),
    },
    "Sequence": {
        "accept": entry(I, L),
        "advance": entry(I, OPT_L),
        "append": entry(I, A, A),
        "attention": entry(I, A, **ATTN),
        "can_resume": entry(I),
        "checkpoint": entry(),
        "copy_from_cache": entry(CACHE_ARG),
        "copy_to_cache": entry(CACHE_ARG),
        "extract_block": entry(I, I, I),
        "fork": entry(after=lambda s: s.free()),
        "free": entry(),
        "get": entry(I, OUT_PAIR, dequantize=B),
        "inject_block": entry(I, I, I, A, A),
        "layer_blocks": entry(I),
        "layer_len": entry(I),
        "layer_start": entry(I),
        "memory_bytes": entry(),
        "remove": entry(I, OPT_I),
        "scales": entry(I),
        "set_seq_len": entry(I),
        "shift": entry(I, OPT_I, I),
        "state": entry(I),
        "truncate": entry(I),
        "views": entry(I),
    },
    "ForwardBatch": {
        "attention": entry(I, A, **ATTN, custom_mask=MASK, packed_custom_mask=MASK),
        "cancel": entry(after=Env.closed),
        "finish": entry(after=Env.closed),
        "get": entry(I, custom_mask=MASK, packed_custom_mask=MASK),
        "history_len": entry(I),
        "put": entry(I, A, A),
        "put_layers": entry(A4, A4),
    },
    "EncoderCache": {
        "attention": entry(I, A, **ATTN),
        "clear": entry(),
        "get": entry(I, dequantize=B),
        "is_set": entry(I),
        "memory_bytes": entry(),
        "scales": entry(I),
        "set": entry(I, A, A),
    },
    "RoPE": {"apply": entry(A, L)},
    "HostTier": {
        "get": entry(st.one_of(st.lists(st.text(max_size=4), max_size=3), wrong)),
        "stats": entry(),
        "used_bytes": entry(),
    },
    "DiskTier": {
        "get": entry(st.one_of(st.lists(st.sampled_from(["a", "../x", "", "a/b", "\0"]), max_size=3), wrong)),
        "stats": entry(),
        "used_bytes": entry(),
    },
    "RedisTier": {"get": entry(st.just([])), "stats": entry()},
    "PageStore": {
        "put_many": entry(PAGE_KEYS, PAGES, NS),
        "get_into": entry(PAGE_KEYS, PAGES, NS),
        "exists_prefix": entry(PAGE_KEYS, NS),
        "exists_many": entry(PAGE_KEYS, NS),
        "drop_namespace": entry(mostly(st.one_of(st.text(max_size=3), st.none()))),
        "stats": entry(),
        "tier_key": entry(mostly(st.text(max_size=4)), NS),
    },
    "SuffixIndex": {
        "add": entry(L, namespace=KEY, extra_key=KEY),
        "extend": entry(I, L, extra=(KeyError,)),
        "remove": entry(I, extra=(KeyError,)),
        "tokens": entry(I, extra=(KeyError,)),
        "handles": entry(),
        "speculate": entry(
            L,
            namespace=KEY,
            extra_key=KEY,
            max_tokens=I,
            max_spec_factor=F,
            max_spec_offset=F,
            min_token_prob=F,
        ),
        "clear": entry(),
        "stats": entry(),
    },
}


def public_methods(cls) -> set[str]:
    """Public names of `cls` that are methods (not properties)."""
    return {n for n in dir(cls) if not n.startswith("_") and not inspect.isdatadescriptor(getattr(cls, n))}


def test_every_public_method_has_a_fuzz_entry():
    for name, entries in ENTRIES.items():
        assert public_methods(getattr(kvrs, name)) == set(entries), name
    classes = {
        n
        for n, c in vars(kvrs).items()
        if isinstance(c, type) and not issubclass(c, BaseException) and n[0] != "_"
    }
    # DeviceTensor is made only by CUDA caches: none exists on a host. HostArray is NumPy's
    # ndarray plus a DLPack export (tests/python/test_edges.py).
    assert classes - {"DeviceTensor", "HostArray"} == set(ENTRIES), classes


def read_everything(obj) -> None:
    """Reads every property of `obj` and its repr; only documented errors may come out."""
    for n in dir(type(obj)):
        if not n.startswith("_") and inspect.isdatadescriptor(getattr(type(obj), n)):
            checked(f"{type(obj).__name__}.{n}", getattr, obj, n)
    checked(f"repr({type(obj).__name__})", repr, obj)


def checked(what: str, fn, *args, extra=(), **kwargs):
    """Calls `fn(*args, **kwargs)`; an exception that is not documented (a PanicException
    above all) fails the test with the call that raised it."""
    try:
        return fn(*args, **kwargs)
    except (*ALLOWED, *extra):
        return None
    except BaseException as e:
        raise AssertionError(f"{what} raised {type(e).__module__}.{type(e).__name__}: {e}") from e


def draw_args(data, env, strategies):
    out = []
    for s in strategies:
        if isinstance(s, tuple) and s[0] == "env":
            out.append(s[1](env, data.draw(s[2])))
        else:
            out.append(data.draw(s))
    return out


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(data=st.data(), dtype=st.sampled_from(["float32", "float16", "int8", "fp8_e4m3"]))
def test_every_method_with_extreme_arguments(fuzz_dir, data, dtype):
    env = Env(fuzz_dir, dtype)
    for _ in range(data.draw(st.integers(1, 10))):
        cls = data.draw(st.sampled_from(sorted(ENTRIES)))
        name = data.draw(st.sampled_from(sorted(ENTRIES[cls])))
        obj = {
            "KVCache": env.cache if data.draw(st.booleans()) else env.int8_cache,
            "BlockPool": env.pool,
            "Sequence": env.seq,
            "ForwardBatch": env.batch,
            "EncoderCache": env.enc,
            "RoPE": env.rope,
            "HostTier": env.tiers[0],
            "DiskTier": env.tiers[1],
            "RedisTier": env.tiers[2],
            "PageStore": env.pages,
            "SuffixIndex": env.suffix,
        }[cls]
        if obj is None:
            continue
        pos, kw, extra, after = ENTRIES[cls][name]
        args = draw_args(data, env, pos)
        kwargs = dict(zip(kw, draw_args(data, env, kw.values()), strict=True))
        what = f"{cls}.{name}(*{args!r}, **{kwargs!r})"
        result = checked(what, getattr(obj, name), *args, extra=extra, **kwargs)
        if after is Env.closed:
            env.closed()
        elif after is not None and result is not None:
            checked(f"after {what}", after, result)
        env.pool.check_invariants()
        objects = (
            env.pool,
            env.seq,
            env.batch,
            env.cache,
            env.int8_cache,
            env.enc,
            env.rope,
            env.pages,
            env.suffix,
        )
        for o in (*objects, *env.tiers):
            if o is not None:
                read_everything(o)
        env.refresh()
    env.pool.check_invariants()


SMALL = st.one_of(st.integers(-2, 6), wrong)  # sizes that allocate little, in process
DTYPES = pick(
    ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "fp32", "half", "bf16", "float64"]
    + ["int4", "", np.float16, np.float64, np.dtype(">f4"), ml_dtypes.bfloat16, None, 3, object()]
)
DEVICES = st.sampled_from(
    ["cpu", "CPU", "cuda", "cuda:7", "cuda:-1", "cuda:99999999999999999999", "tpu", "", None, 0]
)
SCALES = st.one_of(
    st.none(),
    F,
    st.lists(st.sampled_from(EXTREME_FLOATS), max_size=3),
    pick([np.ones((2, 2)), np.ones((3, 3)), np.ones(0), np.full(2, np.nan), np.ones((2, 2, 2))]),
)
SIZE_TEXT = st.sampled_from(
    [
        "1KiB",
        "64KiB",
        "-1",
        "1e309",
        "NaN",
        "inf",
        "10QB",
        "1.5",
        "",
        "0x10",
        "99999999999999999999999GiB",
        " 1 MiB ",
    ]
)
MEMORY = st.one_of(st.none(), st.integers(-2, 4096), SIZE_TEXT, wrong)
ROPES = st.one_of(
    st.none(),
    pick([kvrs.RoPE(), kvrs.RoPE(rotary_dim=1000), kvrs.RoPE(theta=1.5, style="gptj")]),
    wrong,
)
LAYER_TYPES = st.one_of(
    st.none(), st.lists(st.sampled_from(["full", "sliding", "chunked", "x"]), max_size=4), wrong
)
TIERS = st.one_of(st.none(), st.just([]), st.builds(lambda: [kvrs.HostTier(1 << 16)]), st.just(["x"]), wrong)
URLS = st.sampled_from(
    ["redis://127.0.0.1:1/0", "redis://u:p@h:1", "", "http://x", "redis://[::1", "a\0b", "redis://h:99999"]
)


def constructors(d, tmp: Path) -> dict:
    """One call of each constructor with arguments drawn by `d` (sizes kept small: the
    huge ones run in a limited child, below)."""

    def contiguous(cls):
        return lambda: cls(
            d(SMALL),
            d(SMALL),
            d(SMALL),
            d(SMALL),
            dtype=d(DTYPES),
            device=d(DEVICES),
            k_scale=d(SCALES),
            v_scale=d(SCALES),
        )

    return {
        "KVCache": contiguous(kvrs.KVCache),
        "EncoderCache": contiguous(kvrs.EncoderCache),
        "BlockPool": lambda: kvrs.BlockPool(
            d(SMALL),
            d(SMALL),
            d(SMALL),
            block_size=d(SMALL),
            num_blocks=d(st.one_of(st.none(), SMALL)),
            memory_bytes=d(MEMORY),
            dtype=d(DTYPES),
            device=d(DEVICES),
            layout=d(st.one_of(st.sampled_from(["NHD", "HND", "nhd", "x"]), wrong)),
            prefix_caching=d(B),
            hash=d(st.one_of(st.sampled_from(["blake3", "xxh3", "md5"]), wrong)),
            seed=d(
                st.one_of(
                    st.none(), st.integers(-1, 3), st.sampled_from([2**128 - 1, 2**128, -(2**127)]), wrong
                )
            ),
            partial_hits=d(B),
            events=d(B),
            rope=d(ROPES),
            layer_types=d(LAYER_TYPES),
            sliding_window=d(OPT_I),
            chunk_size=d(OPT_I),
            swa_memory=d(I),
            k_scale=d(SCALES),
            v_scale=d(SCALES),
            tiers=d(TIERS),
            model_id=d(st.one_of(st.text(max_size=4), wrong)),
            tier_queue=d(
                st.one_of(st.integers(-1, 4), st.sampled_from([2**20, 2**20 + 1, 2**62, 2**64]), wrong)
            ),
            tier_write=d(st.one_of(st.sampled_from(["first", "all", "x"]), wrong)),
        ),
        "RoPE": lambda: kvrs.RoPE(
            theta=d(F),
            rotary_dim=d(OPT_I),
            style=d(st.one_of(st.sampled_from(["neox", "gptj", "x"]), wrong)),
            scaling=d(
                st.one_of(
                    st.none(), st.tuples(st.sampled_from(["linear", "ntk"]), F), st.just(("linear",)), wrong
                )
            ),
        ),
        "HostTier": lambda: kvrs.HostTier(d(st.one_of(I, SIZE_TEXT))),
        "DiskTier": lambda: kvrs.DiskTier(
            d(st.one_of(st.sampled_from([str(tmp / "d"), str(tmp / "f"), "", "a\0b"]), wrong)),
            d(st.one_of(I, SIZE_TEXT)),
        ),
        "RedisTier": lambda: kvrs.RedisTier(
            d(st.one_of(URLS, wrong)), timeout=d(F), ttl=d(OPT_I), max_idle=d(I), retry_after=d(F)
        ),
        "PageStore": lambda: kvrs.PageStore(
            d(st.one_of(TIERS, wrong)),
            fingerprint=d(
                st.one_of(st.dictionaries(st.text(max_size=3), st.one_of(I, st.text(max_size=3))), wrong)
            ),
            tier_key=d(st.one_of(st.none(), st.binary(max_size=20), wrong)),
            write=d(st.one_of(st.sampled_from(["all", "first", "x"]), wrong)),
        ),
        "SuffixIndex": lambda: kvrs.SuffixIndex(
            max_tokens=d(st.one_of(SMALL, I)), max_depth=d(st.one_of(SMALL, I))
        ),
        "Sequence": lambda: kvrs.Sequence(*d(st.lists(I, max_size=2))),
        "ForwardBatch": lambda: kvrs.ForwardBatch(*d(st.lists(I, max_size=2))),
    }


def test_every_class_has_its_constructor_fuzzed(tmp_path):
    assert set(constructors(None, tmp_path)) == set(ENTRIES)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_constructors_with_extreme_arguments(fuzz_dir, data):
    (fuzz_dir / "f").write_bytes(b"a file, not a directory")
    name = data.draw(st.sampled_from(sorted(ENTRIES)))
    made = checked(
        f"{name}(...)",
        constructors(data.draw, fuzz_dir)[name],
        extra=(OSError,) if name == "DiskTier" else (),
    )
    if made is not None:
        read_everything(made)


# Huge sizes run in a child under an address-space limit: a refused allocation must be a
# MemoryError, and a crash (an abort) fails this test instead of killing pytest. Every
# size is 0, 1, 3 or 2**31 and more, so each call allocates a few bytes or is refused.
HUGE_CHILD = """
import itertools, math, random, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
import kvrs
ALLOWED = (ValueError, IndexError, TypeError, OverflowError, MemoryError, kvrs.KvrsError)
SIZES = [0, 1, 3, 2**31, 2**32, 2**40, 2**62, 2**63 - 1]
calls = []
for i, (a, b, c, e) in enumerate(itertools.product(SIZES, repeat=4)):
    dtype = ("float32", "int8", "fp8_e4m3")[i % 3]
    calls += [
        f"kvrs.KVCache({a}, {b}, {c}, {e}, dtype='{dtype}')",
        f"kvrs.EncoderCache({a}, {b}, {c}, {e}, dtype='{dtype}')",
        f"kvrs.BlockPool({a}, {b}, {c}, block_size={e}, num_blocks=3, dtype='{dtype}')",
        f"kvrs.BlockPool({a}, {b}, {c}, block_size=1, num_blocks={e}, dtype='{dtype}')",
        f"kvrs.BlockPool({a}, {b}, {c}, block_size=3, memory_bytes={e}, dtype='{dtype}')",
    ]
for s in SIZES:
    calls += [
        f"kvrs.BlockPool(3, 1, 4, num_blocks=4, layer_types=['full', 'sliding', 'chunked'], "
        f"sliding_window={s or 1}, chunk_size={s or 1}, swa_memory={s})",
        f"kvrs.BlockPool(1, 1, 4, num_blocks=4, seed=1, tiers=[kvrs.HostTier({s or 1})], model_id='m', "
        f"tier_queue={s})",
        f"kvrs.BlockPool(1, 1, 4, memory_bytes='{s}GiB')",
        f"kvrs.BlockPool(1, 1, 4, num_blocks=3, k_scale=[1.0] * 3)",
        f"kvrs.HostTier({s})",
        f"kvrs.RedisTier(max_idle={s})",
        f"kvrs.RedisTier(ttl={s})",
        f"kvrs.RedisTier(timeout={float(s)})",
        f"kvrs.RedisTier(retry_after={float(s)})",
        f"kvrs.RoPE(rotary_dim={s}).apply([[1.0, 2.0]], [{s}])",
    ]
for t in (1e308, 1.8e19, 1e-320, math.nan, -math.inf):
    calls += [f"kvrs.RedisTier(timeout=float('{t}'))", f"kvrs.RedisTier(retry_after=float('{t}'))"]
bad = 0
for call in calls:
    sys.stderr.write(call + "\\n")
    sys.stderr.flush()
    try:
        eval(call)
    except ALLOWED:
        pass
    except BaseException as e:
        bad += 1
        print(f"{call} raised {type(e).__module__}.{type(e).__name__}: {e}")
print(f"{len(calls)} calls, {bad} bad")
"""


def test_constructors_with_huge_sizes_in_a_limited_child():
    child = subprocess.run(
        [sys.executable, "-c", HUGE_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    last = [line for line in child.stderr.splitlines() if line.startswith("kvrs.")][-1:]
    assert child.returncode == 0, f"the child died ({child.returncode}) in {last}:\n{child.stderr[-2000:]}"
    assert child.stdout.strip().endswith(" 0 bad"), child.stdout

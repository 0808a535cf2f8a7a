"""Prefix-cache files you can trust: a file loads only if the pool's seed signed it and
every block in it is what its hash says.

Crafted files are built from genuine ones by parsing the safetensors layout by hand
(8-byte little-endian header length, JSON header, data) and signed again three ways:
with the unkeyed BLAKE3 checksum of format version 1 (what any writer can compute),
with a key derived from another seed, and with this pool's seed (the key: then only
the file's own consistency checks stand between the forgery and the cache).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from blake3_ref import blake3, derive_key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvrs

L, H, D, BS = 2, 2, 4, 4
SEED = 0x0123456789ABCDEF_FEDCBA9876543210
MAC_CONTEXT = "kvrs prefix-cache file MAC v2"
A = list(range(1, 11))  # blocks [1..4] and [5..8] fill; [9, 10] does not
B = [1, 2, 3, 4, 50, 51, 52, 53, 54]


def pool(seed=SEED, num_blocks=32, **kw):
    return kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=num_blocks, dtype="float32", seed=seed, **kw)


def kv_of(tokens, start, n):
    """K/V that depend on the token prefix, as a model's would ([n, H, D])."""
    out = np.empty((n, H, D), np.float32)
    for i, p in enumerate(range(start, start + n)):
        seed = hash(tuple(int(t) for t in tokens[: p + 1])) % (2**32)
        out[i] = np.random.default_rng(seed).integers(-32, 33, (H, D)) / 4
    return out


def serve(p, tokens, **kw):
    """Starts a sequence from `tokens`, computes what the cache lacks, commits it, frees it."""
    seq = p.new_sequence(tokens=tokens, **kw)
    start = seq.num_cached_tokens
    k = kv_of(tokens, start, len(tokens) - start)
    for layer in range(L):
        seq.append(layer, k, -k)
    seq.advance(len(tokens) - start)  # the sequence knows its ids: full blocks are cached
    seq.free()


class StFile:
    """A safetensors file, parsed: metadata and tensors (dtype, shape, bytes) by name."""

    def __init__(self, raw: bytes):
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        self.meta: dict[str, str] = header.pop("__metadata__", {})
        data = raw[8 + n :]
        self.tensors: dict[str, tuple[str, list[int], bytes]] = {
            name: (
                info["dtype"],
                list(info["shape"]),
                data[info["data_offsets"][0] : info["data_offsets"][1]],
            )
            for name, info in header.items()
        }

    def to_bytes(self) -> bytes:
        header: dict[str, object] = {"__metadata__": self.meta}
        offset = 0
        for name in sorted(self.tensors):
            dtype, shape, data = self.tensors[name]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
            offset += len(data)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        return (
            len(text).to_bytes(8, "little")
            + text
            + b"".join(self.tensors[n][2] for n in sorted(self.tensors))
        )

    def per_block(self) -> list[str]:
        """Tensors with one row per block."""
        return [n for n in self.tensors if n not in ("extras", "extra_offsets")]

    def row(self, name: str, i: int) -> bytes:
        _, shape, data = self.tensors[name]
        size = len(data) // shape[0]
        return data[i * size : (i + 1) * size]

    def set_row(self, name: str, i: int, value: bytes) -> None:
        dtype, shape, data = self.tensors[name]
        size = len(data) // shape[0]
        assert len(value) == size
        self.tensors[name] = (dtype, shape, data[: i * size] + value + data[(i + 1) * size :])

    def append_row(self, name: str, value: bytes) -> None:
        dtype, shape, data = self.tensors[name]
        self.tensors[name] = (dtype, [shape[0] + 1, *shape[1:]], data + value)

    @property
    def blocks(self) -> int:
        return int(self.meta["num_blocks"])


def _part(b: bytes) -> bytes:
    return len(b).to_bytes(8, "little") + b


def mac_input(f: StFile) -> bytes:
    """What format version 2's MAC covers: metadata but the MAC, then every tensor's name,
    shape and bytes, each part length-prefixed, in name order."""
    entries = sorted((k, v) for k, v in f.meta.items() if k != "mac")
    out = _part(b"kvrs prefix-cache v2") + len(entries).to_bytes(8, "little")
    out += b"".join(_part(k.encode()) + _part(v.encode()) for k, v in entries)
    out += len(f.tensors).to_bytes(8, "little")
    for name in sorted(f.tensors):
        _, shape, data = f.tensors[name]
        out += _part(name.encode()) + len(shape).to_bytes(8, "little")
        out += b"".join(d.to_bytes(8, "little") for d in shape) + _part(data)
    return out


def v1_checksum(f: StFile) -> str:
    """Format version 1's unkeyed checksum: BLAKE3 of every tensor's name and bytes."""
    return blake3(b"".join(_part(n.encode()) + _part(f.tensors[n][2]) for n in sorted(f.tensors))).hex()


def key_of(seed: int) -> bytes:
    return derive_key(MAC_CONTEXT, seed.to_bytes(16, "little"))


SCHEMES = ("unkeyed", "wrong_key", "right_key")


def resign(f: StFile, scheme: str) -> None:
    """Signs `f` again: a version 1 checksum as version 1 computes it, and a version 2 MAC
    unkeyed, keyed from another seed, or keyed from this pool's seed."""
    if "checksum" in f.meta:
        f.meta["checksum"] = v1_checksum(f)
    if "mac" in f.meta:
        key = {"unkeyed": None, "wrong_key": key_of(SEED + 1), "right_key": key_of(SEED)}[scheme]
        f.meta["mac"] = blake3(mac_input(f), key).hex()


def saved(directory: Path, *prompts, **kw) -> Path:
    p = pool(**kw)
    for t in prompts or (A, B):
        serve(p, t)
    path = directory / "cache.safetensors"
    p.save_prefix_cache(path)
    return path


def forged(directory: Path, mutate, scheme: str) -> Path:
    path = saved(directory)
    f = StFile(path.read_bytes())
    mutate(f)
    resign(f, scheme)
    out = directory / "forged.safetensors"
    out.write_bytes(f.to_bytes())
    return out


def assert_refused(path: Path, match: str) -> kvrs.BlockPool:
    """Loading `path` raises ValueError and leaves a fresh pool exactly as it was."""
    target = pool()
    before = target.stats()
    with pytest.raises(ValueError, match=match):
        target.load_prefix_cache(path)
    assert target.stats() == before
    assert target.stats()["free_blocks"] == 32
    target.check_invariants()
    return target


REFUSED_BY = {"unkeyed": "MAC mismatch", "wrong_key": "MAC mismatch"}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_duplicated_block_is_refused_before_anything_loads(tmp_path, scheme):
    def duplicate(f: StFile) -> None:
        for name in f.per_block():
            f.append_row(name, f.row(name, 0))
        f.meta["num_blocks"] = str(f.blocks + 1)

    target = assert_refused(forged(tmp_path, duplicate, scheme), REFUSED_BY.get(scheme, "same hash"))
    assert target.match_prefix(A) == 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_changed_tokens_with_their_hash_kept_are_refused(tmp_path, scheme):
    def retoken(f: StFile) -> None:
        f.set_row("tokens", 0, np.arange(100, 100 + BS, dtype="<u4").tobytes())

    path = forged(tmp_path, retoken, scheme)
    target = assert_refused(path, REFUSED_BY.get(scheme, "not the hash of its parent, tokens and extra key"))
    assert target.match_prefix([100, 101, 102, 103, 5]) == 0


def test_forged_kv_is_refused_unless_signed_with_the_seed(tmp_path):
    def poison(f: StFile) -> None:
        f.set_row("kv.0", 0, np.full(len(f.row("kv.0", 0)) // 4, 666.0, "<f4").tobytes())

    for scheme in ("unkeyed", "wrong_key"):
        assert_refused(forged(tmp_path, poison, scheme), "MAC mismatch")
    # The seed is the key: whoever holds it can sign any K/V (keep seeds secret).
    holder = pool()
    assert holder.load_prefix_cache(forged(tmp_path, poison, "right_key"))["loaded"] == 3
    K, _ = holder.new_sequence(tokens=A).get(0)
    assert (K == 666.0).any()


def test_the_file_holds_no_seed(tmp_path):
    raw = saved(tmp_path).read_bytes()
    for form in (f"{SEED:032x}", f"{SEED:x}", f"{SEED:X}", str(SEED)):
        assert form.encode() not in raw
    for order in ("little", "big"):
        assert SEED.to_bytes(16, order) not in raw
    meta = StFile(raw).meta
    assert "seed" not in meta and re.fullmatch("[0-9a-f]{16}", meta["seed_id"])


def test_another_seed_is_named_by_its_seed_id(tmp_path):
    path = saved(tmp_path)
    other = pool(seed=SEED + 1)
    with pytest.raises(
        ValueError, match=r"another seed \(seed id '[0-9a-f]{16}'.*seed=<that pool's pool\.seed"
    ):
        other.load_prefix_cache(path)
    assert other.stats()["cached_blocks"] == 0
    with pytest.raises(ValueError) as refused:
        other.load_prefix_cache(path)
    assert "Some(" not in str(refused.value)
    # The seed as the hex string of the writing pool's `pool.seed` loads the file.
    for spelling in (f"{SEED:x}", f"0x{SEED:032X}"):
        same = pool(seed=spelling)
        assert same.seed == SEED
        assert same.load_prefix_cache(path)["loaded"] > 0


def test_version_1_files_are_refused_with_a_clear_message(tmp_path):
    f = StFile(saved(tmp_path).read_bytes())
    for name in ("extra_index", "extras", "extra_offsets"):
        del f.tensors[name]
    del f.meta["seed_id"], f.meta["mac"]
    f.meta.update(version="1", seed=f"{SEED:032x}", checksum="")
    f.meta["checksum"] = v1_checksum(f)
    path = tmp_path / "v1.safetensors"
    path.write_bytes(f.to_bytes())
    assert_refused(path, "format version 1.*save the cache again")


def test_a_file_loads_only_into_a_pool_of_its_model_id(tmp_path):
    # The review's reproduction: model-b's prompts hit model-a's K/V, same seed and shape.
    path = saved(tmp_path, model_id="model-a")
    assert StFile(path.read_bytes()).meta["model_id"] == "model-a"
    for model_id, written in (("model-b", '"model-a"'), ("", '"model-a"')):
        other = pool(model_id=model_id)
        before = other.stats()
        message = f'model_id {written}, this pool\'s model_id is "{model_id}"; .*same model_id'
        with pytest.raises(ValueError, match=message):
            other.load_prefix_cache(path)
        assert other.stats() == before
        assert other.match_prefix(A) == 0
        other.check_invariants()
    same = pool(model_id="model-a")
    assert same.load_prefix_cache(path) == {"loaded": 3, "skipped": 0}
    assert same.match_prefix(A) == 8


def test_a_pool_without_model_id_takes_only_files_without_one(tmp_path):
    path = saved(tmp_path)
    assert StFile(path.read_bytes()).meta["model_id"] == ""
    with pytest.raises(ValueError, match=r"model_id \"\", this pool's model_id is \"model-a\""):
        pool(model_id="model-a").load_prefix_cache(path)
    assert pool().load_prefix_cache(path)["loaded"] == 3
    # Tiers name the model the same way.
    tiered = pool(model_id="m", tiers=[kvrs.HostTier(1 << 20)])
    serve(tiered, A)
    tiered.save_prefix_cache(path)
    assert StFile(path.read_bytes()).meta["model_id"] == "m"
    assert pool(model_id="m").load_prefix_cache(path)["loaded"] == 2


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_changed_model_id_is_refused_unless_signed_with_the_seed(tmp_path, scheme):
    def relabel(f: StFile) -> None:
        f.meta["model_id"] = "model-b"

    path = saved(tmp_path, model_id="model-a")
    f = StFile(path.read_bytes())
    relabel(f)
    resign(f, scheme)
    path.write_bytes(f.to_bytes())
    target = pool(model_id="model-b")
    if scheme in REFUSED_BY:
        with pytest.raises(ValueError, match="MAC mismatch"):
            target.load_prefix_cache(path)
        assert target.stats()["cached_blocks"] == 0
    else:
        # The seed is the key: its holder vouches for the model too.
        assert target.load_prefix_cache(path)["loaded"] == 3
    # A file without the entry (as saved before files recorded it) is refused.
    del f.meta["model_id"]
    resign(f, "right_key")
    path.write_bytes(f.to_bytes())
    with pytest.raises(ValueError, match=r"this file records no model_id, this pool's model_id is \"\""):
        pool().load_prefix_cache(path)


LAYER_TYPES = {"full": None, "sliding": ["full", "sliding"]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
            st.sampled_from([None, "lora-1", b"\x00lora-2"]),
            st.sampled_from([None, "tenant-a"]),
        ),
        min_size=1,
        max_size=6,
    ),
    layers=st.sampled_from(sorted(LAYER_TYPES)),
)
def test_a_genuine_file_round_trips(prompts, layers):
    kw = {"num_blocks": 64}
    if LAYER_TYPES[layers]:
        kw.update(layer_types=LAYER_TYPES[layers], sliding_window=64)
    here = pool(**kw)
    for tokens, extra, ns in prompts:
        serve(here, tokens, extra_key=extra, namespace=ns)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.safetensors"
        n = here.save_prefix_cache(path)
        f = StFile(path.read_bytes())
        there = pool(**kw)
        assert there.load_prefix_cache(path) == {"loaded": n, "skipped": 0}
        again = Path(d) / "again.safetensors"
        there.save_prefix_cache(again)
        assert sorted(StFile(again.read_bytes()).row("hashes", i) for i in range(n)) == sorted(
            f.row("hashes", i) for i in range(n)
        )
    there.check_invariants()
    assert f.meta["version"] == "2"
    used = {e.encode() if isinstance(e, str) else e for t, e, _ in prompts if e and len(t) >= BS}
    assert used <= {f.tensors["extras"][2][a:b] for a, b in zip(*_offsets(f), strict=True)}
    for tokens, extra, ns in prompts:
        probe = [*tokens, 9]
        for e in {extra, "lora-3"}:
            assert there.match_prefix(probe, extra_key=e, namespace=ns) == here.match_prefix(
                probe, extra_key=e, namespace=ns
            )
        a, b = (p.new_sequence(tokens=probe, extra_key=extra, namespace=ns) for p in (here, there))
        assert a.num_cached_tokens == b.num_cached_tokens
        for layer in range(L):
            for x, y in zip(a.get(layer), b.get(layer), strict=True):
                assert x.tobytes() == y.tobytes()
        a.free()
        b.free()


def _offsets(f: StFile) -> tuple[list[int], list[int]]:
    ends = np.frombuffer(f.tensors["extra_offsets"][2], "<u8").tolist()
    return ends[:-1], ends[1:]


def test_extra_keys_and_namespaces_survive_a_round_trip(tmp_path):
    here = pool()
    serve(here, A, extra_key="lora-1")
    serve(here, B, namespace="tenant-a")
    path = tmp_path / "c.safetensors"
    assert here.save_prefix_cache(path) == 4
    there = pool()
    assert there.load_prefix_cache(path) == {"loaded": 4, "skipped": 0}
    assert there.match_prefix(A, extra_key="lora-1") == 8
    assert there.match_prefix(A[:6] + [0], extra_key="lora-1") == 6  # a partial hit
    assert there.match_prefix(A, extra_key="lora-2") == 0
    assert there.match_prefix(A) == 0
    assert there.match_prefix(B, namespace="tenant-a") == 8
    assert there.match_prefix(B) == 0
    assert StFile(path.read_bytes()).tensors["extras"][2] == b"lora-1"


MUTATIONS = (
    "dup",
    "tokens",
    "hash",
    "self-parent",
    "other-parent",
    "first",
    "extra_index",
    "extra_offsets",
    "num_blocks",
    "drop",
    "shape",
    "dtype",
    "metadata",
    "kv",
    "swap",
)


def _mutations(f: StFile, i: int, j: int, value: int) -> dict[str, Callable[[], object]]:
    """Ways to craft a file from `f`: each edits one part (rows i and j, some value)."""
    n = f.blocks

    def dup():
        for name in f.per_block():
            f.append_row(name, f.row(name, i))
        f.meta["num_blocks"] = str(n + 1)

    def parent_is(k):
        return lambda: f.set_row("parents", i, f.row("hashes", k))

    def swap():
        for name in f.per_block():
            a, b = f.row(name, i), f.row(name, j)
            f.set_row(name, i, b)
            f.set_row(name, j, a)

    def shape():
        dtype, s, data = f.tensors["kv.1"]
        f.tensors["kv.1"] = (dtype, [s[0] - 1, *s[1:]], data[: len(data) // s[0] * (s[0] - 1)])

    return {
        "dup": dup,
        "tokens": lambda: f.set_row("tokens", i, np.full(BS, value, "<u4").tobytes()),
        "hash": lambda: f.set_row("hashes", i, value.to_bytes(16, "little")),
        "self-parent": parent_is(i),
        "other-parent": parent_is(j),
        "first": lambda: f.set_row("first", i, bytes([value % 256])),
        "extra_index": lambda: f.set_row("extra_index", i, value.to_bytes(4, "little")),
        "extra_offsets": lambda: f.tensors.update(
            extra_offsets=("U64", [2], (value % 9).to_bytes(8, "little") * 2)
        ),
        "num_blocks": lambda: f.meta.update(num_blocks=str(value % 7)),
        "drop": lambda: f.tensors.pop("extra_index"),
        "shape": shape,
        "dtype": lambda: f.meta.update(dtype="float16"),
        "metadata": lambda: f.meta.update(note="hi"),
        "kv": lambda: f.set_row("kv.0", i, bytes(len(f.row("kv.0", i)))),
        "swap": swap,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(MUTATIONS),
    scheme=st.sampled_from(SCHEMES),
    i=st.integers(0, 2),
    j=st.integers(0, 2),
    value=st.integers(0, 2**32 - 1),
)
def test_crafted_files_are_refused_or_consistent_never_a_crash(kind, scheme, i, j, value):
    with tempfile.TemporaryDirectory() as d:
        path = forged(Path(d), lambda f: _mutations(f, i, j, value)[kind](), scheme)
        target = pool()
        before = target.stats()
        try:
            report = target.load_prefix_cache(path)
        except ValueError:
            assert target.stats() == before
        else:
            # Only this seed signs a file the pool takes, and its blocks are consistent.
            assert scheme == "right_key"
            assert report["loaded"] + report["skipped"] >= 1
        target.check_invariants()

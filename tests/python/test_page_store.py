"""kvrs.PageStore: engine-owned pages sealed in kvrs payloads, in every tier kind; buffers
read and written in place (NumPy, torch through DLPack, bytes-like); every bad payload a
miss; arguments refused by name."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs

SECRET = b"page-store-python-test-secret!!!"
PAGE = 256


def facts(**over):
    fp = {
        "model": "llama-3-8b",
        "kv_dtype": "bfloat16",
        "layout": "page_first",
        "page_bytes": PAGE,
        "tp_rank": 0,
    }
    fp.update(over)
    return fp


def pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def file_of(tier: kvrs.DiskTier, name: str) -> Path:
    *dirs, last = name.removeprefix("kvrs:").split(":")
    return Path(tier.path, *dirs, f"{last}.kvb")


@pytest.fixture
def disk(tmp_path):
    return kvrs.DiskTier(tmp_path / "tier", "64MiB")


def test_pages_round_trip_in_place_and_misses_leave_buffers(disk):
    store = kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET)
    src = pages(4)
    assert store.put_many(["a", "b", "c", "d"], list(src)) == [True] * 4
    out = np.full((5, PAGE), 0xEE, np.uint8)
    assert store.get_into(["a", "b", "x", "d", "c"], list(out)) == [True, True, False, True, True]
    assert (out[[0, 1, 3, 4]] == src[[0, 1, 3, 2]]).all()
    assert (out[2] == 0xEE).all()
    assert store.exists_prefix(["a", "b", "c", "x", "d"]) == 3
    assert store.exists_prefix([]) == 0
    s = store.stats()
    assert (s["puts"], s["stored"], s["hits"], s["hit_bytes"]) == (4, 4, 4, 4 * PAGE)
    assert s["tiers"][0]["name"].startswith("disk:")
    assert store.page_bytes == PAGE and store.fingerprint["model"] == "llama-3-8b"
    assert "PageStore(" in repr(store)


def test_torch_tensors_and_bytes_are_read_in_place():
    torch = pytest.importorskip("torch")
    store = kvrs.PageStore([kvrs.HostTier("1MiB")], fingerprint=facts())
    t = torch.arange(PAGE // 2, dtype=torch.bfloat16)  # 256 bytes
    assert store.put_many(["t", "b"], [t, bytes(range(256))]) == [True, True]
    dst = torch.zeros(PAGE // 2, dtype=torch.bfloat16)
    raw = bytearray(PAGE)
    assert store.get_into(["t", "b"], [dst, raw]) == [True, True]
    assert torch.equal(dst, t) and raw == bytes(range(256))
    # A non-contiguous tensor, a read-only destination, a wrong length: refused by name.
    with pytest.raises(ValueError, match=r"pages\[0\].*contiguous"):
        store.put_many(["x"], [torch.zeros((PAGE // 2, 2), dtype=torch.bfloat16)[:, 0]])
    with pytest.raises(ValueError, match=r"buffers\[0\].*read-only"):
        store.get_into(["t"], [bytes(PAGE)])
    with pytest.raises(ValueError, match=r"buffers.*item 0 of 255 bytes.*page_bytes is 256"):
        store.get_into(["t"], [bytearray(255)])


def test_a_page_loads_straight_into_its_segments(disk):
    """A buffer given as segments (e.g. the K and V runs of a page in an engine's host
    pool) receives the page's bytes in order; a miss or a refused page touches none."""
    store = kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET)
    src = pages(2, seed=3)
    assert store.put_many(["a", "b"], list(src)) == [True, True]
    pool = np.full(4 * PAGE, 0xEE, np.uint8)  # a host pool: each page in runs, apart
    runs = [[pool[0:100], pool[300:356], pool[600:700]], (pool[100:200], pool[400:556])]
    assert store.get_into(["a", "x"], runs) == [True, False]
    assert (np.concatenate(runs[0]) == src[0]).all()
    assert (np.concatenate(runs[1]) == 0xEE).all()
    whole = np.zeros(PAGE, np.uint8)
    assert store.get_into(["b", "a"], [whole, [pool[800:900], pool[100:256]]]) == [True, True]
    assert (whole == src[1]).all() and (np.concatenate([pool[800:900], pool[100:256]]) == src[0]).all()
    with pytest.raises(ValueError, match=r"buffers\[0\] is an empty list of segments"):
        store.get_into(["a"], [[]])
    with pytest.raises(ValueError, match=r"buffers=item 0 of 200 bytes"):
        store.get_into(["a"], [[pool[0:100], pool[100:200]]])
    with pytest.raises(ValueError, match=r"buffers\[0\] shares memory with another of its segments"):
        store.get_into(["a"], [[pool[0:128], pool[64:192]]])
    with pytest.raises(ValueError, match=r"buffers\[1\] shares memory with another key's buffer"):
        store.get_into(["a", "b"], [[pool[0:128], pool[128:256]], pool[200:456]])
    with pytest.raises(TypeError, match=r"buffers\[0\]"):
        store.get_into(["a"], [[pool[0:128], object()]])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 60), st.integers(1, 16)), min_size=1, max_size=3),
        min_size=1,
        max_size=4,
    )
)
def test_segments_sharing_memory_are_refused_exactly_when_they_overlap(layout):
    """The overlap check (sorted by address) against a brute-force one, on random runs of
    one array; the keys miss, so only the check decides."""
    fp = {k: v for k, v in facts().items() if k != "page_bytes"}  # pages of any length
    store = kvrs.PageStore([kvrs.HostTier("1MiB")], fingerprint=fp, tier_key=SECRET)
    pool = np.zeros(80, np.uint8)
    bufs = [[pool[a : a + n] for a, n in key] for key in layout]
    spans = [(a, a + n, i) for i, key in enumerate(layout) for a, n in key]
    overlap = any(
        s1 < e2 and s2 < e1 for x, (s1, e1, _) in enumerate(spans) for (s2, e2, _) in spans[x + 1 :]
    )
    keys = [f"k{i}" for i in range(len(layout))]
    if overlap:
        with pytest.raises(ValueError, match="shares memory"):
            store.get_into(keys, bufs)
    else:
        assert store.get_into(keys, bufs) == [False] * len(layout)


def test_namespaces_models_dtypes_and_secrets_never_share_pages(disk):
    store = kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET)
    src = pages(1)
    assert store.put_many(["k"], [src[0]], namespace="tenant-a") == [True]
    out = np.zeros(PAGE, np.uint8)
    others = [
        (store, "tenant-b"),
        (store, None),
        (kvrs.PageStore([disk], fingerprint=facts(model="qwen-7b"), tier_key=SECRET), "tenant-a"),
        (kvrs.PageStore([disk], fingerprint=facts(kv_dtype="float8_e4m3fn"), tier_key=SECRET), "tenant-a"),
        (kvrs.PageStore([disk], fingerprint=facts(tp_rank=1), tier_key=SECRET), "tenant-a"),
        (kvrs.PageStore([disk], fingerprint=facts(), tier_key=secrets.token_bytes(32)), "tenant-a"),
        (kvrs.PageStore([disk], fingerprint=facts()), "tenant-a"),
    ]
    for other, ns in others:
        assert other.get_into(["k"], [out], namespace=ns) == [False]
        assert other.exists_prefix(["k"], namespace=ns) == 0
    assert not out.any()
    # The facts' order does not matter.
    same = kvrs.PageStore([disk], fingerprint=dict(reversed(list(facts().items()))), tier_key=SECRET)
    assert same.get_into(["k"], [out], namespace="tenant-a") == [True] and (out == src[0]).all()
    assert store.drop_namespace("tenant-a") == 1
    assert store.exists_prefix(["k"], namespace="tenant-a") == 0


@pytest.mark.parametrize("fault", ["flip", "truncate", "forge", "other-model", "swap"])
def test_bad_payloads_on_disk_are_misses_and_discarded(disk, fault):
    store = kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET)
    src = pages(2, seed=1)
    store.put_many(["k", "j"], list(src))
    path = file_of(disk, store.tier_key("k"))
    data = bytearray(path.read_bytes())
    if fault == "flip":
        data[len(data) // 2] ^= 1
    elif fault == "truncate":
        data = data[:-1]
    elif fault == "forge":
        forger = kvrs.PageStore([disk], fingerprint=facts(), tier_key=b"an-attacker-without-the-secret")
        forger.put_many(["k"], [np.zeros(PAGE, np.uint8)])
        data = bytearray(file_of(disk, forger.tier_key("k")).read_bytes())
    elif fault == "other-model":
        other = kvrs.PageStore([disk], fingerprint=facts(model="qwen-7b"), tier_key=SECRET)
        other.put_many(["k"], [np.zeros(PAGE, np.uint8)])
        data = bytearray(file_of(disk, other.tier_key("k")).read_bytes())
    else:  # another key's sealed page under this key's name
        data = bytearray(file_of(disk, store.tier_key("j")).read_bytes())
    path.write_bytes(bytes(data))
    out = np.full(PAGE, 0xEE, np.uint8)
    assert store.get_into(["k"], [out]) == [False]
    assert (out == 0xEE).all(), "a bad payload never reaches the buffer"
    if fault != "truncate":
        assert not path.exists(), "a payload that failed its checks is discarded"
        assert store.stats()["rejected"] == 1
    assert store.exists_prefix(["k"]) == 0
    assert store.get_into(["j"], [out]) == [True] and (out == src[1]).all()


def test_a_failed_store_is_never_visible(tmp_path):
    small = kvrs.DiskTier(tmp_path / "small", 200)  # smaller than one sealed page
    store = kvrs.PageStore([small], fingerprint=facts(), tier_key=SECRET)
    assert store.put_many(["k"], [pages(1)[0]]) == [False]
    assert store.exists_prefix(["k"]) == 0
    assert store.get_into(["k"], [np.zeros(PAGE, np.uint8)]) == [False]
    assert not list(Path(small.path).rglob("*.kvb"))


def test_exists_many_says_per_key_in_any_tier_and_namespace(tmp_path):
    host, disk = kvrs.HostTier("1MiB"), kvrs.DiskTier(tmp_path / "d", "1MiB")
    src = pages(3, seed=5)
    kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET).put_many(["c"], [src[2]], namespace="t")
    both = kvrs.PageStore([host, disk], fingerprint=facts(), tier_key=SECRET, write="first")
    assert both.put_many(["a", "b"], list(src[:2]), namespace="t") == [True, True]
    assert host.used_bytes() > 0 and not disk.get([both.tier_key("a", namespace="t")])[0]
    keys = ["x", "a", "c", "b", "y", "c"]
    assert both.exists_many(keys, namespace="t") == [False, True, True, True, False, True]
    assert both.exists_many(tuple(keys), namespace="u") == [False] * 6
    assert both.exists_many(keys) == [False] * 6
    assert both.exists_many([]) == []
    # Another model's store finds none of them; a file of the wrong length is not a page.
    other = kvrs.PageStore([host, disk], fingerprint=facts(model="other"), tier_key=SECRET)
    assert other.exists_many(["a", "c"], namespace="t") == [False, False]
    file_of(disk, both.tier_key("c", namespace="t")).write_bytes(b"short")
    assert both.exists_many(["c", "a"], namespace="t") == [False, True]


def test_exists_many_refuses_bad_arguments_by_name(disk):
    store = kvrs.PageStore([disk], fingerprint=facts())
    with pytest.raises(TypeError, match="keys must be a list of str, not one str"):
        store.exists_many("abc")
    with pytest.raises(TypeError, match=r"keys\[1\] must be a str"):
        store.exists_many(["a", 1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys must be a list of str, not int"):
        store.exists_many(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="namespace"):
        store.exists_many(["a"], namespace=1)  # type: ignore[arg-type]


def test_a_slower_tiers_hit_is_promoted(tmp_path):
    host, disk = kvrs.HostTier("1MiB"), kvrs.DiskTier(tmp_path / "d", "1MiB")
    kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET).put_many(["k"], [pages(1)[0]])
    both = kvrs.PageStore([host, disk], fingerprint=facts(), tier_key=SECRET, write="first")
    assert host.used_bytes() == 0
    assert both.get_into(["k"], [np.zeros(PAGE, np.uint8)]) == [True]
    assert host.used_bytes() > 0 and both.stats()["promoted"] == 1


def test_redis_tier_pages(redis_url):
    store = kvrs.PageStore([kvrs.RedisTier(redis_url)], fingerprint=facts(), tier_key=SECRET)
    src = pages(3, seed=2)
    ns = secrets.token_hex(4)
    assert store.put_many(["a", "b", "c"], list(src), namespace=ns) == [True] * 3
    out = np.zeros((3, PAGE), np.uint8)
    assert store.get_into(["a", "b", "c"], list(out), namespace=ns) == [True] * 3
    assert (out == src).all()
    assert store.exists_prefix(["a", "b", "z", "c"], namespace=ns) == 2
    assert store.exists_many(["a", "z", "c"], namespace=ns) == [True, False, True]
    # Presence is asked with STRLEN: a value of another length is not a page, and a bad
    # page of the right length is a miss when read, then gone.
    import redis

    client = redis.Redis.from_url(redis_url)
    client.set(store.tier_key("b", namespace=ns), b"short")
    assert store.exists_prefix(["a", "b"], namespace=ns) == 1
    assert store.exists_many(["b", "a"], namespace=ns) == [False, True]
    bad = bytearray(client.get(store.tier_key("c", namespace=ns)))
    bad[-1] ^= 1
    client.set(store.tier_key("c", namespace=ns), bytes(bad))
    assert store.exists_prefix(["c"], namespace=ns) == 1
    assert store.get_into(["c"], [np.zeros(PAGE, np.uint8)], namespace=ns) == [False]
    assert store.exists_prefix(["c"], namespace=ns) == 0
    assert store.drop_namespace(ns) == 2
    assert store.exists_prefix(["a"], namespace=ns) == 0


def test_threads_share_a_store(disk):
    store = kvrs.PageStore([disk], fingerprint=facts(), tier_key=SECRET)
    src = pages(16, seed=3)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            keys = [f"{t}-{i}" for i in range(16)]
            assert store.put_many(keys, list(src)) == [True] * 16
            out = np.zeros((16, PAGE), np.uint8)
            assert store.get_into(keys, list(out)) == [True] * 16
            assert (out == src).all()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_arguments_are_refused_by_name(disk):
    with pytest.raises(TypeError, match="fingerprint must be a dict"):
        kvrs.PageStore([disk], fingerprint=[("model", "m")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fingerprint"):
        kvrs.PageStore([disk], fingerprint={})
    with pytest.raises(TypeError, match=r'fingerprint\["model"\] must be a str'):
        kvrs.PageStore([disk], fingerprint={"model": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="page_bytes"):
        kvrs.PageStore([disk], fingerprint={"page_bytes": "many"})
    with pytest.raises(ValueError, match="tier_key"):
        kvrs.PageStore([disk], fingerprint=facts(), tier_key=b"short")
    with pytest.raises(ValueError, match="tiers"):
        kvrs.PageStore([], fingerprint=facts())
    with pytest.raises(TypeError, match="tiers"):
        kvrs.PageStore(["/tmp"], fingerprint=facts())  # type: ignore[list-item]
    with pytest.raises(ValueError, match="write"):
        kvrs.PageStore([disk], fingerprint=facts(), write="some")  # type: ignore[arg-type]
    store = kvrs.PageStore([disk], fingerprint=facts())
    with pytest.raises(TypeError, match="keys must be a list of str"):
        store.put_many("abc", [b"x"])
    with pytest.raises(TypeError, match=r"keys\[1\] must be a str"):
        store.exists_prefix(["a", 1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="pages has 1 items for 2 keys"):
        store.put_many(["a", "b"], [bytes(PAGE)])
    with pytest.raises(ValueError, match=r"pages.*item 0 of 3 bytes"):
        store.put_many(["a"], [b"abc"])
    with pytest.raises(TypeError, match=r"pages\[0\]"):
        store.put_many(["a"], [object()])
    buf = np.zeros(2 * PAGE, np.uint8)
    with pytest.raises(
        ValueError, match=r"buffers\[1\] shares memory with another key.s buffer \(buffers\[0\]\)"
    ):
        store.get_into(["a", "b"], [buf[:PAGE], buf[:PAGE]])
    with pytest.raises(ValueError, match=r"buffers\[0\].*C-contiguous"):
        store.get_into(["a"], [buf[::2]])

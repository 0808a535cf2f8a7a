"""Many Python threads on one cache and on several caches: results stay exact."""

from __future__ import annotations

import threading

import numpy as np

import kvrs


def run_threads(targets):
    errors = []

    def wrap(fn):
        def inner():
            try:
                fn()
            except BaseException as e:  # surfaced below
                errors.append(e)

        return inner

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_filling_different_layers_of_one_cache():
    layers, heads, dim, steps, chunk = 8, 4, 64, 40, 64
    c = kvrs.KVCache(layers, heads, dim, steps * chunk, dtype="float32")
    data = {
        layer: np.random.default_rng(layer).standard_normal((steps * chunk, heads, dim)).astype(np.float32)
        for layer in range(layers)
    }

    def fill(layer):
        def go():
            for s in range(steps):
                part = data[layer][s * chunk : (s + 1) * chunk]
                assert c.append(layer, part, -part) == s * chunk
                c.get(layer)  # readers interleave with writers

        return go

    run_threads([fill(layer) for layer in range(layers)])
    c.advance(steps * chunk)
    for layer in range(layers):
        K, V = c.get(layer)
        np.testing.assert_array_equal(K, data[layer].transpose(1, 0, 2))
        np.testing.assert_array_equal(V, -data[layer].transpose(1, 0, 2))


def test_threads_racing_for_the_last_positions_of_one_layer():
    # 16 threads each try 10 appends of 3 tokens into 64 positions: exactly 21 succeed.
    c = kvrs.KVCache(1, 2, 8, 64, dtype="float16")
    ok, full = [], []
    lock = threading.Lock()

    def go():
        for _ in range(10):
            try:
                start = c.append(0, np.ones((3, 2, 8), np.float32), np.ones((3, 2, 8), np.float32))
                with lock:
                    ok.append(start)
            except kvrs.CacheFullError:
                with lock:
                    full.append(1)

    run_threads([go] * 16)
    assert sorted(ok) == list(range(0, 63, 3))
    assert len(full) == 160 - 21
    assert c.layer_len(0) == 63


def test_threads_on_separate_caches():
    def go(seed):
        def inner():
            rng = np.random.default_rng(seed)
            c = kvrs.KVCache(2, 2, 32, 512, dtype="bfloat16")
            x = (rng.integers(-64, 64, (512, 2, 32)) / 8).astype(np.float32)
            for layer in range(2):
                c.append(layer, x, x)
            c.advance(512)
            np.testing.assert_array_equal(c.get(1)[0].astype(np.float32), x.transpose(1, 0, 2))

        return inner

    run_threads([go(s) for s in range(8)])


def test_many_threads_driving_sequences_of_one_pool():
    """8 threads, each with its own sequences, appending, forking, truncating and freeing
    concurrently on one pool: contents stay exact and accounting consistent."""
    layers, heads, dim = 4, 4, 64
    pool = kvrs.BlockPool(layers, heads, dim, block_size=16, num_blocks=4096, dtype="float32")

    def worker(seed):
        def go():
            rng = np.random.default_rng(seed)
            for _ in range(10):
                seq = pool.new_sequence()
                n = int(rng.integers(1, 300))
                k = rng.standard_normal((n, heads, dim)).astype(np.float32)
                for layer in range(layers):
                    seq.append(layer, k, -k)
                seq.advance(n)
                child = seq.fork()
                extra = rng.standard_normal((3, heads, dim)).astype(np.float32)
                for layer in range(layers):
                    child.append(layer, extra, extra)
                child.advance(3)
                np.testing.assert_array_equal(seq.get(layers - 1)[0], k.transpose(1, 0, 2))
                np.testing.assert_array_equal(child.get(0)[0][:, n:], extra.transpose(1, 0, 2))
                seq.truncate(n // 2)
                np.testing.assert_array_equal(child.get(1)[1][:, :n], -k.transpose(1, 0, 2))
                seq.free()
                child.free()

        return go

    run_threads([worker(s) for s in range(8)])
    pool.check_invariants()
    assert pool.free_blocks == 4096 and pool.stats()["num_sequences"] == 0

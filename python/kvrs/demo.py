"""The kvrs demo: a small decoder-only transformer (random weights, NumPy) generating text
through a :class:`kvrs.KVCache`, checked against recomputation without a cache.

The model is Llama-shaped: RMSNorm, grouped-query attention with rotary position
embeddings, a SiLU-gated MLP. Prefill appends the whole prompt to every layer; each decode
step appends one token per layer, attends over the zero-copy views from ``cache.get``,
and commits with ``cache.advance``. At the end the same token sequence is run through the
model from scratch, with K/V rounded to the cache's dtype, and every step's logits must
match: the demo exits non-zero if they do not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

import kvrs


@dataclass
class ModelConfig:
    """Sizes of the demo model."""

    vocab: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    mlp: int = 512
    rope_theta: float = 10000.0


class TinyLlama:
    """A Llama-architecture decoder with random weights, in float32 NumPy."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.cfg = cfg

        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.embed = rng.standard_normal((cfg.vocab, cfg.hidden)).astype(np.float32)
        self.wq = [w(cfg.hidden, cfg.heads * cfg.head_dim) for _ in range(cfg.layers)]
        self.wk = [w(cfg.hidden, cfg.kv_heads * cfg.head_dim) for _ in range(cfg.layers)]
        self.wv = [w(cfg.hidden, cfg.kv_heads * cfg.head_dim) for _ in range(cfg.layers)]
        self.wo = [w(cfg.heads * cfg.head_dim, cfg.hidden) for _ in range(cfg.layers)]
        self.w_gate = [w(cfg.hidden, cfg.mlp) for _ in range(cfg.layers)]
        self.w_up = [w(cfg.hidden, cfg.mlp) for _ in range(cfg.layers)]
        self.w_down = [w(cfg.mlp, cfg.hidden) for _ in range(cfg.layers)]
        self.lm_head = w(cfg.hidden, cfg.vocab)
        half = cfg.head_dim // 2
        self.inv_freq = (1.0 / cfg.rope_theta ** (np.arange(half, dtype=np.float32) / half)).astype(
            np.float32
        )

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotates x [n, heads, head_dim] by its positions (NeoX style: halves rotate)."""
        ang = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    @staticmethod
    def rms_norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    def attend(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """GQA: q [n, heads, d] over keys/values [kv_heads, T, d], with mask [n, T] of 0
        (may attend) and -inf."""
        cfg = self.cfg
        group = cfg.heads // cfg.kv_heads
        k = np.repeat(keys.astype(np.float32), group, axis=0)  # [heads, T, d]
        v = np.repeat(values.astype(np.float32), group, axis=0)
        scores = np.einsum("nhd,htd->hnt", q, k) / math.sqrt(cfg.head_dim) + mask[None]
        scores -= scores.max(-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hnt,htd->nhd", p, v)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, kv_for_layer) -> np.ndarray:
        """Runs tokens through the model; `kv_for_layer(layer, k, v)` stores this step's K/V
        ([n, kv_heads, head_dim]) and returns the history (K, V) with the tokens' mask."""
        cfg = self.cfg
        x = self.embed[tokens]
        for layer in range(cfg.layers):
            h = self.rms_norm(x)
            q = self.rope((h @ self.wq[layer]).reshape(-1, cfg.heads, cfg.head_dim), positions)
            k = self.rope((h @ self.wk[layer]).reshape(-1, cfg.kv_heads, cfg.head_dim), positions)
            v = (h @ self.wv[layer]).reshape(-1, cfg.kv_heads, cfg.head_dim)
            keys, values, mask = kv_for_layer(layer, k, v)
            attn = self.attend(q, keys, values, mask)
            x = x + attn.reshape(len(tokens), -1) @ self.wo[layer]
            h = self.rms_norm(x)
            gate = h @ self.w_gate[layer]
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ self.w_up[layer])) @ self.w_down[layer]
        return self.rms_norm(x) @ self.lm_head


def causal_mask(positions: np.ndarray, history: int) -> np.ndarray:
    """0 where a token at `positions[i]` may attend to history position t (t <= its own), else -inf."""
    return np.where(np.arange(history)[None, :] > positions[:, None], -np.inf, 0.0).astype(np.float32)


def generate(model: TinyLlama, cache: kvrs.KVCache, prompt: np.ndarray, new_tokens: int):
    """Greedy generation through the cache; returns the tokens and each step's last logits."""

    positions = np.arange(len(prompt))

    def through_cache(layer, k, v):
        cache.append(layer, k, v)
        keys, values = cache.get(layer)
        return keys, values, causal_mask(positions, keys.shape[1])

    tokens = list(prompt)
    logits = model.forward(prompt, positions, through_cache)
    cache.advance(len(prompt))
    steps = [logits[-1]]
    for _ in range(new_tokens):
        tokens.append(int(steps[-1].argmax()))
        positions = np.array([cache.seq_len])
        logits = model.forward(np.array(tokens[-1:]), positions, through_cache)
        cache.advance(1)
        steps.append(logits[-1])
    return tokens, np.stack(steps)


def recompute(model: TinyLlama, tokens: list[int], prompt_len: int, np_dtype) -> np.ndarray:
    """The same logits without a cache: the whole sequence in one pass, with K/V rounded to
    the storage dtype as the cache rounds them."""

    positions = np.arange(len(tokens))

    def no_cache(layer, k, v):
        keys = k.astype(np_dtype).transpose(1, 0, 2)
        return keys, v.astype(np_dtype).transpose(1, 0, 2), causal_mask(positions, len(tokens))

    logits = model.forward(np.array(tokens), positions, no_cache)
    return logits[prompt_len - 1 :]


def run(prompt_len: int, new_tokens: int, dtype: str, seed: int) -> int:
    """Runs the demo; returns the process exit code (0 when the check passes)."""
    cfg = ModelConfig()
    model = TinyLlama(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    prompt = rng.integers(0, cfg.vocab, prompt_len)
    max_seq_len = prompt_len + new_tokens
    cache = kvrs.KVCache(cfg.layers, cfg.kv_heads, cfg.head_dim, max_seq_len, dtype=dtype)
    print(
        f"model: {cfg.layers} layers, {cfg.heads} query heads, {cfg.kv_heads} KV heads x {cfg.head_dim}, "
        f"vocab {cfg.vocab}, random weights (seed {seed})"
    )
    print(f"cache: {cache!r}")
    print(f"       {cache.memory_bytes() / 2**20:.2f} MiB preallocated for {max_seq_len} positions\n")

    t0 = time.perf_counter()
    tokens, logits = generate(model, cache, prompt, new_tokens)
    elapsed = time.perf_counter() - t0
    print(f"prompt ({prompt_len} tokens): {' '.join(map(str, prompt[:16]))} ...")
    print(f"generated ({new_tokens} tokens): {' '.join(map(str, tokens[prompt_len : prompt_len + 16]))} ...")
    print(
        f"throughput: {(prompt_len + new_tokens) / elapsed:,.0f} tokens/s (NumPy model, prefill + decode)\n"
    )

    print(f"stored: seq_len={cache.seq_len}, utilization {cache.utilization_ratio():.1%}")
    for layer in range(cfg.layers):
        K, V = cache.get(layer)
        print(
            f"  layer {layer}: K {tuple(K.shape)} V {tuple(V.shape)} {K.dtype}, "
            f"|K| mean {np.abs(K.astype(np.float32)).mean():.3f}"
        )

    np_dtype = cache.get(0)[0].dtype
    expected = recompute(model, tokens, prompt_len, np_dtype)
    err = float(np.abs(expected - logits).max())
    tol = 1e-3 * float(np.abs(expected).max())
    same = [int(x) for x in expected.argmax(-1)[:-1]] == tokens[prompt_len:]
    print(
        f"\ncheck against recomputation without a cache: max |logit diff| {err:.2e} (tolerance {tol:.2e}), "
        f"tokens {'identical' if same else 'DIFFER'}"
    )
    if err > tol or not same:
        print("FAILED: cached generation differs from recomputation")
        return 1
    print("OK")
    return 0

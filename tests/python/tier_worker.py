"""One inference process of the shared-prefix tests (run as a script, so each call is a
separate process with its own pool): the demo's model serves one prompt through a
BlockPool whose prefix cache sits on a Redis tier, then greedy-decodes a few tokens.

    python tier_worker.py REDIS_URL OUT.npz [--store] [--cluster]

Writes the prompt's K/V, the generated tokens, how many prompt tokens came from where,
and the same prompt run without any cache (full forward passes) into OUT.npz. With
--store, the sequence's cached blocks go to Redis before the process exits; with
--cluster, REDIS_URL is a seed of a Redis Cluster.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

import kvrs
from kvrs.demo import make_model
from kvrs.integrations.transformers import block_pool_from_config, forward_batch

PROMPT, STEPS, BLOCK = 100, 6, 16


def main(url: str, out: str, store: bool, cluster: bool = False) -> None:
    model = make_model(0, layers=2)
    tier = kvrs.RedisTier(url, timeout=2.0, cluster=cluster)
    pool = block_pool_from_config(
        model.config, num_blocks=64, block_size=BLOCK, seed=2026, model_id="kvrs-demo", tiers=[tier]
    )
    prompt = np.random.default_rng(7).integers(0, model.config.vocab_size, PROMPT).tolist()
    seq = pool.new_sequence(tokens=prompt)
    cached, by_tier = seq.num_cached_tokens, seq.cached_tokens_by_tier
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            todo = tokens[seq.seq_len :]
            with pool.start_forward([seq] * len(todo), tokens=todo) as batch:
                logits = forward_batch(model, batch, todo)
            tokens.append(int(logits[-1].argmax()))
        # The same prompt without any cache: a full forward pass per generated token.
        plain = list(prompt)
        for _ in range(STEPS):
            plain.append(int(model(input_ids=torch.tensor([plain]), use_cache=False).logits[0, -1].argmax()))
    kv = {}
    for layer in range(pool.num_layers):
        k, v = seq.get(layer)
        kv[f"k{layer}"], kv[f"v{layer}"] = np.array(k[:, :PROMPT]), np.array(v[:, :PROMPT])
    if store:
        pool.store_to_tiers([seq])
        pool.flush_tiers()
    np.savez(
        out,
        generated=np.array(tokens[PROMPT:]),
        plain=np.array(plain[PROMPT:]),
        cached=cached,
        by_tier=json.dumps(by_tier),
        stats=json.dumps(pool.stats()["tiers"]),
        **kv,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--store" in sys.argv[3:], "--cluster" in sys.argv[3:])

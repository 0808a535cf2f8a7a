"""One serving process of bench_tiers.py's shared-prefix workload (a separate process per
call): the demo's model serves 16 chat requests that share one 1024-token system prompt
(their questions differ per process) with continuous batching over a BlockPool, with or
without a Redis tier below its prefix cache; at the end the pool's cached blocks go to
the tier, as a process that shuts down would leave them.

    python benches/tier_serve.py REDIS_URL|none PROCESS OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import kvrs
from kvrs.demo import Request, make_model, serve
from kvrs.integrations.transformers import block_pool_from_config


class _Quiet:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kw: object) -> None:
        pass


def main(url: str, process: int, out: str) -> None:
    model = make_model(0, 8)
    vocab = model.config.vocab_size
    system = np.random.default_rng(99).integers(0, vocab, 1024).tolist()  # shared by both processes
    rng = np.random.default_rng(1000 + process)  # each process's own questions
    requests = [
        Request(
            rid=i,
            prompt=system + rng.integers(0, vocab, int(rng.integers(16, 65))).tolist(),
            arrival=2 * i,
            max_new=16,
        )
        for i in range(16)
    ]
    tiers = (
        {} if url == "none" else dict(tiers=[kvrs.RedisTier(url, timeout=5.0)], seed=7, model_id="kvrs-demo")
    )
    pool = block_pool_from_config(model.config, num_blocks=256, block_size=16, **tiers)
    t0 = time.perf_counter()
    serve(model, pool, requests, _Quiet())
    seconds = time.perf_counter() - t0
    if tiers:
        pool.evict_all()
        pool.flush_tiers()
    with open(out, "w") as f:
        json.dump({"computed": sum(len(r.prompt) - r.cached for r in requests), "seconds": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

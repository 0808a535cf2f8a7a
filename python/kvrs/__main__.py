"""Command line: ``python -m kvrs demo [options]``."""

from __future__ import annotations

import argparse
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
            "random-weight Llama-architecture transformers model with continuous batching through "
            "a kvrs BlockPool with prefix caching; then run one at a time with DynamicCache. "
            "Exits with 1 if any request's tokens differ."
        ),
    )
    demo.add_argument("--requests", type=int, default=24, help="chat requests (default 24)")
    demo.add_argument(
        "--system-len", type=int, default=1024, help="tokens of their shared system prompt (default 1024)"
    )
    demo.add_argument(
        "--new-tokens", type=int, default=64, help="most tokens a request generates (default 64)"
    )
    demo.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    demo.add_argument(
        "--pool-blocks", type=int, default=128, help="blocks of 16 tokens in the pool (default 128)"
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
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")

    concurrency: list[int] = []
    if args.concurrency is not None:
        try:
            concurrency = [int(n) for n in args.concurrency.split(",")]
        except ValueError:
            parser.error(f"--concurrency={args.concurrency!r}: give comma-separated counts, e.g. 8,32,96")
        if not concurrency or min(concurrency) < 1:
            parser.error("--concurrency counts must be >= 1")

    try:
        from kvrs import demo as demo_module
    except ImportError as e:  # torch, transformers, matplotlib or tqdm missing
        print(f"kvrs demo needs the demo extra: pip install 'kvrs[demo]' ({e})", file=sys.stderr)
        return 2
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
    )


if __name__ == "__main__":
    sys.exit(main())

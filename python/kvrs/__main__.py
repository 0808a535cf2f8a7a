"""Command line: ``python -m kvrs demo [options]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrs", description="kvrs command line")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="generate with a small random-weight model through a KVCache and check it"
    )
    demo.add_argument("--prompt-len", type=int, default=96, help="prompt tokens (default 96)")
    demo.add_argument("--new-tokens", type=int, default=160, help="tokens to generate (default 160)")
    demo.add_argument(
        "--dtype",
        default="float16",
        choices=["float32", "float16", "bfloat16"],
        help="cache storage dtype (default float16)",
    )
    demo.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default 0)")
    demo.add_argument("--requests", type=int, default=8, help="chat requests in the serving part (default 8)")
    demo.add_argument(
        "--system-len", type=int, default=64, help="tokens of their shared system prompt (default 64)"
    )
    args = parser.parse_args(argv)

    from kvrs import demo as demo_module
    from kvrs import serving

    single = demo_module.run(args.prompt_len, args.new_tokens, args.dtype, args.seed)
    batched = serving.run(args.requests, args.system_len, args.new_tokens // 5, args.dtype, args.seed)
    return max(single, batched)


if __name__ == "__main__":
    sys.exit(main())

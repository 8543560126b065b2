"""The `oled` command. Each subcommand lives in its own module with add_parser(subparsers) and run(args)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = ("generate", "chat", "serve", "bench", "trace", "synth", "train-tiny", "calibrate")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="oled", description="OLED-MoE: offloaded MoE diffusion LLM inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and decisions")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"oled.cli.{name.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name != f"oled.cli.{name.replace('-', '_')}":
                raise
            continue
        mod.add_parser(sub)
        modules[name] = mod
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="oled: %(message)s")
    try:
        return modules[args.command].run(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as e:   # bad input: one clear line, non-zero exit
        if args.verbose:
            raise
        print(f"oled {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

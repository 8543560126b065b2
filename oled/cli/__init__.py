"""The `oled` command. Each subcommand lives in its own module with add_parser(subparsers) and run(args)."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

from .. import __version__

COMMANDS = ("generate", "chat", "serve", "bench", "compare", "trace", "synth", "train-tiny", "calibrate")
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130            # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_BROKEN_PIPE = 141            # 128 + SIGPIPE, as a shell reports `oled ... | head`


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it has none worth showing (None, an on/off flag) or its help says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def error_line(e: BaseException) -> str:
    """One line for the user: an OS error as `path: reason` (not `[Errno 21] ...`), anything else as its text."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class _SubParser(argparse.ArgumentParser):
    """Every subcommand's parser shows defaults in --help (subcommands need not ask for it one by one)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="oled", description="OLED-MoE: offloaded MoE diffusion LLM inference",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"oled {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and decisions")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubParser)
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
    return parser, modules


def main(argv=None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="oled: %(message)s")
    try:
        return modules[args.command].run(args) or 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader left (`| head`): say so in one line (stderr may be that pipe too: then nothing), and point
        # stdout at /dev/null so that the interpreter's final flush does not raise again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        with contextlib.suppress(OSError):
            print(f"oled {args.command}: output closed by the reader; stopped", file=sys.stderr)
        return EXIT_BROKEN_PIPE
    except (ValueError, OSError, RuntimeError, MemoryError) as e:   # bad input: one clear line, non-zero exit
        if args.verbose:
            raise
        print(f"oled {args.command}: error: {error_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

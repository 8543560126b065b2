"""`oled chat`: an interactive chat in the terminal.

Reads one message per line from stdin and keeps the conversation as chat messages (the LLaDA2 template). Each answer
streams block by block as the engine commits it, followed by one line of statistics on stderr. /reset clears the
history, /exit (or end of input) quits; Ctrl-C stops the answer being generated.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import replace

from ..decoding.procedure import usable_positions
from ..engine import Engine
from ..server.text import IncrementalText
from .common import add_decode_args, add_engine_args, add_special_tokens_arg, decode_params, engine_config

HELP = "commands: /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer"


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with the model in the terminal (streams each answer)")
    p.add_argument("--system", help="a system message at the start of the conversation")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer at this text (repeatable)")
    add_special_tokens_arg(p)
    add_engine_args(p)
    add_decode_args(p)


class Chat:
    """The conversation and one turn of it; separate from the terminal so that it can be driven directly."""

    def __init__(self, engine, params, system: str | None = None, stop=(), out=sys.stdout, err=sys.stderr,
                 allow_special_tokens: bool = False):
        self.engine, self.params, self.stop = engine, params, tuple(stop)
        self.allow_special_tokens = allow_special_tokens      # messages' special tokens parsed, not text
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict] = []
        self.out, self.err = out, err
        self.cancel = threading.Event()

    def reset(self) -> None:
        self.history = []

    def _fit(self, message: str) -> tuple[list[int], int]:
        """Prompt ids and generation length for the next answer; drops the oldest turns when the context is full."""
        tok, config = self.engine.tokenizer, self.engine.config
        block = self.params.block_length or config.block_length
        usable = usable_positions(config, block)
        dropped = 0
        while True:
            messages = self.system + self.history + [{"role": "user", "content": message}]
            ids = tok.chat_ids(messages, self.allow_special_tokens)
            if len(ids) + self.params.gen_length <= usable or not self.history:
                break
            self.history = self.history[2:]
            dropped += 1
        if dropped:
            print(f"[context full: dropped the {dropped} oldest exchange(s)]", file=self.err)
        gen = min(self.params.gen_length, usable - len(ids))
        if gen <= 0:
            raise ValueError(f"the message is too long: {len(ids)} tokens with the template; the model's context is "
                             f"{config.max_position_embeddings}")
        if gen < self.params.gen_length:
            print(f"[answer limited to {gen} tokens by the context]", file=self.err)
        return ids, gen

    def turn(self, message: str) -> str | None:
        """Answer one message, streaming it to `out`; returns the answer, or None if it was interrupted."""
        ids, gen = self._fit(message)
        params = replace(self.params, gen_length=gen, stop=self.stop)
        text = IncrementalText(self.engine.tokenizer, self.stop)
        self.engine.manager.stats.reset()           # statistics of this answer only
        self.cancel.clear()
        box: dict = {}

        def on_block(new_ids, finished):
            delta = text.add(new_ids, finished)
            if delta:
                self.out.write(delta)
                self.out.flush()

        done = threading.Event()       # waited on instead of Thread.join, which Ctrl-C can leave in a bad state

        def work():
            try:
                box["result"] = self.engine.generate_ids(ids, params, on_block=on_block,
                                                         cancelled=lambda: self.cancel.is_set() or text.stopped)
            except BaseException as e:            # re-raised in the calling thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="oled-chat", daemon=True).start()
        try:
            while not done.wait(0.1):
                pass
        except KeyboardInterrupt:            # stop the answer at the engine's next iteration
            self.cancel.set()
            while not done.wait(0.1):
                pass
        if "error" in box:
            raise box["error"]
        res = box["result"]
        tail = text.flush()
        if tail and not self.cancel.is_set():
            self.out.write(tail)
        self.out.write("\n")
        self.out.flush()
        if self.cancel.is_set():
            print("[interrupted: the answer is not kept in the history]", file=self.err, flush=True)
            return None
        finish = "stop" if text.stopped else res.finish_reason
        stats = self.engine.manager.stats.summary()
        print(f"[{len(res.token_ids)} tokens, TPOT {res.tpot_s * 1e3:.2f} ms, {res.tokens_per_forward:.2f} tok/forward "
              f"({res.nfe} forwards), hit rate {stats.get('hit_rate_tokens', 1.0):.1%}, "
              f"prefill {res.prefill_s * 1e3:.1f} ms, finish {finish}]", file=self.err, flush=True)
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": text.text}]
        return text.text


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def run(args) -> int:
    params = decode_params(args)
    params.validate()
    engine = Engine(engine_config(args), progress=True)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  optional: line editing for input(), absent on some platforms
        except ImportError:
            pass
    print(f"oled chat: {engine.describe()}", file=sys.stderr)
    print(f"oled chat: {HELP}", file=sys.stderr, flush=True)
    chat = Chat(engine, params, system=args.system, stop=args.stop, allow_special_tokens=args.allow_special_tokens)
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            print("\n[use /exit or Ctrl-D to quit]", file=sys.stderr)
            continue
        if line is None:
            return 0
        message = line.strip()
        if not message:
            continue
        if message.startswith("/"):
            command = message.split()[0].lower()
            if command in ("/exit", "/quit", "/bye"):
                return 0
            if command == "/reset":
                chat.reset()
                print("[history cleared]", file=sys.stderr, flush=True)
            else:
                print(f"[unknown command {command}; {HELP}]", file=sys.stderr, flush=True)
            continue
        try:
            chat.turn(message)
        except ValueError as e:          # a message that cannot fit: say so and keep chatting
            print(f"[{e}]", file=sys.stderr, flush=True)

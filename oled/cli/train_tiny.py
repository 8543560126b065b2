"""`oled train-tiny`: train the small LLaDA2-architecture model (see oled/train/tiny.py)."""
from __future__ import annotations

from ..train.tiny import build_parser, train


def add_parser(sub) -> None:
    sub.add_parser("train-tiny", help="train the tiny default model on Python standard-library source",
                   parents=[build_parser()], add_help=False, conflict_handler="resolve")


def run(args) -> int:
    train(args)
    return 0

"""`oled synth --preset P OUT_DIR`: write a random-weight checkpoint in the published layout."""
from __future__ import annotations

from ..synth import PRESETS, preset_config, write_checkpoint
from .common import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a random-weight checkpoint with a preset's shapes")
    p.add_argument("out_dir", help="directory to write (created if needed)")
    p.add_argument("--preset", required=True, choices=PRESETS, help="the shapes to use")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="random-weights seed")
    p.add_argument("--shard-gib", type=float, default=2.0, help="shard size in GiB")


def run(args) -> int:
    out = write_checkpoint(preset_config(args.preset, args.layers), args.out_dir, seed=args.seed,
                           shard_bytes=int(args.shard_gib * 2**30), progress=True)
    print(out)
    return 0

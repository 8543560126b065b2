"""The two official generation procedures, as strategies of the one decoding loop: where the canvas ends, where its
blocks lie, how many iterations a block gets, and which masked positions an iteration may commit.

- LLaDA2 (`LLaDA2MoeModelLM.generate()`, block-causal models): the canvas is prompt + gen_length padded to whole
  blocks of B counted from position 0; decoding starts with the block holding the end of the prompt (mask tokens of
  the prompt inside that block are decoded with it); `steps` is capped at gen_length // minimal_topk before the
  schedule of B tokens over `steps` iterations is built.
- LLaDA (`generate()` of the LLaDA repository, used by LLaDA-MoE, bidirectional models): the canvas is exactly
  prompt + gen_length; blocks of B start at the end of the prompt (the last one is shorter when B does not divide
  gen_length, where the official code asserts); each block spreads its own masks over `steps` iterations, and every
  mask before the block's end, the prompt's included, competes for the commits.

Both cap a block's iterations at its schedule, whose length is at most the block's: `steps` beyond the tokens to
spread only adds iterations of minimum 0, after the block's masks are gone (LLaDA2) or committing nothing (LLaDA's
top-n rule), so the cap changes no token of the official rules and bounds the work of any `steps`. (With LLaDA and
the threshold rule, such iterations could still commit a prompt mask above the threshold: the cap skips them.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .rules import transfer_schedule


@dataclass(frozen=True)
class Block:
    index: int          # the block's number (LLaDA2: in the canvas from position 0; LLaDA: from the prompt's end)
    start: int
    end: int


class Procedure:
    pads_to_blocks = False          # the canvas is rounded up to whole blocks (context checks say so)

    def canvas_length(self, prompt_len: int, gen_length: int, block_length: int) -> int:
        raise NotImplementedError

    def blocks(self, prompt_len: int, gen_length: int, block_length: int) -> list[Block]:
        raise NotImplementedError

    def prefill_end(self, prompt_len: int, block_length: int) -> int:
        """Positions whose K/V the cache mode may write before the first block (whole prompt blocks)."""
        return 0

    def schedule(self, block: Block, params, block_length: int) -> list[int]:
        """Minimum commits per iteration of `block` (params: the request's DecodeParams); its length caps the
        block's iterations."""
        raise NotImplementedError

    def window_start(self, canvas: np.ndarray, block: Block, mask_id: int) -> int:
        """First position an iteration of this block may commit (the window ends at the block's end)."""
        return block.start


class LLaDA2Procedure(Procedure):
    pads_to_blocks = True

    def canvas_length(self, prompt_len, gen_length, block_length):
        return math.ceil((prompt_len + gen_length) / block_length) * block_length

    def blocks(self, prompt_len, gen_length, block_length):
        total = self.canvas_length(prompt_len, gen_length, block_length)
        return [Block(b, b * block_length, (b + 1) * block_length)
                for b in range(prompt_len // block_length, total // block_length)]

    def prefill_end(self, prompt_len, block_length):
        return prompt_len // block_length * block_length

    def schedule(self, block, params, block_length):
        # the official cap; at least one iteration where it would leave none (gen_length < minimal_topk)
        capped = max(params.gen_length // params.minimal_topk, 1)
        return transfer_schedule(block_length, min(params.steps or block_length, capped, block_length))


class LLaDAProcedure(Procedure):
    def canvas_length(self, prompt_len, gen_length, block_length):
        return prompt_len + gen_length

    def blocks(self, prompt_len, gen_length, block_length):
        end = prompt_len + gen_length
        return [Block(k, s, min(s + block_length, end))
                for k, s in enumerate(range(prompt_len, end, block_length))]

    def schedule(self, block, params, block_length):
        tokens = block.end - block.start            # the block's masks when it starts
        return transfer_schedule(tokens, min(params.steps or block_length, tokens))

    def window_start(self, canvas, block, mask_id):
        earlier = np.flatnonzero(canvas[: block.start] == mask_id)
        return int(earlier[0]) if earlier.size else block.start


def usable_positions(config, block_length: int) -> int:
    """The most positions a prompt and its generation may take together (LLaDA2 pads the canvas to whole blocks)."""
    if procedure_for(config).pads_to_blocks:
        return config.max_position_embeddings // block_length * block_length
    return config.max_position_embeddings


def procedure_for(config) -> Procedure:
    """Block-causal checkpoints (LLaDA2) come with LLaDA2's generate(); bidirectional ones (LLaDA-MoE) with LLaDA's."""
    return LLaDA2Procedure() if config.block_causal else LLaDAProcedure()

"""The KV cache and the cache modes: which tokens each forward runs and which keys it attends.

For block-causal models (LLaDA2) the K/V of a finished block never change, so the prefix cache is exact: prefill
the prompt's full blocks once, run only the current block per iteration, and write a finished block's final K/V
once (fused into the next block's first forward). For fully bidirectional models (LLaDA-MoE) every cache is an approximation refreshed at each block's first
iteration: `prefix` reruns the current block and everything after it, `dual` only the current block.
"""
from __future__ import annotations

import torch

from ..models.config import ModelConfig


KEY_BUCKET = 256   # forwards attend over keys padded to a multiple of this (masked): few shapes, little waste


class KVCache:
    """Per layer K and V [kv_heads, max_len, head_dim]. Zero-initialised: padded keys are masked, and masked keys
    must still be finite (0 * NaN would leak into the attention output)."""

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device):
        self.max_len = self.key_len(max_len)        # whole buckets: every key length a forward asks for fits
        shape = (config.num_kv_heads, self.max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def key_len(self, kv_end: int) -> int:
        """Keys a forward attending [0, kv_end) runs over: kv_end rounded up to the bucket, the same for every
        request (so eager and replayed forwards, whatever the cache's size, run the same shapes)."""
        return -(-kv_end // KEY_BUCKET) * KEY_BUCKET


class CacheMode:
    """Strategy: forward(tokens, start, kv_end, rows, kind) runs the model on canvas[start:start+len(tokens)]."""

    def __init__(self, block_causal: bool):
        self.block_causal = block_causal

    def prefill(self, forward, canvas, block_start: int) -> None:
        pass

    def block_logits(self, forward, canvas, bs: int, be: int, step: int):
        raise NotImplementedError

    def finish_block(self, forward, canvas, bs: int, be: int) -> None:
        pass


class NoCache(CacheMode):
    """The reference: every iteration recomputes everything the block can see."""

    def block_logits(self, forward, canvas, bs, be, step):
        end = be if self.block_causal else len(canvas)
        return forward(canvas[:end], 0, end, slice(bs, be), "iteration")


class PrefixCache(CacheMode):
    """For block-causal models a finished block's final K/V are written by the next block's first forward, which
    runs the finished block's final tokens and the new block together under the block-causal mask: the same math
    as a separate cache-fill forward, one forward fewer per block (and none after the last block)."""

    def __init__(self, block_causal: bool):
        super().__init__(block_causal)
        self.unwritten: int | None = None   # start of a finished block whose final K/V are not in the cache yet

    def prefill(self, forward, canvas, block_start):
        if self.block_causal and block_start > 0:
            forward(canvas[:block_start], 0, block_start, None, "prefill")

    def block_logits(self, forward, canvas, bs, be, step):
        if self.block_causal:
            start, self.unwritten = (bs if self.unwritten is None else self.unwritten), None
            return forward(canvas[start:be], start, be, slice(bs - start, None), "iteration")
        if step == 0:   # refresh: the whole canvas, which also rewrites the prefix K/V
            return forward(canvas, 0, len(canvas), slice(bs, be), "iteration")
        return forward(canvas[bs:], bs, len(canvas), slice(0, be - bs), "iteration")

    def finish_block(self, forward, canvas, bs, be):
        if self.block_causal:
            self.unwritten = bs


class DualCache(PrefixCache):
    def block_logits(self, forward, canvas, bs, be, step):
        if self.block_causal or step == 0:
            return super().block_logits(forward, canvas, bs, be, step)
        return forward(canvas[bs:be], bs, len(canvas), slice(None), "iteration")


CACHE_MODES = {"none": NoCache, "prefix": PrefixCache, "dual": DualCache}

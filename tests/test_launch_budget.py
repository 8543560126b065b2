"""Kernel launches of a denoising forward with every Triton kernel on (--fused), counted on the CPU
(benchmarks/launch_count.py: aten ops that launch a kernel, plus Triton launches): exactly the kernels listed here,
so a launch that creeps back into the forward fails this test, and against the torch path."""
from __future__ import annotations

from collections import Counter

import pytest

from tests.triton_interpreter import import_triton_for_the_interpreter, interpreted_kernels
from tests.scripts import benchmark_script

triton = import_triton_for_the_interpreter()

# numpy under the interpreter: -inf - -inf in the confidence's masked lanes, exp(-x) of a large -x in the SiLU
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

# what each part of a forward launches with --fused (its GEMMs of up to 64 rows, every one here, as the skinny
# Triton GEMM, the LM head's as torch's)
GEMM = "triton:skinny_linear_kernel"
EVERY_LAYER = Counter({"triton:add_rms_norm_kernel": 2, GEMM: 2, "triton:qk_norm_rope_kernel": 1,
                       "triton:attention_kernel": 1})       # two norms, QKV and output GEMMs, prologue, attention
MOE_LAYER = Counter({"triton:gate_partials_kernel": 1,           # the gate GEMM, its partial sums
                     "triton:sigmoid_group_route_kernel": 1, "triton:align_pairs_kernel": 1,
                     "triton:gate_up_kernel": 1, "triton:down_kernel": 1, "triton:combine_kernel": 1})
# (the shared expert: more pairs of the MoE kernels' launches, EngineConfig.shared_in_moe)
DENSE_LAYER = Counter({GEMM: 2, "triton:silu_mul_kernel": 1})
FORWARD = Counter({"embedding": 1, "full": 1, "arange": 1,       # no mask: the attention kernel computes it
                   "triton:add_rms_norm_kernel": 1, "linear": 1, "to": 1,           # final norm, LM head, fp32 logits
                   "triton:scan_kernel": 1, "_to_copy": 2, "stack": 2,             # confidence; to the host
                   "copy_": 1})                                    # the routing, into a pinned buffer


@pytest.fixture(scope="module")
def kernels():
    mp = interpreted_kernels("kernel_math", "router_kernel", "confidence_kernel", "moe_align_kernel", "moe_kernel",
                             "norm_kernel", "mlp_kernel", "attention_kernel", "linear_kernel")
    yield
    mp.undo()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # -inf - -inf in the confidence
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def load_counter():
    return benchmark_script("launch_count")


def test_a_fused_forward_launches_exactly_the_listed_kernels(kernels):
    from oled.models.config import config_from_dict
    from oled.synth import preset_config

    counter = load_counter()
    assert set(counter.fused_fields()) == {"fused_router", "fused_moe", "fused_norm", "fused_mlp", "fused_confidence",
                                            "fused_attention", "fused_linear"}
    runs = {fused: counter.count_forward(counter.fused_fields() if fused else [], gen_length=16)
            for fused in (False, True)}
    counts, forwards = runs[True]
    config = config_from_dict(preset_config("tiny", None))
    moe, dense = len(config.moe_layers), config.num_layers - len(config.moe_layers)
    per_forward = Counter()
    for part, times in ((EVERY_LAYER, config.num_layers), (MOE_LAYER, moe), (DENSE_LAYER, dense), (FORWARD, 1)):
        for name, n in part.items():
            per_forward[name] += n * times
    assert forwards == runs[False][1]
    assert dict(counts) == {name: n * forwards for name, n in per_forward.items()}
    plain = sum(runs[False][0].values()) / forwards
    assert sum(per_forward.values()) * 4 < plain, (sum(per_forward.values()), plain)     # 60 against about 290

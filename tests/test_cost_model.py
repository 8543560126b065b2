"""The cost model's measurement rules (runtime/cost_model.py) that do not need a GPU."""


def test_cpu_times_never_fall_as_tokens_grow():
    """A figure measured at few tokens above one at more tokens is noise (the routing grid's 0.81 ms at 1 token
    against 0.06 ms at 4): it is lowered to the smallest figure at any larger token count."""
    from oled.runtime.cost_model import monotone_in_tokens

    measured = {1: 812e-6, 2: 275e-6, 4: 60e-6, 8: 266e-6, 16: 265e-6, 32: 462e-6}
    fixed = monotone_in_tokens(measured)
    assert fixed == {1: 60e-6, 2: 60e-6, 4: 60e-6, 8: 265e-6, 16: 265e-6, 32: 462e-6}
    assert monotone_in_tokens(fixed) == fixed

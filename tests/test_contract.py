"""The policy contract is a leaf: the modules a policy is written against import no torch and nothing of the
runtime, and no policy imports the runtime (it gets the planner through its context)."""
from __future__ import annotations

import ast
import pathlib

import pytest

POLICIES = pathlib.Path(__file__).resolve().parent.parent / "oled" / "policies"
LEAVES = ("contract.py", "costs.py")


def _imports(path: pathlib.Path) -> list[str]:
    """Every module `path` imports, relative ones as written (leading dots kept)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


@pytest.mark.parametrize("name", LEAVES)
def test_the_contract_imports_no_torch_and_nothing_of_the_runtime(name):
    imported = _imports(POLICIES / name)
    assert imported, name
    assert not [m for m in imported if m.split(".")[0] == "torch" or "runtime" in m], imported
    # only the standard library, NumPy and its sibling leaves (the cost table, the text reader)
    assert set(m for m in imported if m.startswith(".")) <= {".costs", "..textfile"}, imported


def test_no_policy_imports_the_runtime():
    for path in POLICIES.glob("*.py"):
        assert not [m for m in _imports(path) if "runtime" in m], path.name


def test_the_runtime_never_writes_a_policys_context():
    """The context is frozen; the costs of a forward come through Policy.plan_on."""
    from oled.policies import PolicyContext, make_policy
    from oled.policies.costs import CostModel

    ctx = PolicyContext(layers=[1], num_experts=4, capacity=2, top_k=1, expert_bytes=1)
    with pytest.raises(AttributeError):
        ctx.costs = None
    policy = make_policy("lru")
    policy.setup(ctx)
    costs = CostModel(expert_bytes=1, h2d_gbps=1.0, cpu_seconds={1: 1e-4})
    policy.plan_on(costs)
    assert policy.costs is costs and ctx.costs is None


def test_the_runtime_implements_the_protocols_the_decoding_side_sees():
    """ExpertManager is an ExpertBackend, its graph hooks are GraphHooks, the round trip its LayerSegments."""
    from oled.runtime.backend import ExpertBackend, GraphHooks, LayerSegments
    from oled.runtime.manager import ExpertManager, _GraphHooks
    from oled.runtime.round_trip import RoundTrip

    for protocol, cls in ((ExpertBackend, ExpertManager), (GraphHooks, _GraphHooks), (LayerSegments, RoundTrip)):
        names = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
        assert names and all(callable(getattr(cls, n, None)) for n in names), (protocol.__name__, names)

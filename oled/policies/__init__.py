"""Expert residency policies, selected by name (--policy)."""
from __future__ import annotations

from .belady import BeladyPolicy
from .base import Policy
from .contract import ForwardInfo, IterationEvent, LayerDecision, LayerEvent, PolicyContext
from .fiddler import FiddlerPolicy
from .full import FullPolicy
from .lfu import LFUPolicy
from .lru import LRUPolicy
from .oled import OledPolicy
from .prefetch import PrefetchPolicy
from .tide import TidePolicy

# name -> (class, the options that define it); a variant's own options override the caller's
POLICIES: dict[str, tuple[type[Policy], dict]] = {
    "oled": (OledPolicy, {}),
    "oled-retain": (OledPolicy, {"misses": "load", "waves": 0}),
    "oled-coop": (OledPolicy, {"retention": "lru"}),
    **{p.name: (p, {}) for p in (FullPolicy, LRUPolicy, LFUPolicy, PrefetchPolicy, FiddlerPolicy, TidePolicy,
                                  BeladyPolicy)},
}
DEFAULT_POLICY = "oled"


def policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name][0]


def policy_options(name: str) -> tuple[str, ...]:
    """The options a caller may set for this policy (a variant's defining options are fixed)."""
    cls, fixed = POLICIES[name][0], POLICIES[name][1]
    return tuple(o for o in getattr(cls, "options", ()) if o not in fixed)


def make_policy(name: str, **options) -> Policy:
    cls = policy_class(name)
    accepted = policy_options(name)
    policy = cls(**{k: v for k, v in options.items() if k in accepted and v is not None}, **POLICIES[name][1])
    policy.name = name
    return policy


__all__ = ["POLICIES", "DEFAULT_POLICY", "make_policy", "policy_class", "policy_options", "Policy", "PolicyContext", "ForwardInfo", "LayerEvent", "LayerDecision",
           "IterationEvent"]

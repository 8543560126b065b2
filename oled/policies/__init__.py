"""Expert residency policies, selected by name (--policy)."""
from __future__ import annotations

from .base import IterationEvent, LayerPlan, Policy, PolicyContext
from .fiddler import FiddlerPolicy
from .full import FullPolicy
from .lfu import LFUPolicy
from .lru import LRUPolicy
from .prefetch import PrefetchPolicy
from .tide import TidePolicy

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FullPolicy, LRUPolicy, LFUPolicy, PrefetchPolicy,
                                                          FiddlerPolicy, TidePolicy)}


def make_policy(name: str, **options) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    cls = POLICIES[name]
    accepted = getattr(cls, "options", ())
    return cls(**{k: v for k, v in options.items() if k in accepted and v is not None})


__all__ = ["POLICIES", "make_policy", "Policy", "PolicyContext", "LayerPlan", "IterationEvent"]

"""PolicySpec: a policy with its options as one string, `name` or `name:key=value[:key=value]` (tide:tau=2,
oled:decay=0.5), the way `--policy`, `oled bench --policies` and `oled.LLM(policy=...)` take it."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import POLICIES, policy_class, policy_options


@dataclass
class PolicySpec:
    name: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}(" + ",".join(f"{k}={v}" for k, v in self.options.items()) + ")"

    @property
    def static_full(self) -> bool:
        return bool(getattr(policy_class(self.name), "static_full", False))

    @classmethod
    def parse(cls, text: str, live: bool = False) -> "PolicySpec":
        """live: refuse a policy that needs the future routing (belady: replay only)."""
        name, *opts = text.strip().split(":")
        if live and name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(live_policies())}")
        if live and policy_class(name).needs_future:     # an unknown name is refused here, with the choices
            raise ValueError(f"policy {name!r} needs the future routing: it runs in replays only "
                             f"(oled bench --replay TRACE)")
        policy_class(name)
        options = {}
        for opt in opts:
            key, eq, value = opt.partition("=")
            if not eq or not key:
                raise ValueError(f"policy {text!r}: options are written name:key=value (e.g. tide:tau=2)")
            accepted = policy_options(name)
            if key not in accepted:
                raise ValueError(f"policy {name!r} has no option {key!r} (options: {', '.join(accepted) or 'none'})")
            options[key] = _value(value)
        return cls(name, options)


def live_policies() -> list[str]:
    """The policies an engine runs (belady needs the future routing: replay only)."""
    return [name for name in POLICIES if not policy_class(name).needs_future]


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text

"""The one rule every stage applies to a rerun: the same settings resume, other settings are refused.

Every difference is named the same way: `key: recorded -> now`, e.g. `num_classes: 22 -> 7`.
"""
from __future__ import annotations

SHOWN = 4  # differences a refusal lists before "and N more"


def show(value) -> str:
    """A value as a refusal prints it: repr, with a sha256 cut to 12 hex digits (enough to tell two apart)."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        value = value[:12]
    return repr(value)


def differences(recorded: dict, now: dict, keys=None, nested: bool = True) -> list[str]:
    """`key: recorded -> now` for every key whose values differ (sorted; `keys` in their order when given)."""
    out = []
    for key in sorted(set(recorded) | set(now)) if keys is None else keys:
        a, b = recorded.get(key), now.get(key)
        if nested and isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{d}" for d in differences(a, b, nested=False)]
        elif _plain(a) != _plain(b):
            out.append(f"{key}: {show(a)} -> {show(b)}")
    return out


def listed(diffs: list[str], limit: int = SHOWN) -> str:
    """The first `limit` differences joined by '; ', and how many more there are."""
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def _plain(value):
    """Tuples and lists compare alike (a JSON round trip turns one into the other)."""
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value

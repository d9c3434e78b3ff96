"""The quality curve of a run: which RUN/eval.jsonl points form one series, and how a metric's series are drawn.

`python -m evaluate run` (RUN/eval.png) and `python -m train.plot` (RUN/curves.png) both group points here, so
points measured another way never join into one line in either picture.
"""
from __future__ import annotations

import math

from shared.generative.samplers import SAMPLER_OPTIONS

# The settings of an eval.jsonl line that say how it was measured (evaluate.curve.settings_of writes them); a setting
# a line lacks reads as None (lines written before it existed, or a flag left unset). The sampler's options and the
# DiT's precision are written only away from their defaults, so a line without them reads as the default.
SERIES_KEYS = ("feature_network", "ref", "sampler", "num_sampling_steps", "cfg_scale", "cfg_interval",
               "guide_channels", "num_samples", "seed", *SAMPLER_OPTIONS, "dit_precision")
# Numeric fields beside the metrics that describe the measurement rather than being one.
EVAL_SETTINGS = {"step", "seed", "num_samples", "cfg_scale", "num_sampling_steps", "sampling_steps", "batch_size",
                 "ref_count", "pr_k", "is_split_size", "seconds", *SAMPLER_OPTIONS}


def is_number(value) -> bool:
    """True for int/float values (not bools), NaN and inf included."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def series_key(row: dict) -> tuple:
    """The measurement settings of a line (or of a settings dict): equal keys, one series."""
    return tuple(_plain(row.get(k)) for k in SERIES_KEYS)


def same_series(rows: list[dict], settings: dict) -> list[dict]:
    """The lines measured with exactly these settings, by step."""
    key = series_key(settings)
    return sorted((r for r in rows if series_key(r) == key), key=lambda r: r["step"])


def metrics_of(rows: list[dict]) -> list[str]:
    """The quality metrics of eval.jsonl lines: every numeric field that is not a setting, in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k, v in row.items() if k not in EVAL_SETTINGS and is_number(v)))


def metric_lines(rows: list[dict], key: str) -> list[tuple]:
    """(label, steps, values) per series holding `key`: labelled by the settings that differ between series."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if is_number(row.get(key)):
            groups.setdefault(series_key(row), []).append(row)
    differ = [i for i in range(len(SERIES_KEYS)) if len({str(tag[i]) for tag in groups}) > 1]
    lines = []
    for tag, group in groups.items():
        group = sorted(group, key=lambda r: r["step"])
        label = ", ".join(f"{SERIES_KEYS[i]} {tag[i]}" for i in differ) or None
        lines.append((label, [r["step"] for r in group], [float(r[key]) for r in group]))
    return lines


def metric_title(rows: list[dict], key: str) -> str:
    """A metric's title: 'fid' measured only in the digits feature space is the digits FD, not an FID."""
    networks = {row.get("feature_network") for row in rows if key in row}
    return "digits FD" if key == "fid" and networks == {"digits"} else key


def draw_metric(ax, lines: list[tuple]) -> None:
    """One metric's series on a matplotlib axes: points joined within a series only, a legend when several."""
    for label, steps, values in lines:
        ax.plot(steps, values, marker="o", markersize=3, label=label)
    if len(lines) > 1:
        ax.legend(fontsize="small")


def finite_values(lines: list[tuple]) -> list[float]:
    """The finite values of some series (what decides whether a panel has anything to show)."""
    return [v for _, _, values in lines for v in values if math.isfinite(v)]


def _plain(value):
    """Lists and tuples alike (a JSON round trip turns one into the other)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value

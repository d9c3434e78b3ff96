"""Per-image randomness: image i's class label, noise and sampler noise come from one generator seeded by (seed, i).

So results do not depend on the batch size, the process, or which images were on disk when a run resumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.runtime.errors import UserError
from shared.runtime.seeding import generator_for


@dataclass(frozen=True)
class LabelPlan:
    """How image i gets its class: cycle through `class_labels`, or draw it from the image generator."""
    num_classes: int
    class_labels: tuple[int, ...] | None = None  # None with random=False: all classes round-robin
    random: bool = False
    class_names: tuple[str, ...] | None = None   # from the latent metadata, for file names (None: unknown)

    def name_of(self, label: int) -> str | None:
        """The class name of `label`, when the metadata records names."""
        return self.class_names[label] if self.class_names and 0 <= label < len(self.class_names) else None

    def describe(self) -> str:
        """A short human description for settings.json."""
        if self.random:
            return f"random over {self.num_classes} classes from (seed, i)"
        if self.class_labels is None:
            return f"round-robin over all {self.num_classes} classes (label = i % {self.num_classes})"
        return f"cycled over {list(self.class_labels)}"


def class_index(value, class_names) -> int:
    """One --class-labels entry -> class index: digits are an index; a name matches exactly, then ignoring case."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    names = list(class_names or [])
    if not names:
        raise UserError(f"--class-labels {text!r} is a class name, but these weights record no class names (an "
                        f"official .pt has none); pass class indices instead, e.g. --class-labels 207 360.")
    if text in names:
        return names.index(text)
    folded = [i for i, name in enumerate(names) if name.casefold() == text.casefold()]
    if len(folded) == 1:
        return folded[0]
    close = [n for n in names if text.casefold() in n.casefold()][:5] or names[:5]
    which = "matches several classes when case is ignored" if folded else "is not a class name of these weights"
    raise UserError(f"--class-labels {text!r} {which}; names are matched exactly, then ignoring case. "
                    f"{len(names)} classes, e.g. {', '.join(repr(n) for n in close)}; pass one of them or a class "
                    f"index from 0 to {len(names) - 1}.")


def make_label_plan(class_labels, num_classes: int, random: bool, class_names=None) -> LabelPlan:
    """Validate --class-labels (indices or names) against the model's classes; UserError names the valid range."""
    if random and class_labels:
        raise UserError("--random-labels and --class-labels exclude each other: pass one of them.")
    names = tuple(str(n) for n in class_names) if class_names and len(class_names) == num_classes else None
    if class_labels:
        class_labels = [class_index(c, names) for c in class_labels]
        bad = [c for c in class_labels if not 0 <= c < num_classes]
        if bad:
            raise UserError(f"class labels {bad} are outside this model's classes [0, {num_classes}); pass "
                            f"--class-labels with values from 0 to {num_classes - 1}.")
        return LabelPlan(num_classes, tuple(int(c) for c in class_labels), False, names)
    return LabelPlan(num_classes, None, random, names)


def image_rng(plan: LabelPlan, seed: int, index: int) -> tuple[int, torch.Generator]:
    """Image `index`'s class label and its generator, positioned after the label draw."""
    generator = generator_for(seed, index)  # mix_seed(seed, index): the project's one seed mixer
    if plan.random:
        label = int(torch.randint(plan.num_classes, (1,), generator=generator))
    elif plan.class_labels is None:
        label = index % plan.num_classes
    else:
        label = plan.class_labels[index % len(plan.class_labels)]
    return label, generator


def image_labels(plan: LabelPlan, seed: int, indices) -> list[int]:
    """Class labels of `indices` without drawing any noise (names, grid and npz need them)."""
    return [image_rng(plan, seed, i)[0] for i in indices]


def batch_start(plan: LabelPlan, seed: int, indices, latent_shape) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Starting noise (N,C,h,w), labels (N,) and per-row generators for one batch, all on the CPU."""
    labels, generators, noise = [], [], []
    for i in indices:
        label, generator = image_rng(plan, seed, i)
        labels.append(label)
        generators.append(generator)
        noise.append(torch.randn(tuple(latent_shape), generator=generator))  # (C, h, w)
    return torch.stack(noise), torch.tensor(labels, dtype=torch.long), generators  # (N, C, h, w)

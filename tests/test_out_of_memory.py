"""Memory at the limit (issue 34.2): the planner's measurement leaves nothing behind, and running out of memory in
`python -m train.plan --verify`, in auto's confirmation or in `python -m train` ends in one paragraph or one step down.

The CUDA caching allocator is read through one seam, train.memory.allocator: here a CPU stand-in runs the trainer's
real step (train/step.py) on the CPU, and an out-of-memory is raised where CUDA would raise it.
"""
import gc
import weakref

import torch

from shared.network.models import ModelConfig
from train import memory

MODEL = ModelConfig(model="DiT-T/2", input_size=4, in_channels=4, num_classes=4)  # what the tiny latents give


def _record_builds(monkeypatch) -> list:
    """Weak references to every model ModelConfig.build makes on a real device, its parameters and buffers."""
    refs, build = [], ModelConfig.build

    def recording(self, *args, **kwargs):
        model = build(self, *args, **kwargs)
        if str(kwargs.get("device")) != "meta":
            refs.append(weakref.ref(model))
            refs.extend(weakref.ref(t) for t in [*model.parameters(), *model.buffers()])
        return model

    monkeypatch.setattr(ModelConfig, "build", recording)
    return refs


def _record_saved(monkeypatch) -> list:
    """Weak references to every tensor autograd saved for backward while the planner measured."""
    refs, pack = [], memory.SavedTensorLedger._pack

    def recording(self, tensor):
        refs.append(weakref.ref(tensor))
        return pack(self, tensor)

    monkeypatch.setattr(memory.SavedTensorLedger, "_pack", recording)
    return refs


def _alive(refs: list) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_the_measurement_leaves_no_model_or_tensor_alive(monkeypatch):
    models, saved = _record_builds(monkeypatch), _record_saved(monkeypatch)
    for precision in ("fp32", "fp16"):
        memory.measure_profiles(MODEL, precision, (0, 1, 2), torch.device("cpu"))
    assert len(models) > 2 and len(saved) > 100
    assert (_alive(models), _alive(saved)) == (0, 0)

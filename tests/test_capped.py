"""tests/bench/capped.py on the CPU: with the CUDA queries faked as an 80 GiB card, every way the code reads the
card's memory sees the cap, so a plan under a 24 GiB cap is the plan for a 24 GiB card."""
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from shared.network.models import ModelConfig
from tests.bench import capped
from train import autotune, bench, memory
from train.config import TrainConfig

GiB = 2**30
# DiT-S/2 on 32x32 latents, no checkpointing, a large batch: the micro-batch is bound by the memory
MODEL = ModelConfig(model="DiT-S/2", input_size=32, in_channels=4, num_classes=1000)
BATCH = 8192


class FakeCard:
    """The CUDA memory queries of a card of `total` bytes with nothing allocated (the real torch functions' names)."""
    def __init__(self, total: int):
        self.total, self.fraction = total, 1.0

    def install(self, monkeypatch):
        queries = {"mem_get_info": self.mem_get_info, "set_per_process_memory_fraction": self.set_fraction,
                   "get_per_process_memory_fraction": self.get_fraction, "memory_reserved": lambda device=None: 0}
        for module in (torch.cuda, torch.cuda.memory):  # one object under both names, as in torch
            for name, query in queries.items():
                monkeypatch.setattr(module, name, query)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"fake {self.total // GiB} GiB card")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
        return self

    def mem_get_info(self, device=None):
        return int(self.total * self.fraction), self.total

    def properties(self, device=None):
        return SimpleNamespace(total_memory=self.total, name="fake", major=9)

    def set_fraction(self, fraction, device=None):
        self.fraction = fraction

    def get_fraction(self, device=None):
        return self.fraction


def planned_micro() -> int:
    """autotune's micro-batch for MODEL from what probe_device reads (the plan alone: no real step)."""
    cfg = TrainConfig(latents="x", results_dir="y", model="DiT-S/2", global_batch_size=BATCH,
                      micro_batch_size="auto", grad_checkpoint=0, precision="bf16")
    autotune.resolve_auto(cfg, MODEL, autotune.probe_device("cuda"), 1, autotune.no_measurement)
    return cfg.micro_batch_size


def test_every_memory_query_sees_the_cap(monkeypatch):
    card = FakeCard(80 * GiB).install(monkeypatch)
    early = types.ModuleType("early_import")
    early.mem_get_info, early.get_device_properties = torch.cuda.mem_get_info, torch.cuda.get_device_properties
    monkeypatch.setitem(sys.modules, "early_import", early)  # `from torch.cuda import ...` before the patch
    capped.cap_memory(24 * GiB)
    assert card.fraction == pytest.approx(24 / 80)  # the allocator itself is capped
    cuda = torch.device("cuda")
    for free, total in (torch.cuda.mem_get_info(), torch.cuda.memory.mem_get_info(), early.mem_get_info()):
        assert (free, total) == (24 * GiB, 24 * GiB)
    assert bench.free_memory(cuda) == 24 * GiB
    assert torch.cuda.get_device_properties(0).total_memory == early.get_device_properties(0).total_memory == 24 * GiB
    assert torch.cuda.get_device_properties(0).major == 9  # the card's other fields pass through
    assert memory.CudaAllocator().total() == 24 * GiB
    with memory.CudaAllocator().capped(12 * GiB):  # train.plan --verify's cap: inside this one
        assert card.fraction == pytest.approx(12 / 80) and torch.cuda.get_per_process_memory_fraction() == 0.5
    assert card.fraction == pytest.approx(24 / 80)


def test_a_plan_under_a_24_gib_cap_is_the_plan_for_a_24_gib_card(monkeypatch):
    FakeCard(24 * GiB).install(monkeypatch)
    on_24 = planned_micro()
    FakeCard(80 * GiB).install(monkeypatch)
    on_80 = planned_micro()
    capped.cap_memory(24 * GiB)
    assert planned_micro() == on_24 < on_80  # the cap decided it

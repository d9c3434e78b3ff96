"""The compiled network of the sampling loop (`--compile`): every step calls it with the same static shapes, at most
four per run (batch, last batch, each guided). "blocks" compiles one transformer block and reuses it for every block;
"graphs" compiles the whole network with CUDA graphs (mode reduce-overhead)."""
from __future__ import annotations

import torch

from shared.network.models import compile_blocks
from shared.runtime.errors import ChoiceError, SettingError

COMPILE_MODES = ("off", "blocks", "graphs")
COMPILE_HELP = ("torch.compile the network of the sampling loop (CUDA only): blocks (one transformer block compiled "
                "and reused for every block), graphs (the whole network with CUDA graphs, mode reduce-overhead: longer "
                "to compile, fewest kernel launches), or off. Pixels equal eager ones within float rounding; the "
                "first batch (and a last, smaller one) pays the compile")


def check_compile(mode: str, device) -> None:
    """ChoiceError for an unknown mode; SettingError for a compiled network off CUDA."""
    if mode not in COMPILE_MODES:
        raise ChoiceError("compile mode", mode, COMPILE_MODES)
    if mode != "off" and torch.device(device).type != "cuda":
        raise SettingError(f"{{compile mode}} {mode} compiles the network for a CUDA GPU (inductor's GPU kernels"
                           f"{' and CUDA graphs' if mode == 'graphs' else ''}), but this run is on "
                           f"{torch.device(device).type}. Drop {{compile mode}} (or pass {{compile mode}} off) to "
                           f"sample here, or run on a GPU.")


class GraphedModel:
    """model(x, t, y) through one whole-network compile; attributes read through to the model."""
    def __init__(self, model: torch.nn.Module, backend="inductor"):
        self.model = model
        self.cuda_graphs = backend == "inductor"
        mode = "reduce-overhead" if self.cuda_graphs else None
        self.compiled = torch.compile(model, backend=backend, mode=mode, dynamic=False, fullgraph=True)

    def __call__(self, x, t, y):
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are dead: reuse their memory
            return self.compiled(x, t, y).clone()  # a replay overwrites its output; samplers keep the last step's
        return self.compiled(x, t, y)

    def __getattr__(self, name):
        if name in ("model", "compiled"):  # not set yet (a copy being built): no recursion through self.model
            raise AttributeError(name)
        return getattr(self.model, name)


def compile_for_sampling(model: torch.nn.Module, mode: str, backend="inductor"):
    """`model` as the sampling loop calls it under COMPILE_MODES `mode` (tests pass a CPU torch.compile backend)."""
    if mode not in COMPILE_MODES:
        raise ChoiceError("compile mode", mode, COMPILE_MODES)
    if mode == "off":
        return model
    # At most four shapes per run (module docstring): dynamo's default limit (8) leaves room; this states the need.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4)
    if mode == "blocks":
        return compile_blocks(model, backend, dynamic=False, fullgraph=True)
    return GraphedModel(model, backend)

"""Our DiT^DH and RAE shift against RAE's own code (github bytetriper/RAE, MIT): same forward, same times, same grid.

Run: PYTHONPATH=DIR_WITH_EINOPS .venv/bin/python tests/bench/check_rae_parity.py --rae-repo PATH_TO_AN_RAE_CHECKOUT
(RAE's code is not part of this project and is never copied into it: point --rae-repo at a checkout. Its
models import einops, which our requirements do not bring (`pip install --target DIR einops` and put DIR on
PYTHONPATH), and timm, which cannot be imported here: timm's PatchEmbed and Mlp are replaced by minimal
stand-ins in tests/bench/reference_code.py (a strided Conv2d, flattened row-major, as timm's with its default
flatten and no norm), the only two timm classes RAE's DiTwDDTHead touches. RAE's sampler needs torchdiffeq, which our requirements bring.)

Checks, printing each number:
1. forward: RAE's DiTwDDTHead built with a preset's shape; every tensor perturbed so adaLN-Zero layers are
   live; its state dict loaded into our DiTDH with strict=True (the tensor names and shapes are RAE's); the
   largest |ours - RAE| of the outputs for the same (x, t, y), absolute and relative to the output's scale.
2. training times: RAE's Transport.sample with time_dist_shift s, uniform and logit-normal(0, 1): its shifted
   times against ours (shared.generative.flow.rae_shift) applied to the same base draws (in SiT time, 1 - t).
   And the distributions: quantiles of 200k of our FlowObjective.draw_time draws against 200k of RAE's.
3. sampling grids: RAE's ode (euler, num_steps 50) time grid against ours with the same shift: RAE's ODE grid
   stops at t = 0.001 before the shift (its check_interval's t1 = 1 - 1/1000), which is our
   flow_grid(49, end=0.999); our euler sampler itself walks to t = 0 (both ends printed). RAE's sde grid
   (num_steps 50, last step 0.04) shifts SiT's points, so with s = 6.93 its Euler-Maruyama steps stop at
   t = 0.224 before the 0.04 Mean step; ours (make_process('sde', 50)) shifts the grid within [0, 0.96] so the
   Mean step ends at the data: the gap and both last points are printed, not expected to be 0.
4. a full Euler trajectory: RAE's ode solver on its model against our euler_sample on ours (flow convention
   'repa': RAE's time, 1 = noise, and its velocity noise - data) over RAE's grid points, same starting noise;
   with --float64 also in float64 (a random network this deep can amplify float32 rounding along 49 steps).
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.generative.flow import FlowPath, FlowProcess, euler_sample, flow_grid, rae_shift  # noqa: E402
from shared.generative.objectives import make_objective  # noqa: E402
from shared.network.models import PRESETS, ModelConfig  # noqa: E402
from tests.bench.reference_code import perturb_, stand_in_timm  # noqa: E402

DDT_PRESETS = [name for name, arch in PRESETS.items() if arch.get("head_depth")]


def parse_args(argv=None):
    """Check options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rae-repo", required=True, help="a checkout of github.com/bytetriper/RAE (its src/ folder)")
    p.add_argument("--model", choices=DDT_PRESETS, default="DiTDH-T", help="DiT^DH preset of both random models")
    p.add_argument("--in-channels", type=int, default=32, help="token channels (RAE: 768)")
    p.add_argument("--input-size", type=int, default=8, help="token grid side (RAE: 16)")
    p.add_argument("--batch", type=int, default=4, help="samples")
    p.add_argument("--shift", type=float, default=(768 * 16 * 16 / 4096) ** 0.5,
                   help="time distribution shift (RAE asserts >= 1; default RAE's sqrt(768*16*16 / 4096) = 6.93)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and noise")
    p.add_argument("--float64", action="store_true",
                   help="also compare both models in float64 (rounding vs maths), and each float32 output with that")
    return p.parse_args(argv)


def import_rae(repo: Path):
    """RAE's stage2 package, with timm's two classes stood in for (see the module docstring)."""
    stand_in_timm(mlp=nn.Identity, attention=nn.Identity)  # Mlp/Attention: unused by DiTwDDTHead
    sys.path.insert(0, str(repo / "src"))
    return (importlib.import_module("stage2.models.DDT"), importlib.import_module("stage2.transport"),
            importlib.import_module("stage2.transport.integrators"))


def build_pair(ddt, args):
    """(RAE's model, ours) with the same perturbed random weights, both in eval mode."""
    arch = PRESETS[args.model]
    torch.manual_seed(args.seed)
    theirs = ddt.DiTwDDTHead(input_size=args.input_size, patch_size=1, in_channels=args.in_channels,
                             hidden_size=[arch["hidden_size"], arch["head_width"]],
                             depth=[arch["depth"], arch["head_depth"]], num_heads=[arch["num_heads"], arch["head_heads"]],
                             num_classes=10)
    perturb_(theirs, trainable_only=True)
    ours = ModelConfig(args.model, input_size=args.input_size, in_channels=args.in_channels, num_classes=10,
                       learn_sigma=False, objective="flow",
                       objective_args={"convention": "repa"}).build().eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def forward_pair(theirs, ours, args, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(RAE's output, ours) for one batch of (x, t, y) drawn from the seed, in `dtype`."""
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.in_channels, args.input_size, args.input_size, generator=g).to(dtype)
    t, y = torch.rand(args.batch, generator=g).to(dtype), torch.arange(args.batch) % 10
    with torch.no_grad():
        return theirs(x, t, y), ours(x, t, y)


def gap(a, b, scale) -> tuple[float, float]:
    """(max |a - b|, that over scale's largest magnitude)."""
    worst = float((a.double() - b.double()).abs().max())
    return worst, worst / float(scale.abs().max())


def check_forward(theirs, ours, args, dtype=torch.float32) -> tuple[float, float]:
    """(max |ours - RAE|, that over the RAE output's largest magnitude) for one batch."""
    a, b = forward_pair(theirs, ours, args, dtype)
    return gap(a, b, a)


def rae_norm_in_its_dtype(model_utils):
    """RAE's RMSNorm with its x.float() widened to float64 for float64 inputs (its formula unchanged).

    RAE's RMSNorm always normalises in float32 (x.float()), ours in float32 at least; without this a float64
    comparison would still round every normalisation to float32 on RAE's side.
    """
    def forward(self, x):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self._norm(wide).type_as(x) * self.weight

    model_utils.RMSNorm.forward = forward


def check_float64(theirs, ours, args, model_utils) -> dict:
    """The same forward in float64 (both RMSNorms too), and each float32 model's error against that reference."""
    rae32, ours32 = forward_pair(theirs, ours, args)
    rae_norm_in_its_dtype(model_utils)
    rae64, ours64 = forward_pair(theirs.double(), ours.double(), args, torch.float64)
    theirs.float(), ours.float()
    return {"float64": gap(rae64, ours64, rae64), "rae32_vs_64": gap(rae32, rae64, rae64),
            "ours32_vs_64": gap(ours32, rae64, rae64), "float32": gap(rae32, ours32, rae32)}


def check_times(transport_mod, shift, n=200_000) -> dict:
    """Same-draw gaps and quantile gaps between RAE's shifted training times and ours (both in RAE's time)."""
    out = {}
    x1 = torch.zeros(n, 1)
    for kind, ours_name in (("uniform", "uniform"), ("logit-normal_0_1", "lognormal")):
        transport = transport_mod.create_transport("Linear", "velocity", None, time_dist_type=kind,
                                                   time_dist_shift=shift)
        torch.manual_seed(1)
        t_rae, _, _ = transport.sample(x1)  # (n,) RAE time, shifted
        torch.manual_seed(1)
        base = shift_free(transport_mod, kind, n)  # the same draws before the shift
        ours_same = 1 - rae_shift(1 - base, shift)  # our shift in SiT time, read back in RAE's
        objective = make_objective("flow", {"time_dist_shift": shift}, time_sampling=ours_name)
        g = torch.Generator().manual_seed(2)
        ours_draws = 1 - torch.cat([objective.draw_time(g) for _ in range(n)])  # RAE's time
        q = torch.linspace(0.01, 0.99, 99)
        out[kind] = (float((ours_same - t_rae).abs().max()),
                     float((torch.quantile(ours_draws, q) - torch.quantile(t_rae, q)).abs().max()))
    return out


def shift_free(transport_mod, kind, n):
    """RAE's time draws of Transport.sample before its shift line, from the current global RNG state."""
    t1 = 1 - 1 / 1000  # check_interval for a velocity model on the linear path
    torch.randn(n, 1)  # Transport.sample draws its noise x0 = randn_like(x1) first
    if kind == "uniform":
        return torch.rand((n,)) * t1
    return transport_mod.transport.truncated_logitnormal_sample((n,), mu=0.0, sigma=1.0, low=0.0, high=t1)


def check_grids(integrators, shift) -> dict:
    """Max |ours - RAE| of the ODE (euler, 50 points) and SDE (50 steps, last step 0.04) time grids, RAE's time."""
    ode = integrators.ode(drift=None, t0=0, t1=1 - 1 / 1000, sampler_type="euler", num_steps=50, atol=1e-6,
                          rtol=1e-3, time_dist_shift=shift)
    sde = integrators.sde(None, None, t0=0, t1=1 - 0.04, num_steps=50, sampler_type="euler", time_dist_shift=shift)
    objective = make_objective("flow", {"time_dist_shift": shift})
    ours_sde = 1 - objective.process("sde", 50, {"time_shift": 1.0, "last_step_size": 0.04}).times
    ours_ode = 1 - flow_grid(49, 1 / shift, end=1 - 1 / 1000)
    full = 1 - objective.process("euler", 49, {"time_shift": 1.0}).times  # what `sample` walks: to t = 0
    return {"ode": float((ours_ode - ode.t.double()).abs().max()), "sde": float((ours_sde - sde.t.double()).abs().max()),
            "ode_end_rae": float(ode.t[-1]), "ode_end_ours": abs(float(full[-1])), "sde_end_rae": float(sde.t[-1]),
            "sde_end_ours": float(ours_sde[-1])}


def check_trajectory(integrators, theirs, ours, shift, args, dtype=torch.float32) -> tuple[float, float]:
    """(relative L2 gap of the final Euler samples, RAE's final sample's RMS): RAE's ode sampler vs our euler_sample,
    same grid and noise, in `dtype`."""
    g = torch.Generator().manual_seed(args.seed + 2)
    noise = torch.randn(args.batch, args.in_channels, args.input_size, args.input_size, generator=g).to(dtype)
    y = torch.arange(args.batch) % 10
    ode = integrators.ode(drift=lambda x, t, model, **kw: model(x, t, **kw), t0=0, t1=1 - 1 / 1000,
                          sampler_type="euler", num_steps=50, atol=1e-6, rtol=1e-3, time_dist_shift=shift)
    with torch.no_grad():
        a = ode.sample(noise, theirs, y=y)[-1]
        # RAE's own grid points (float32, read in SiT time as float64): only the models and the steps differ here;
        # the grids themselves are compared in check_grids.
        process = FlowProcess(FlowPath("repa"), 1 - ode.t.double(), model_times=ode.t.double())
        b = euler_sample(process, lambda x, t, **kw: ours(x, t, **kw), noise, {"y": y})
    return float((a - b).norm() / a.norm()), float(a.double().square().mean().sqrt())


def main(argv=None):
    """Run the checks and print one line each."""
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ddt, transport_mod, integrators = import_rae(Path(args.rae_repo))
    theirs, ours = build_pair(ddt, args)
    shift = args.shift
    abs_gap, rel_gap = check_forward(theirs, ours, args)
    print(f"forward {args.model} ({args.in_channels}x{args.input_size}x{args.input_size}, strict load): max |ours - "
          f"RAE| {abs_gap:.2e} ({rel_gap:.2e} of the output's largest magnitude)")
    if args.float64:  # rounding or maths? both models in float64 (RAE's RMSNorm widened to float64 as ours)
        f64 = check_float64(theirs, ours, args, sys.modules["stage2.models.model_utils"])
        print(f"forward in float64: max |ours - RAE| {f64['float64'][0]:.2e} ({f64['float64'][1]:.2e} of the output's "
              f"largest magnitude)")
        print(f"float32 against the float64 output: RAE's {f64['rae32_vs_64'][0]:.2e} ({f64['rae32_vs_64'][1]:.2e}), "
              f"ours {f64['ours32_vs_64'][0]:.2e} ({f64['ours32_vs_64'][1]:.2e})")
    for kind, (same, quant) in check_times(transport_mod, shift).items():
        print(f"training times {kind}, shift {shift:.4f}: same draws max gap {same:.2e}; 99 quantiles of 200k "
              f"independent draws max gap {quant:.2e}")
    grids = check_grids(integrators, shift)
    print(f"sampling grids, shift {shift:.4f}: ode (50 points) max gap {grids['ode']:.2e}; RAE's ode ends at t = "
          f"{grids['ode_end_rae']:.5f}, our euler at t = {grids['ode_end_ours']:.5f}; sde (50 steps, last 0.04, not "
          f"meant to match) max gap {grids['sde']:.2e}, last Euler-Maruyama point RAE t = {grids['sde_end_rae']:.4f}, "
          f"ours t = {grids['sde_end_ours']:.4f}")
    rel, rms = check_trajectory(integrators, theirs, ours, shift, args)
    print(f"euler trajectory over RAE's grid (49 steps): relative L2 gap {rel:.2e} (RAE's final sample RMS {rms:.3g})")
    if args.float64:  # the same trajectory in float64: does a float32 gap grow from rounding, or from the maths?
        rel, rms = check_trajectory(integrators, theirs.double(), ours.double(), shift, args, torch.float64)
        print(f"euler trajectory in float64: relative L2 gap {rel:.2e} (RAE's final sample RMS {rms:.3g})")


if __name__ == "__main__":
    main()

"""Our flow objective against the official SiT code (github willisma/SiT, MIT): same loss, same trajectories.

Run: .venv/bin/python tests/bench/check_sit_parity.py --sit-repo PATH_TO_A_SIT_CHECKOUT
(SiT's code is not part of this project and is never copied into it: point --sit-repo at a checkout; its
`transport` package needs torchdiffeq, which our requirements already bring.)

A random DiT-S/2 (official init, every tensor perturbed so adaLN-Zero layers are live) is the velocity model
on both sides; SiT's model returns the first C output channels, as its SiT class does with learn_sigma.
Prints, for the same (x1, t, noise), the largest relative difference of the per-sample loss, and for the same
starting noise (and, for the SDE, the same Gaussian increments: SiT draws them from torch's global generator,
ours from a generator seeded alike) the relative L2 gap of the final samples of: ODE Euler and Heun (SiT's
torchdiffeq 'euler' / 'heun2' on num_steps + 1 grid points), adaptive dopri5 (both sides on each image
alone, since ours chooses its step size per image), and the SDE (Euler-Maruyama,
diffusion "sigma", last step "Mean" 0.04), each with classifier-free guidance 4 on 3 of 4 channels.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.generative.guidance import GuidedModelFn  # noqa: E402
from shared.network.models import DiT_models, ModelConfig  # noqa: E402
from shared.generative.objectives import make_objective  # noqa: E402
from tests.bench.reference_code import perturb_  # noqa: E402


def parse_args(argv=None):
    """Check options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sit-repo", required=True, help="a checkout of github.com/willisma/SiT (its transport/ package)")
    p.add_argument("--model", choices=list(DiT_models), default="DiT-S/2", help="preset of the random velocity model")
    p.add_argument("--input-size", type=int, default=8, help="latent side")
    p.add_argument("--batch", type=int, default=4, help="samples")
    p.add_argument("--steps", type=int, default=20, help="sampling steps of the fixed-step solvers and the SDE")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, data and noise")
    return p.parse_args(argv)


def random_model(args):
    """A DiT with live (perturbed) weights in eval mode, 10 classes plus the null class."""
    torch.manual_seed(args.seed)
    model = ModelConfig(args.model, input_size=args.input_size, num_classes=10, objective="flow").build()
    return perturb_(model, trainable_only=True)


def rel(a, b) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())


def check_loss(transport, model, objective, args) -> float:
    """Largest relative per-sample loss difference for the same (x1, t, noise)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, 4, args.input_size, args.input_size)
    x1, noise, t = torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.rand(args.batch, generator=g)
    y = torch.arange(args.batch) % 10
    transport.sample = lambda data: (t, noise, data)  # SiT draws (t, x0) inside; hand it ours
    theirs = transport.training_losses(lambda x, tt, **kw: model(x, tt, **kw)[:, :4], x1, dict(y=y))["loss"]
    ours = objective.training_losses(model, x1, t, noise, dict(y=y))["loss"]
    return float(((ours - theirs).abs() / theirs.abs()).max())


def check_samplers(sampler_cls, transport, model, objective, args) -> dict:
    """Relative L2 gap of the final samples, ours vs SiT's, per sampler."""
    g = torch.Generator().manual_seed(args.seed + 2)
    noise = torch.randn(args.batch, 4, args.input_size, args.input_size, generator=g)
    y = torch.arange(args.batch) % 10
    ours_fn = GuidedModelFn(model, 4.0, 3)  # the same guided velocity function on both sides
    sit = sampler_cls(transport)
    n = args.steps
    sit_fn = lambda x, t, **kw: ours_fn(x, t, **kw)[:, :4]  # noqa: E731 - SiT's model returns C channels
    theirs = {
        "euler": lambda: sit.sample_ode(sampling_method="euler", num_steps=n + 1)(noise, sit_fn, y=y)[-1],
        "heun": lambda: sit.sample_ode(sampling_method="heun2", num_steps=n + 1)(noise, sit_fn, y=y)[-1],
        # SiT's torchdiffeq call picks one step size for its whole batch; ours one per image: SiT on each row alone.
        "dopri5": lambda: torch.cat([sit.sample_ode(sampling_method="dopri5", num_steps=2)(
            noise[i:i + 1], sit_fn, y=y[i:i + 1])[-1] for i in range(len(noise))]),
        "sde": lambda: sit.sample_sde(sampling_method="Euler", diffusion_form="sigma", last_step="Mean",
                                      last_step_size=0.04, num_steps=n)(noise, sit_fn, y=y)[-1],
    }
    gaps = {}
    for name, run_theirs in theirs.items():
        torch.manual_seed(args.seed + 3)  # SiT's SDE increments come from the global generator
        ref = run_theirs()
        gen = torch.Generator().manual_seed(args.seed + 3)  # ours from a generator seeded alike
        if name == "dopri5":  # each image alone on both sides: the network's batch rounding left out (sampling.md)
            ours = torch.cat([objective.sample(name, ours_fn, noise[i:i + 1], n, {}, model_kwargs=dict(y=y[i:i + 1]))
                              for i in range(len(noise))])
        else:
            ours = objective.sample(name, ours_fn, noise, n, {"time_shift": 1.0, "last_step_size": 0.04}
                                    if name == "sde" else {"time_shift": 1.0}, model_kwargs=dict(y=y), generator=gen)
        gaps[name] = rel(ours, ref)
    return gaps


def main(argv=None) -> None:
    """Print the loss and trajectory gaps."""
    args = parse_args(argv)
    sys.path.insert(0, str(Path(args.sit_repo).resolve()))
    from transport import Sampler, create_transport  # SiT's own code, from the checkout given

    torch.set_grad_enabled(False)
    model, objective = random_model(args), make_objective("flow")
    transport = create_transport("Linear", "velocity", None, None, None)
    print(f"SiT parity, random {args.model} at {args.input_size}x{args.input_size} latents, batch {args.batch}")
    print(f"  loss (same x1, t, noise): max relative difference {check_loss(transport, model, objective, args):.2e}")
    transport = create_transport("Linear", "velocity", None, None, None)  # undo the patched draw
    for name, gap in check_samplers(Sampler, transport, model, objective, args).items():
        print(f"  {name:7s} ({args.steps} steps, cfg 4): relative L2 gap of the samples {gap:.2e}")


if __name__ == "__main__":
    main()

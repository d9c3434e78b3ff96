"""--init-from: start a MeanFlow run from a trained flow model's weights (as the PyTorch reimplementations fine-tune
SiT-XL/2), read as `python -m sample --ckpt` reads them (shared/weights/checkpoint.py).

The checks run before the run's model exists and write nothing: a flow (or MeanFlow) source, not DDPM; the run's
latent space (shape, tokenizer, normalisation) and architecture; no DiT^DH head. The new `h_embedder`'s last linear
starts at zero, so t_emb + h_emb + y_emb equals the flow model's t_emb + y_emb bitwise and the output at any (t, r)
is the flow model's velocity exactly; improved MeanFlow's `g_embedders` start at zero too (DiT.initialize_weights),
as the paper's boundary condition u(z, t, t) = v(z, t) asks: the guidance it learns starts from none.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shared.generative.objectives import OBJECTIVES
from shared.network.models import PRESETS, ModelConfig
from shared.runtime.errors import UserError
from shared.weights.checkpoint import load_sampling_weights

# The flow samplers' families: a network of either predicts the velocity of the linear path (MeanFlow's u at
# r = t is it), so a MeanFlow run can start from it.
STARTABLE_FAMILIES = ("flow", "meanflow")
ARCHITECTURE = ("model", "input_size", "in_channels", "num_classes", "learn_sigma", "class_dropout_prob", "norm",
                "mlp", "rope", "qk_norm")


@dataclass
class InitWeights:
    """What --init-from loaded, checked against the run: the state dict, its record for config.json, its model."""
    state_dict: dict
    record: dict  # TrainConfig.init: from, file, kind, weights, step, objective, convention
    source: ModelConfig | None = None  # the model the weights were trained as (read_init fills it)


def read_init(cfg, dataset) -> InitWeights:
    """Read and check --init-from against the run's objective and latent space; UserError, nothing written."""
    if not getattr(OBJECTIVES[cfg.objective], "interval_time", False):  # MeanFlow's second time: what starts at 0
        raise UserError(f"--init-from starts a MeanFlow or improved MeanFlow run from a flow model's weights; this "
                        f"run trains the {cfg.objective} objective. Pass --objective meanflow or imf (or --recipe "
                        "meanflow or imf), or drop --init-from.")
    loaded = load_sampling_weights(cfg.init_from)
    source = loaded.config
    _check_objective(cfg.init_from, source, assumed=bool(loaded.kind == "official" and loaded.warnings))
    shape = (source.in_channels, source.input_size, source.input_size)
    problems = []  # the latent space the source was trained on, against the one --latents holds
    if shape != tuple(dataset.latent_shape):
        problems.append(f"latents of shape {shape} where --latents holds {tuple(dataset.latent_shape)}")
    vae, ours = loaded.space.source if loaded.space is not None else None, dataset.space.source
    if vae and ours and vae != ours:
        problems.append(f"the tokenizer {vae} where --latents was made with {ours}")
    if loaded.space is not None and loaded.space.norm is not None and loaded.space.norm != cfg.space.norm:
        problems.append("another latent normalisation (its recorded latent_norm differs from the one this run "
                        "resolves; see --latent-norm)")
    if problems:
        raise UserError(f"--init-from {cfg.init_from} was trained on another latent space: {'; '.join(problems)}. "
                        "Its network only knows its own latents; fine-tune it on latents extracted with the same "
                        "tokenizer, image size and normalisation, or train from scratch.")
    record = {"from": str(cfg.init_from), "file": str(loaded.path), "kind": loaded.kind, "weights": loaded.weights,
              "step": loaded.step, "objective": source.objective,
              "convention": source.objective_args.get("convention", "sit")}
    return InitWeights(loaded.state_dict, record, source)


def fit_init(init: InitWeights, run_config: ModelConfig) -> InitWeights:
    """The weights in the run's output layout, checked to be the architecture `run_config` builds; UserError."""
    state_dict, source = init.state_dict, init.source
    if source.learn_sigma and not run_config.learn_sigma:  # SiT's release: 2C outputs, the velocity in the first C
        state_dict = velocity_outputs(state_dict, source)
        source = dataclasses.replace(source, learn_sigma=False)
    diffs = [f"{k} {getattr(source, k)!r} (this run: {getattr(run_config, k)!r})" for k in ARCHITECTURE
             if getattr(source, k) != getattr(run_config, k)]
    if diffs:
        raise UserError(f"--init-from {init.record['from']} has another architecture than this run builds: "
                        f"{'; '.join(diffs)}. Pass the source's settings (e.g. --model {source.model} "
                        f"--class-dropout-prob {source.class_dropout_prob:g}, its --block options) so its weights fit.")
    return InitWeights(state_dict, init.record, source)


def velocity_outputs(state_dict: dict, source: ModelConfig) -> dict:
    """The state dict with the final linear cut to the first C of its 2C outputs per patch pixel: the velocity (a flow
    model with DiT's 2C layout, SiT's release, uses only those); rows are ordered (p, p, 2C) (DiT.unpatchify)."""
    p, c = PRESETS[source.model]["patch_size"], source.in_channels
    out = dict(state_dict)
    for name in ("final_layer.linear.weight", "final_layer.linear.bias"):
        tensor = state_dict[name]  # (p*p*2C, D) or (p*p*2C,)
        out[name] = tensor.reshape(p * p, 2 * c, *tensor.shape[1:])[:, :c].reshape(p * p * c, *tensor.shape[1:])
    return out


def _check_objective(where, source: ModelConfig, assumed: bool = False) -> None:
    """UserError unless the source learned a velocity field on the linear path (flow) or is MeanFlow already;
    assumed: a bare state dict that records no objective and is no known release was read as DDPM (DiT's)."""
    if source.head_depth:
        raise UserError(f"--init-from {where} is a DiT^DH model ({source.model}, a {source.head_depth}-block head); "
                        "MeanFlow's second time embedding and its JVP target are supported on the plain DiT only. "
                        "Start from a DiT-* flow model (a SiT or REPA release, or a --recipe sit run).")
    startable = source.objective in OBJECTIVES and OBJECTIVES[source.objective].family in STARTABLE_FAMILIES
    if not startable and assumed:
        raise UserError(f"--init-from {where} is a bare state dict that records no objective and is no known release, "
                        "so it reads as DiT's DDPM (epsilon-prediction) model, which MeanFlow cannot start from. If it "
                        "is a SiT or REPA flow model, pass the release's file under its name (SiT-XL-2-256x256.pt, "
                        "REPA-SiT-XL-2-256x256.pt) or one of this project's exports, which record their objective.")
    if not startable:
        what = "a DDPM (epsilon-prediction) model" if source.objective == "ddpm" else f"a {source.objective} model"
        raise UserError(f"--init-from {where} is {what}; MeanFlow starts from a network that predicts the flow's "
                        "velocity on the linear path, which its identity extends (u = v at r = t). An epsilon network "
                        "predicts another quantity on another noise schedule. Start from a flow model (a SiT or REPA "
                        "release, or a run trained with --recipe sit / --objective flow), or train MeanFlow from "
                        "scratch without --init-from.")


def apply_init(dit: torch.nn.Module, ema: torch.nn.Module, init: InitWeights) -> None:
    """Load the source weights into the fresh DiT and its EMA; a new h_embedder's last linear is zeroed. Every source
    tensor must be used and every model tensor filled, but the interval embedder a flow model lacks."""
    missing, unexpected = dit.load_state_dict(init.state_dict, strict=False)
    # g_embedders (improved MeanFlow's guidance) keep their fresh init: its last linear is zero (DiT.initialize_weights)
    new = {k for k in missing if k.startswith(("h_embedder.", "g_embedders."))}
    if unexpected or set(missing) - new:
        raise UserError(f"--init-from {init.record['from']}: its tensors do not fit this model (missing "
                        f"{sorted(set(missing) - new)[:4]}, unexpected {sorted(unexpected)[:4]}); use a DiT weight "
                        "file of the same preset.")
    if any(k.startswith("h_embedder.") for k in new):
        with torch.no_grad():
            last = dit.h_embedder.mlp[-1]
            last.weight.zero_()  # h_emb = 0 at every input: the flow model's conditioning, bitwise
            last.bias.zero_()
    ema.load_state_dict(dit.state_dict(), strict=True)  # copied into the EMA's own device and dtype

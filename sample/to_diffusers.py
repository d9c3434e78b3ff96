"""`python -m sample export RUN --format diffusers OUT`: a DiTPipeline folder that diffusers loads and runs.

    OUT/model_index.json                         DiTPipeline: transformer, vae, scheduler (+ id2label with 1000 names)
    OUT/transformer/config.json + diffusion_pytorch_model.safetensors   DiTTransformer2DModel
    OUT/vae/                                     a copy of the VAE the latents were made with
    OUT/scheduler/scheduler_config.json          DDIMScheduler with DiT's betas (linear 1e-4 -> 0.02, 1000 steps)
    OUT/README.md                                where the weights came from, and the numerics note

The folder is written under a temp name and renamed when complete. diffusers' DiTPipeline hard-codes what
it cannot be told: the unconditional label is the literal 1000 (so only 1000-class models with a null-class
row guide correctly) and guidance applies to every latent channel; the first is refused, the second noted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.runtime.cli import option
from shared.network.diffusers_dit import NUMERICS_NOTE, dit_to_diffusers, diffusers_config
from shared.generative.diffusion import NUM_TIMESTEPS, linear_betas
from shared.runtime.errors import UserError
from shared.sampling.flags import ALLOW_OTHER_VAE, VAE, VAE_CONFIG
from shared.runtime.fsio import atomic_write_text, publish_dir, remove_tree, tmp_name
from shared.network.models import ModelConfig
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace, choose_tokenizer

from shared.weights.checkpoint import WEIGHTS, LoadedWeights, load_sampling_weights

EXPORT_FORMATS = ("diffusers",)
PIPELINE_NULL_LABEL = 1000  # DiTPipeline.__call__ writes its unconditional label as this literal
README_NAME = "README.md"


@dataclass
class ToDiffusersOptions:
    """Everything `python -m sample export` accepts (one field per argument: its default and help)."""
    ckpt: str = option(help="the weights, as sampling's --ckpt takes them: a run folder (newest EMA export), a "
                            "checkpoint folder, a .safetensors export, an official .pt, or a diffusers DiT",
                       positional=True, metavar="RUN|FILE")
    out: str = option(help="the folder to write; refused if it exists (an empty folder is fine)", positional=True,
                      metavar="OUT")
    format: str = option("diffusers", "output layout (diffusers: a DiTPipeline folder)", choices=EXPORT_FORMATS)
    weights: str | None = option(None, "with a run or checkpoint folder: the EMA weights or the raw training weights "
                                       "(default: ema)", choices=WEIGHTS)
    vae: str | None = VAE.field(help="VAE copied into OUT/vae (same forms as sampling's --vae). Default: the VAE "
                                     "recorded in the weights' latent metadata, else ema")
    vae_config: str | None = VAE_CONFIG.field()
    allow_other_vae: bool = ALLOW_OTHER_VAE.field(help="copy a VAE whose scaling factor or config differs from the "
                                                       "one recorded with the latents (its configured scaling factor "
                                                       "is set to the one used in training)")


def check_representable(config: ModelConfig, where) -> None:
    """UserError for a model DiTPipeline cannot run as trained (DDPM, the DiT block, the null label 1000)."""
    if config.objective != "ddpm":
        raise UserError(f"{where} was trained with the {config.objective} objective, but diffusers' DiTPipeline "
                        f"runs a DDPM noise-prediction model (its schedulers step on predicted noise at DiT's "
                        f"1000 timesteps), so this model cannot be exported as a DiTPipeline: it would produce noise, "
                        f"not images. Sample it with `python -m sample --ckpt ...`, which reads its objective.")
    if config.block != "dit":
        raise UserError(f"{where} uses the {config.block} block ({config.block_options}), but diffusers' "
                        f"DiTTransformer2DModel only has the official DiT block (LayerNorm, GELU MLP, no RoPE or "
                        f"QK-norm), so it would run a different function. Sample it with `python -m sample --ckpt "
                        f"...`, or train with --block dit to export to diffusers.")
    if not config.has_null_class:
        raise UserError(f"{where} was trained without label dropout, so it has no null-class embedding; diffusers' "
                        f"DiTTransformer2DModel always has one and DiTPipeline guides against it, so this model "
                        f"cannot be exported to diffusers. Sample it with `python -m sample --ckpt ... --cfg-scale 1`.")
    if config.num_classes != PIPELINE_NULL_LABEL:
        raise UserError(f"{where} has {config.num_classes} classes, so its null class is label "
                        f"{config.num_classes}, but diffusers' DiTPipeline hard-codes the unconditional label as "
                        f"{PIPELINE_NULL_LABEL} (ImageNet's): guided sampling would index a class embedding that "
                        f"does not exist, or the wrong one. Only 1000-class models can be exported to diffusers; "
                        f"sample this one with `python -m sample --ckpt ...`.")


def _readme(loaded: LoadedWeights, vae_source: str, vae_note: str | None) -> str:
    """OUT/README.md: provenance, how to load it, and what differs from the official sampler."""
    step = f" (step {loaded.step})" if loaded.step is not None else ""
    lines = [f"# {loaded.config.model} as a diffusers DiTPipeline", "",
             f"Exported by `python -m sample export` from `{loaded.path}`{step}, {loaded.kind} weights "
             f"({loaded.weights}). VAE: a copy of `{vae_source}`.", "",
             "```python", "from diffusers import DiTPipeline", "pipe = DiTPipeline.from_pretrained('THIS_FOLDER')",
             "images = pipe(class_labels=[0, 1], num_inference_steps=50).images", "```", "",
             f"Model: `{json.dumps(loaded.config.to_dict())}`.", "", "## Numerics", "",
             NUMERICS_NOTE + " This export sets norm_eps 1e-6, so in diffusers only the timestep features differ "
             "from the function the weights were trained as; `python -m sample --ckpt THIS_FOLDER` runs them as "
             "the official DiT.", "",
             "DiTPipeline also guides every latent channel, where the DiT release guides the first 3 of 4 "
             "(`python -m sample --guide-channels`), and its scheduler is DDIM with DiT's linear betas (learned "
             "variance unused); DiT's own results use 250 DDPM steps with the learned variance."]
    if vae_note:
        lines += ["", f"VAE: {vae_note}."]
    return "\n".join(lines) + "\n"


def _build_pipeline(loaded: LoadedWeights, vae):
    """A DiTPipeline holding our weights in diffusers' layout (strict load: every tensor placed)."""
    from accelerate import init_empty_weights
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    names = loaded.space.class_names if loaded.space is not None else ()  # id2label: all the names recorded, or none
    id2label = ({str(i): str(n) for i, n in enumerate(names)} if names and len(names) == loaded.config.num_classes
                else None)
    with init_empty_weights():  # no random init of parameters that are replaced anyway (675M for XL/2)
        transformer = DiTTransformer2DModel(**diffusers_config(loaded.config))
    transformer.load_state_dict(dit_to_diffusers(loaded.state_dict), strict=True, assign=True)
    betas = linear_betas(NUM_TIMESTEPS)  # DiT's: linear 1e-4 -> 0.02 over 1000 steps
    # clip_sample off and alpha_bar = 1 after the last step, as the DiT release's samplers (clip_denoised=False);
    # "leading" spacing gives the release's DDIM stride range(0, 1000, 1000 // N).
    scheduler = DDIMScheduler(num_train_timesteps=NUM_TIMESTEPS, beta_start=float(betas[0]), beta_end=float(betas[-1]),
                              beta_schedule="linear", clip_sample=False, set_alpha_to_one=True, steps_offset=0,
                              prediction_type="epsilon", timestep_spacing="leading")
    pipeline = DiTPipeline(transformer=transformer.eval(), vae=vae, scheduler=scheduler, id2label=id2label)
    if id2label:  # DiTPipeline reads id2label from model_index.json but does not record it there itself
        pipeline.register_to_config(id2label=id2label)
    return pipeline


def run_to_diffusers(o: ToDiffusersOptions) -> Path:
    """The whole `export` command: checks first (target, format, model, VAE), then build, write, rename."""
    assert o.format in EXPORT_FORMATS, o.format  # a flag choice
    out = Path(o.out).expanduser()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):  # an empty folder is fine
        raise UserError(f"the export target {out} already exists; an export never overwrites. Pass a new folder "
                        f"name as OUT, or delete {out} first if it is an old export you no longer need.")
    loaded = load_sampling_weights(o.ckpt, o.weights)
    space = LatentSpace.or_unknown(loaded.space, loaded.config.in_channels)
    if (norm := space.norm) is not None and norm.kind != "scale":  # DiTPipeline only divides by scaling_factor
        raise UserError(f"{loaded.path} was trained on latents normalised as {norm.describe()} (train --latent-norm), "
                        f"but diffusers' DiTPipeline only divides its latents by the VAE's scaling_factor before "
                        f"decoding, so the exported pipeline would decode wrongly shifted or scaled latents into wrong "
                        f"colours or noise. Sample this model with `python -m sample --ckpt ...`, which inverts the "
                        f"recorded normalisation, or train with --latent-norm scale to export to diffusers.")
    check_representable(loaded.config, loaded.path)
    spec, how = choose_tokenizer(o.vae, loaded.space)
    vae_name, _ = space.check_tokenizer_config(spec, o.vae_config, o.allow_other_vae)
    vae = load_tokenizer(vae_name, "cpu", config=o.vae_config)
    norm, note = space.check_loaded(vae, o.allow_other_vae)
    if norm.scale != vae.scaling_factor:  # DiTPipeline divides by its VAE's configured factor: the training one
        vae.vae.register_to_config(scaling_factor=norm.scale)
    pipeline = _build_pipeline(loaded, vae.vae)
    staging = tmp_name(out)  # save_pretrained into a temp folder beside OUT, then renamed to OUT
    if staging.exists():
        remove_tree(staging)
    try:
        pipeline.save_pretrained(staging, safe_serialization=True)
        atomic_write_text(staging / README_NAME, _readme(loaded, vae_name, note))
        written = publish_dir(staging, out)
    finally:
        if staging.exists():
            remove_tree(staging)
    for line in loaded.warnings:
        print(f"note: {line}")
    print(f"wrote a diffusers DiTPipeline ({loaded.config.model}, VAE {vae_name} {how}) to {written}")
    return written

"""diffusers' DiT weight layout <-> ours (the official DiT names): an exact mapping both ways, and its checks.

diffusers (`DiTTransformer2DModel`, and the older `Transformer2DModel` config with `norm_type: ada_norm_zero`
that the Hub's facebook/DiT-XL-2-* pipelines carry) stores the same tensors under other names:

    ours (official release)                 diffusers
    x_embedder.proj.{weight,bias}           pos_embed.proj.{weight,bias}
    pos_embed (fixed sin-cos, saved)        not saved: recomputed from the grid size
    t_embedder.mlp.{0,2}.*                  transformer_blocks.N.norm1.emb.timestep_embedder.linear_{1,2}.*
    y_embedder.embedding_table.weight       transformer_blocks.N.norm1.emb.class_embedder.embedding_table.weight
    blocks.N.adaLN_modulation.1.*           transformer_blocks.N.norm1.linear.*
    blocks.N.attn.qkv.* (rows q; k; v)      transformer_blocks.N.attn1.to_{q,k,v}.*
    blocks.N.attn.proj.*                    transformer_blocks.N.attn1.to_out.0.*
    blocks.N.mlp.fc1.* / fc2.*              transformer_blocks.N.ff.net.0.proj.* / ff.net.2.*
    final_layer.{adaLN_modulation.1,linear}.*  proj_out_{1,2}.*

diffusers keeps a copy of the timestep and class embedders in every block (the final layer uses block 0's), which
must be equal: the official DiT has one. The two forwards differ on the same weights (NUMERICS_NOTE); loading gives
the official function, which the Hub's weights were trained as.
"""
from __future__ import annotations

import inspect

import torch

from shared.runtime.errors import UserError
from shared.network.dit import sincos_2d
from shared.network.models import PRESETS, ModelConfig

DIFFUSERS_DIT_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")
OFFICIAL_NORM_EPS = 1e-6  # every LayerNorm of the official DiT (shared/network/models.py DiTBlock)

NUMERICS_NOTE = (
    "diffusers' DiT forward is not the official DiT function on the same weights: its timestep features use "
    "downscale_freq_shift=1 (frequencies 10000^(-i/127) instead of the official 10000^(-i/128)) and, with its "
    "default norm_eps 1e-5, the LayerNorm before each MLP differs from the official eps 1e-6.")

# Our per-block names -> diffusers' per-block names (the fused qkv and the embedder copies are handled apart).
_BLOCK_NAMES = {"adaLN_modulation.1": "norm1.linear", "attn.proj": "attn1.to_out.0", "mlp.fc1": "ff.net.0.proj",
                "mlp.fc2": "ff.net.2"}
_TOP_NAMES = {"x_embedder.proj": "pos_embed.proj", "final_layer.adaLN_modulation.1": "proj_out_1",
              "final_layer.linear": "proj_out_2"}
# The embedder copies every diffusers block holds: our tensor -> its name inside transformer_blocks.N.norm1.emb.
_EMBEDDERS = {**{f"t_embedder.mlp.{i}.{p}": f"timestep_embedder.linear_{j}.{p}" for i, j in ((0, 1), (2, 2))
                 for p in ("weight", "bias")},
              "y_embedder.embedding_table.weight": "class_embedder.embedding_table.weight"}
_QKV = ("to_q", "to_k", "to_v")
_PARAMS = ("weight", "bias")


def _name_pairs(depth: int):
    """(our tensor name, its diffusers names: one, or the fused qkv's q, k, v rows), an embedder once per block."""
    for ours, theirs in _TOP_NAMES.items():
        yield from ((f"{ours}.{param}", (f"{theirs}.{param}",)) for param in _PARAMS)
    for n in range(depth):
        for ours, theirs in _EMBEDDERS.items():
            yield ours, (f"transformer_blocks.{n}.norm1.emb.{theirs}",)
        for ours, theirs in _BLOCK_NAMES.items():
            yield from ((f"blocks.{n}.{ours}.{p}", (f"transformer_blocks.{n}.{theirs}.{p}",)) for p in _PARAMS)
        for param in _PARAMS:  # fused projection: rows [q; k; v], each (D, D) / (D,)
            yield f"blocks.{n}.attn.qkv.{param}", tuple(f"transformer_blocks.{n}.attn1.{p}.{param}" for p in _QKV)


# --- Configs ---

def full_config(config: dict) -> dict:
    """A diffusers DiT config with every absent key filled by the default of the class diffusers builds from it."""
    import diffusers

    name = config["_class_name"]
    if name == "Transformer2DModel" and config.get("norm_type") == "ada_norm_zero":
        # diffusers builds it as a DiTTransformer2DModel (_CLASS_REMAPPING_DICT), whose defaults then apply.
        name = "DiTTransformer2DModel"
    defaults = {key: p.default for key, p in inspect.signature(getattr(diffusers, name).__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **config}


def check_dit_config(config: dict, where) -> dict:
    """The full config of a diffusers DiT transformer; UserError naming what makes it another architecture."""
    name = config.get("_class_name")
    if name not in DIFFUSERS_DIT_CLASSES:
        raise UserError(f"{where} holds a diffusers {name or 'model without a _class_name'}, not a DiT transformer "
                        f"({' or '.join(DIFFUSERS_DIT_CLASSES)} with norm_type ada_norm_zero). Pass a DiT: a "
                        f"DiTPipeline folder (transformer/, vae/, scheduler/), its transformer/ folder, or a run "
                        f"folder or weight file of this project.")
    full = full_config(config)
    # (key, value the DiT architecture needs, why) for each setting that changes the weights' meaning.
    needed = [("norm_type", "ada_norm_zero", "adaLN-Zero conditioning"), ("activation_fn", "gelu-approximate",
              "tanh-approximated GELU"), ("attention_bias", True, "biased q/k/v projections"),
              ("norm_elementwise_affine", False, "LayerNorms without affine parameters"),
              ("cross_attention_dim", None, "no cross-attention"), ("only_cross_attention", False, "self-attention"),
              ("double_self_attention", False, "one attention per block"),
              ("num_vector_embeds", None, "continuous latents")]
    wrong = [f"{key}={full.get(key)!r} (DiT: {want!r}, {why})" for key, want, why in needed
             if key in full and full[key] != want]
    wrong += [f"{key}=None ({why})" for key, why in (("patch_size", "DiT works on patches"),
                                                     ("num_embeds_ada_norm", "DiT is class-conditional"))
              if full.get(key) is None]
    if wrong:
        raise UserError(f"{where} is a diffusers {name} but not a DiT: {'; '.join(wrong)}. Only the DiT "
                        f"layout (DiTTransformer2DModel, or Transformer2DModel with norm_type ada_norm_zero) maps "
                        f"to this project's model.")
    return full


def dit_kwargs(config: dict) -> dict:
    """DiT(...) keyword arguments equivalent to a checked diffusers DiT config."""
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    in_channels = int(config["in_channels"])
    out_channels = int(config["out_channels"] or in_channels)
    if out_channels not in (in_channels, 2 * in_channels):
        raise UserError(f"the diffusers DiT predicts {out_channels} channels for {in_channels} input channels "
                        f"(DiT: equal, or double with learned variance); it cannot be sampled as a DiT.")
    return dict(input_size=int(config["sample_size"]), patch_size=int(config["patch_size"]),
                in_channels=in_channels, hidden_size=heads * head_dim, depth=int(config["num_layers"]),
                num_heads=heads, num_classes=int(config["num_embeds_ada_norm"]),
                learn_sigma=out_channels == 2 * in_channels)


def model_config_of(config: dict, where) -> ModelConfig:
    """The ModelConfig (a preset of DiT_models) of a checked diffusers DiT config; UserError if none fits."""
    kw = dit_kwargs(config)
    arch = {k: kw[k] for k in ("depth", "hidden_size", "patch_size", "num_heads")}
    name = next((n for n, p in PRESETS.items() if {k: p[k] for k in arch} == arch), None)
    if name is None:
        raise UserError(f"the diffusers DiT in {where} has {kw['depth']} layers, {kw['num_heads']} heads x "
                        f"{kw['hidden_size'] // kw['num_heads']} channels and patch {kw['patch_size']}, which match "
                        f"no preset in DiT_models ({', '.join(PRESETS)}). Only preset architectures can be sampled.")
    # diffusers always builds the null-class row (its LabelEmbedding has DiT's dropout: the default), so guidance works.
    return ModelConfig(name, **{k: kw[k] for k in ("input_size", "in_channels", "num_classes", "learn_sigma")})


def diffusers_config(config: ModelConfig) -> dict:
    """The DiTTransformer2DModel config of one of our models (LayerNorm eps as official: 1e-6)."""
    arch = PRESETS[config.model]
    return {"num_attention_heads": arch["num_heads"], "attention_head_dim": arch["hidden_size"] // arch["num_heads"],
            "in_channels": config.in_channels, "out_channels": config.in_channels * (2 if config.learn_sigma else 1),
            "num_layers": arch["depth"], "dropout": 0.0, "attention_bias": True, "sample_size": config.input_size,
            "patch_size": arch["patch_size"], "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": config.num_classes, "upcast_attention": False, "norm_type": "ada_norm_zero",
            # diffusers' default is 1e-5; 1e-6 makes its pre-MLP LayerNorm the official one.
            "norm_elementwise_affine": False, "norm_eps": OFFICIAL_NORM_EPS}


# --- Weights ---

def diffusers_to_dit(state_dict: dict, config: dict, where) -> dict:
    """A diffusers DiT state dict (checked config) -> our state dict, pos_embed recomputed; exact copies."""
    kw = dit_kwargs(config)
    depth = kw["depth"]
    expected = {name for _, theirs in _name_pairs(depth) for name in theirs}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        parts = [f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in
                 (("tensors a DiT needs are missing", missing), ("tensors are not part of a DiT", unexpected)) if keys]
        raise UserError(f"the weights in {where} do not fit their DiT config ({depth} layers): {'; '.join(parts)}. "
                        f"The folder is damaged or mixed from two models; download or export it again.")
    for theirs in _EMBEDDERS.values():  # every block's embedder copy must equal block 0's, bit for bit
        first = state_dict[f"transformer_blocks.0.norm1.emb.{theirs}"]
        for n in range(1, depth):
            other = state_dict[f"transformer_blocks.{n}.norm1.emb.{theirs}"]
            if other.shape != first.shape or not torch.equal(other, first):
                diff = (other.float() - first.float()).abs().max().item() if other.shape == first.shape else "n/a"
                raise UserError(
                    f"the diffusers DiT in {where} has unequal per-block copies of its "
                    f"{theirs.split('.')[0].replace('_', ' ')}: transformer_blocks.{n}.norm1.emb.{theirs} "
                    f"differs from block 0's (max |difference| {diff}). The official DiT, which this project "
                    f"runs, has one embedder shared by all blocks, so no such model computes what these weights "
                    f"compute (they were trained or edited with the copies apart, e.g. fine-tuned in diffusers). "
                    f"Use weights whose copies are equal, such as the Hub's facebook/DiT-XL-2-* or any "
                    f"conversion of an official checkpoint.")
    out = {}
    for ours, theirs in _name_pairs(depth):  # an embedder: block 0's copy (all are equal, checked above)
        out.setdefault(ours, torch.cat([state_dict[k] for k in theirs]) if len(theirs) > 1 else state_dict[theirs[0]])
    # As DiT.initialize_weights: float64 sin-cos cast to float32, so the tensor equals a freshly built model's.
    out["pos_embed"] = sincos_2d(kw["hidden_size"], kw["input_size"] // kw["patch_size"]).float()[None]  # (1, T, D)
    return out


def dit_to_diffusers(state_dict: dict) -> dict:
    """Our state dict -> diffusers' layout: q/k/v split, embedders copied into every block, pos_embed dropped."""
    depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    out = {}
    for ours, theirs in _name_pairs(depth):
        # Separate copies: diffusers holds one parameter per block (and safetensors refuses shared storage).
        for name, part in zip(theirs, state_dict[ours].chunk(len(theirs), dim=0)):  # qkv: 3 x (D, D) / (D,)
            out[name] = part.clone()
    return out

"""DiT presets, ModelConfig (what rebuilds a model: dit.py's DiT, ddt.py's DiT^DH), and the config read back from a
state dict's tensors."""
import contextlib
import functools
import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields

import torch

from shared.generative.objectives import DEFAULT_OBJECTIVE, objective_of, plugin_of, recorded_args
from shared.generative.samplers import check_recorded
from shared.network.blocks import BLOCK_FIELDS, BLOCKS, block_name, block_plugins, check_block_options, infer_block
from shared.network.ddt import DiTDH, check_head
from shared.network.dit import CLASS_DROPOUT_PROB, DiT
from shared.runtime.errors import ChoiceError, SettingError, UserError


def compile_blocks(model: torch.nn.Module, backend="inductor", **options) -> torch.nn.Module:
    """Regional compilation: each of `model.blocks` compiled in place; returns `model` (training and sampling)."""
    # One class, so dynamo compiles their forward once and reuses it for every block (a DiT^DH head: one more).
    for block in model.blocks:
        block.compile(backend=backend, **options)
    return model


PRESETS = {
    f"DiT-{size}/{patch}": dict(depth=depth, hidden_size=width, patch_size=patch, num_heads=heads)
    for size, depth, width, heads in [("XL", 28, 1152, 16), ("L", 24, 1024, 16), ("B", 12, 768, 12),
                                      ("S", 12, 384, 6)]
    # Patch 1 for latents of 16x16 or smaller (f16 / f32 tokenizers); LightningDiT-XL/1 is DiT-XL's shape at patch 1
    for patch in (1, 2, 4, 8)
}
# Tiny, for tests and the CPU demo (no official size): 4.0M parameters in 6 blocks, 4.4M in all (1000 classes, 256 px).
PRESETS.update({f"DiT-T/{patch}": dict(depth=6, hidden_size=192, patch_size=patch, num_heads=3) for patch in (2, 1)})

# DiT^DH (RAE, bytetriper/RAE configs/stage2/training/ImageNet256/DiTDH-{S,XL}_DINOv2-B.yaml): a DiT-S or DiT-XL
# body at patch 1, 2 head blocks of width 2048, 16 heads, RAE's (lightning) block by default. DiTDH-T: ours, tiny.
HEAD_FIELDS = ("head_depth", "head_width", "head_heads")
RAE_HEAD = dict(head_depth=2, head_width=2048, head_heads=16)
PRESETS["DiTDH-S"] = dict(depth=12, hidden_size=384, patch_size=1, num_heads=6, **RAE_HEAD)
PRESETS["DiTDH-XL"] = dict(depth=28, hidden_size=1152, patch_size=1, num_heads=16, **RAE_HEAD)
PRESETS["DiTDH-T"] = dict(depth=4, hidden_size=192, patch_size=1, num_heads=3, head_depth=2, head_width=384,
                          head_heads=6)
DEFAULT_BLOCKS = {name: "lightning" for name in PRESETS if name.startswith("DiTDH-")}  # else "dit"


def preset_head(name: str) -> dict:
    """{head_depth, head_width, head_heads} of a preset (all 0 for the plain DiT presets)."""
    return {k: PRESETS[name].get(k, 0) for k in HEAD_FIELDS}


def default_block(name: str) -> str:
    """The BLOCKS name a preset is built with when no block option is given (DiT's, RAE's for DiTDH-*)."""
    return DEFAULT_BLOCKS.get(name, "dit")


def build_model(name: str, **kwargs):
    """Preset `name` with `kwargs` overriding its architecture; a head (head_depth > 0) makes it a DiT^DH."""
    arch = {**PRESETS[name], **kwargs}
    if arch.get("head_depth", 0):
        return DiTDH(**arch)
    return DiT(**{k: v for k, v in arch.items() if k not in HEAD_FIELDS})


DiT_models = {name: functools.partial(build_model, name) for name in PRESETS}


def token_width_problem(model: str, in_channels: int, head: dict | None = None) -> str | None:
    """Why the preset (with `head`) is too narrow for tokens of in_channels x patch^2 values, or None."""
    # RAE Sec. 4.1: the stage that predicts the output (the head, if any) must be at least as wide as a token.
    arch = PRESETS[model]
    head = head or preset_head(model)
    token = in_channels * arch["patch_size"] ** 2
    width = head["head_width"] if head.get("head_depth") else arch["hidden_size"]
    if width >= token:
        return None
    where = f"its head of width {width}" if head.get("head_depth") else f"width {width}"
    return (f"{model} with {where} is narrower than the tokens it would predict: {in_channels} latent channels x "
            f"patch {arch['patch_size']}^2 = {token} values per token. RAE (Zheng et al. 2025, Sec. 4.1) shows such "
            f"a transformer cannot fit the latents; add the wide shallow DiT^DH head ({{head depth}} 2 "
            f"{{head width}} 2048 {{head heads}} 16, as RAE), or use a DiTDH preset (DiTDH-S, DiTDH-XL), or a preset "
            f"at least {token} wide.")


def check_preset(name: str) -> None:
    """ChoiceError unless `name` is a key of DiT_models."""
    if name not in DiT_models:
        raise ChoiceError("model preset", name, list(DiT_models))


OBJECTIVE_FIELDS = ("objective", "objective_args", "plugins", "sampling")  # not the network: build() skips them


@dataclass
class ModelConfig:
    """Everything needed to rebuild a DiT; written into every checkpoint and export."""

    # Block options and head default to the preset's, so configs written before they existed load as trained.
    model: str
    input_size: int
    in_channels: int = 4
    num_classes: int = 1000
    learn_sigma: bool = True
    class_dropout_prob: float = CLASS_DROPOUT_PROB
    norm: str | None = None  # None: the preset's block (default_block)
    mlp: str | None = None
    rope: bool | None = None
    qk_norm: bool | None = None
    # The DiT^DH head (shared/network/ddt.py): blocks, width and attention heads; None: the preset's (0 = none).
    head_depth: int | None = None
    head_width: int | None = None
    head_heads: int | None = None
    # `h_embedder` for the interval length t - r of MeanFlow's (t, t - r) (generative/meanflow.py); False: none.
    interval_time: bool = False
    # Embedders for improved MeanFlow's 1 - 1/w, t_min, t_max (generative/imf.py), time columns 3-5; False: none.
    guidance_inputs: bool = False
    # What it was trained to predict (generative/objectives.py) and its recorded fields; not architecture.
    objective: str = DEFAULT_OBJECTIVE
    objective_args: dict = field(default_factory=dict)
    # The --plugin modules registering its objective and block options: recorded so a stage without them names them.
    plugins: list = field(default_factory=list)
    # How it samples unless told otherwise, in python -m sample's flag names ({"time_shift": 0.3, ...}); {}: default.
    sampling: dict = field(default_factory=dict)

    def __post_init__(self):
        check_preset(self.model)
        preset = {**BLOCKS[default_block(self.model)], **preset_head(self.model)}
        for name in (*BLOCK_FIELDS, *HEAD_FIELDS):
            if getattr(self, name) is None:
                setattr(self, name, preset[name])
        try:  # the objective, once it and the block options are found registered; else name a recorded plugin
            check_block_options(self.block_options)
            objective = objective_of(self)
        except UserError as err:
            missing = [m for m in self.plugins if m not in sys.modules]
            if not missing:
                raise
            lacking = f"the {err.setting} {err.value!r}" if isinstance(err, ChoiceError) else "part of them"
            raise UserError(f"these weights were made with the module(s) {', '.join(missing)} (recorded with the model), "
                            f"which register(s) {lacking}; pass {' '.join(f'--plugin {m}' for m in missing)} so it is "
                            "imported (its folder on PYTHONPATH).") from err
        check_head(self.head_depth, self.head_width, self.head_heads)
        if self.model in DEFAULT_BLOCKS and not self.head_depth:
            raise SettingError(f"{self.model} is a DiT^DH preset but {{head depth}} is 0; use a DiT preset for a "
                               "model without the head.")
        if self.interval_time and self.head_depth:
            raise SettingError(f"{self.model} has a DiT^DH head, which has no second time embedding here (MeanFlow's "
                               "t - r is embedded by the plain DiT only; the JVP through the head is not supported). "
                               "Train the meanflow objective on a DiT-* preset (e.g. DiT-XL/2, the paper's backbone).")
        # The interval (and guidance) embedders exactly when its objective feeds them.
        for field_name, words in (("interval_time", "the interval time embedder"),
                                  ("guidance_inputs", "the guidance embedders")):
            has, want = getattr(self, field_name), bool(getattr(objective, field_name, False))
            if has != want:
                raise SettingError(f"the model config {'has' if has else 'lacks'} {words} ({field_name} {has}), but "
                                   f"its objective {self.objective} {'feeds' if want else 'does not feed'} the network "
                                   "those inputs; the two are written together, so these weights were edited by hand. "
                                   "Re-export them with this version.")
        self.objective_args = recorded_args(objective)  # every recorded field (defaults too): equal models, equal configs
        self.plugins = sorted({plugin_of(self.objective), *block_plugins(self.block_options)} - {""})
        self.sampling = {k: list(v) if isinstance(v, tuple) else v for k, v in self.sampling.items()}  # as JSON reads
        check_recorded(self.sampling, objective.family, "the model config")

    @property
    def has_null_class(self) -> bool:
        """Whether the model has a null-class embedding to guide against (trained with label dropout)."""
        return self.class_dropout_prob > 0

    @property
    def block(self) -> str:
        """The BLOCKS preset of this config's block options, or "custom"."""
        return block_name(self.to_dict())

    @property
    def block_options(self) -> dict:
        """{norm, mlp, rope, qk_norm}."""
        return {k: getattr(self, k) for k in BLOCK_FIELDS}

    @property
    def head(self) -> dict:
        """{head_depth, head_width, head_heads} (all 0 without the DiT^DH head)."""
        return {k: getattr(self, k) for k in HEAD_FIELDS}

    def build(self, attention="auto", grad_checkpoint_every=0, device=None, init=True):
        """The DiT (a DiT^DH with a head) on `device`; init=False: zero-filled weights, no initialisation (measuring)."""
        # interval_time / guidance_inputs passed only when set: a DiT^DH takes no such argument (__post_init__)
        kwargs = {k: v for k, v in self.to_dict().items() if k not in ("model", *OBJECTIVE_FIELDS)
                  and (v or k not in ("interval_time", "guidance_inputs"))}
        kwargs.update(attention=attention, grad_checkpoint_every=grad_checkpoint_every)
        if init or str(device) == "meta":
            with torch.device(device) if device is not None else contextlib.nullcontext():
                return build_model(self.model, **kwargs)
        with torch.device("meta"):
            model = build_model(self.model, **kwargs)
        model = model.to_empty(device=device or "cpu")
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                tensor.zero_()
        return model

    def to_dict(self):
        """Plain JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild from to_dict() output; UserError on missing or unknown keys (absent block options are DiT's)."""
        d = dict(d)
        unknown, missing = sorted(set(d) - {f.name for f in fields(cls)}), sorted({"model", "input_size"} - set(d))
        if unknown or missing:
            raise UserError(f"model config {d} has unknown keys {unknown} / lacks keys {missing}; it was "
                            "written by an incompatible version. Re-export the weights with this version.")
        return cls(**d)


def _shape(state_dict, key):
    """Shape of a required tensor, or a UserError saying the weights are not a DiT state dict."""
    if key not in state_dict:
        raise UserError(f"these weights have no {key!r} tensor, so they are not a DiT state dict (official "
                        "DiT checkpoint or this project's export); use a DiT weight file.")
    return tuple(state_dict[key].shape)


def _infer_architecture(state_dict):
    """Read depth, width, patch, channels, input size, block options and label rows from tensors."""
    width, in_channels, patch, _ = _shape(state_dict, "x_embedder.proj.weight")
    tokens = _shape(state_dict, "pos_embed")[1]
    grid = math.isqrt(tokens)
    depth = len({m.group(1) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k))})
    block = infer_block(state_dict) if depth else dict(BLOCKS["dit"])
    return dict(depth=depth, hidden_size=width, patch_size=patch, in_channels=in_channels, input_size=grid * patch,
                square=grid * grid == tokens, **block,
                out_channels=_shape(state_dict, "final_layer.linear.weight")[0] // (patch * patch),
                label_rows=_shape(state_dict, "y_embedder.embedding_table.weight")[0])


def infer_model_config(state_dict, class_dropout_prob=CLASS_DROPOUT_PROB):
    """Recover the ModelConfig of a DiT (or DiT^DH) state dict from its tensor shapes; UserError if no preset fits."""
    # Shapes cannot tell a null-class row: as official, the last row is one unless class_dropout_prob is 0.
    rae = "s_embedder.proj.weight" in state_dict  # RAE's DiTwDDTHead layout: a DiT^DH
    if rae:  # its body's parts (s_embedder, enc_feat_rope) read as DiT's, the head's embedder (x_embedder) dropped
        body = {"s_embedder": "x_embedder", "enc_feat_rope": "feat_rope"}
        arch = _infer_architecture({re.sub(r"^\w+", lambda m: body.get(m[0], m[0]), k): v
                                    for k, v in state_dict.items() if not k.startswith("x_embedder.")})
        widths = [state_dict[k].shape[1] for k in state_dict if re.match(r"blocks\.\d+\.attn\.qkv\.weight$", k)]
        arch["depth"] = sum(1 for w in widths if w == arch["hidden_size"])
        arch.update(head_depth=len(widths) - arch["depth"], head_width=_shape(state_dict, "x_embedder.proj.weight")[0])
    else:
        arch = _infer_architecture(state_dict) | dict(head_depth=0, head_width=0)
    found = {k: arch[k] for k in ("depth", "hidden_size", "patch_size", "head_depth", "head_width")}
    name = next((n for n, p in PRESETS.items() if {k: p.get(k, 0) for k in found} == found and arch["square"]), None)
    if name is None:
        head = f", head depth {arch['head_depth']} width {arch['head_width']}" if rae else ""
        raise UserError(f"these weights have depth {arch['depth']}, width {arch['hidden_size']}{head}, patch "
                        f"{arch['patch_size']} and input size {arch['input_size']} (latent grid), which match no "
                        f"preset in DiT_models ({', '.join(PRESETS)}). Use weights of a preset model.")
    if arch["out_channels"] not in (arch["in_channels"], 2 * arch["in_channels"]):
        raise UserError(f"the final layer predicts {arch['out_channels']} channels for {arch['in_channels']} "
                        "input channels (expected equal or double); these are not DiT weights.")
    rope = state_dict.get("dec_feat_rope.freqs_cos")  # (T, head_dim): the head's attention heads
    head_heads = arch["head_width"] // rope.shape[1] if rope is not None else PRESETS[name].get("head_heads", 0)
    has_null = class_dropout_prob > 0 and arch["label_rows"] > 1
    config = ModelConfig(
        model=name, input_size=arch["input_size"], in_channels=arch["in_channels"],
        num_classes=arch["label_rows"] - int(has_null), learn_sigma=arch["out_channels"] == 2 * arch["in_channels"],
        class_dropout_prob=class_dropout_prob if has_null else 0.0, **{k: arch[k] for k in BLOCK_FIELDS},
        head_depth=arch["head_depth"], head_width=arch["head_width"], head_heads=head_heads,
        **({"objective": "flow"} if rae else {}))
    with torch.device("meta"):  # UserError when the names or shapes differ from those of the model it builds
        expected = {k: tuple(v.shape) for k, v in config.build().state_dict().items()}
    extra, missing = sorted(set(state_dict) - set(expected)), sorted(set(expected) - set(state_dict))
    reshaped = sorted(k for k in set(state_dict) & set(expected) if tuple(state_dict[k].shape) != expected[k])
    if extra or missing or reshaped:
        listed = lambda names: f"{names[:4]}{' ...' if len(names) > 4 else ''}"  # noqa: E731
        raise UserError(f"these weights look like {config.model} with block options {config.block_options}, but "
                        f"their tensor names or shapes differ from that model's (unexpected {listed(extra)}, missing "
                        f"{listed(missing)}, other shape {listed(reshaped)}), so this version cannot rebuild them. "
                        "Use a DiT checkpoint or one of this project's exports (which carry their config).")
    return config

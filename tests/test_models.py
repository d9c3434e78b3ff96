"""DiT: official names/shapes/counts, numerics against an independent functional re-derivation, init,
attention backends, gradient checkpointing, class dropout, config and preset inference (CFG: test_guidance.py)."""
import math
import sys
import types

import numpy as np
import pytest
import torch

from shared.runtime.errors import ChoiceError, UserError, advise
from shared.network.attention import ATTENTION_BACKENDS
from shared.network.models import DiT_models, ModelConfig, PRESETS, check_preset, infer_model_config
from tests.helpers import inputs, randomize, tiny


# ----------------------------------------------------------------------------------------------
# Official layout: names, shapes, parameter counts (on the meta device: no memory, no time)
# ----------------------------------------------------------------------------------------------

def xl2_expected_shapes():
    """The 292 tensors of DiT-XL-2-256x256.pt as listed in FACTS.md."""
    d = 1152
    shapes = {
        "pos_embed": (1, 256, d),
        "x_embedder.proj.weight": (d, 4, 2, 2), "x_embedder.proj.bias": (d,),
        "t_embedder.mlp.0.weight": (d, 256), "t_embedder.mlp.0.bias": (d,),
        "t_embedder.mlp.2.weight": (d, d), "t_embedder.mlp.2.bias": (d,),
        "y_embedder.embedding_table.weight": (1001, d),
        "final_layer.adaLN_modulation.1.weight": (2 * d, d), "final_layer.adaLN_modulation.1.bias": (2 * d,),
        "final_layer.linear.weight": (2 * 2 * 8, d), "final_layer.linear.bias": (2 * 2 * 8,),
    }
    for i in range(28):
        for name, (rows, cols) in {"attn.qkv": (3 * d, d), "attn.proj": (d, d), "mlp.fc1": (4 * d, d),
                                   "mlp.fc2": (d, 4 * d), "adaLN_modulation.1": (6 * d, d)}.items():
            shapes[f"blocks.{i}.{name}.weight"] = (rows, cols)
            shapes[f"blocks.{i}.{name}.bias"] = (rows,)
    return shapes


def test_xl2_on_meta_has_official_tensors():
    with torch.device("meta"):
        model = DiT_models["DiT-XL/2"]()
    sd = model.state_dict()
    expected = xl2_expected_shapes()
    assert len(expected) == 292
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert sum(v.numel() for v in sd.values()) == 675_129_632
    assert not model.pos_embed.requires_grad
    assert model.null_label == 1000 and model.out_channels == 8


def closed_form_params(depth, width, patch, tokens, channels=4, classes=1000):
    """Parameter count derived by hand from the architecture (DiT Sec. 3), incl. pos_embed."""
    out = 2 * channels * patch * patch
    embed = tokens * width + (patch * patch * channels * width + width)
    cond = (256 * width + width) + (width * width + width) + (classes + 1) * width
    block = 18 * width * width + 15 * width  # qkv 3D^2, proj D^2, mlp 8D^2, adaLN 6D^2 + biases
    final = (2 * width * width + 2 * width) + (width * out + out)
    return embed + cond + depth * block + final


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "DiT-T/2" and not PRESETS[n].get("head_depth")])
def test_official_presets_parameter_counts(name):
    arch = PRESETS[name]
    with torch.device("meta"):
        model = DiT_models[name]()
    tokens = (32 // arch["patch_size"]) ** 2
    count = sum(p.numel() for p in model.parameters())
    assert count == closed_form_params(arch["depth"], arch["hidden_size"], arch["patch_size"], tokens)
    assert model.pos_embed.shape == (1, tokens, arch["hidden_size"])
    assert len(model.blocks) == arch["depth"] and model.blocks[0].attn.num_heads == arch["num_heads"]
    if name.endswith("/2"):  # FACTS.md: S 33.0M, B 130.5M, L 458.1M, XL 675.1M
        assert round(count / 1e6, 1) == {"S": 33.0, "B": 130.5, "L": 458.1, "XL": 675.1}[name[4:-2]]


def test_preset_table_is_official():
    official = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
    for size, (depth, width, heads) in official.items():
        for patch in (2, 4, 8):
            assert PRESETS[f"DiT-{size}/{patch}"] == dict(depth=depth, hidden_size=width, patch_size=patch,
                                                          num_heads=heads)
    assert len([n for n in DiT_models if not n.startswith("DiTDH-")]) == 18 and "DiT-T/2" in DiT_models
    assert {n for n in DiT_models if n.startswith("DiTDH-")} == {"DiTDH-S", "DiTDH-XL", "DiTDH-T"}  # RAE's (+ tiny)
    assert "DiT-XL/1" in DiT_models and "DiT-T/1" in DiT_models


# ----------------------------------------------------------------------------------------------
# An independent functional re-derivation of the official forward, straight from a state dict
# ----------------------------------------------------------------------------------------------

def ref_pos_embed(width, grid):
    """MAE/DiT 2-D sin-cos table in numpy: half for the x (column) coordinate, half for y (row)."""
    def one_axis(dim, coords):
        inv = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        ang = np.outer(coords.reshape(-1).astype(np.float64), inv)
        return np.concatenate([np.sin(ang), np.cos(ang)], axis=1)
    ys, xs = np.divmod(np.arange(grid * grid), grid)  # row-major token order
    return np.concatenate([one_axis(width // 2, xs), one_axis(width // 2, ys)], axis=1)


def ref_layer_norm(x, eps=1e-6):
    """LayerNorm without affine parameters."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def ref_gelu_tanh(x):
    """GELU, tanh approximation (Hendrycks & Gimpel, 2016)."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def ref_silu(x):
    """x * sigmoid(x)."""
    return x * torch.sigmoid(x)


def ref_linear(sd, name, x):
    """x W^T + b with the named weights."""
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def ref_timestep_features(t, dim=256):
    """GLIDE/ADM features: cos then sin of t * 10000^(-i/half), in fp32 as the official code."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


def ref_attention(x, sd, prefix, heads):
    """Multi-head self-attention from the fused qkv weights, written with einsum."""
    n, t, d = x.shape
    qkv = ref_linear(sd, f"{prefix}.qkv", x).reshape(n, t, 3, heads, d // heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (N, T, H, d)
    logits = torch.einsum("nihc,njhc->nhij", q, k) / math.sqrt(d // heads)
    out = torch.einsum("nhij,njhc->nihc", torch.softmax(logits, dim=-1), v)
    return ref_linear(sd, f"{prefix}.proj", out.reshape(n, t, d))


def ref_forward(sd, x, t, y, patch, heads, out_channels):
    """Official DiT forward (patchify, +pos, adaLN-Zero blocks, final layer, unpatchify) on a dict."""
    n, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    # Patchify as a matrix product over flattened (C, p, p) patches.
    patches = x.reshape(n, c, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5)  # (N, gh, gw, C, p, p)
    patches = patches.reshape(n, gh * gw, c * patch * patch)
    weight = sd["x_embedder.proj.weight"].reshape(sd["x_embedder.proj.weight"].shape[0], -1)
    tokens = patches @ weight.T + sd["x_embedder.proj.bias"] + sd["pos_embed"]
    temb = ref_timestep_features(t).to(x.dtype)
    temb = ref_linear(sd, "t_embedder.mlp.2", ref_silu(ref_linear(sd, "t_embedder.mlp.0", temb)))
    cond = temb + sd["y_embedder.embedding_table.weight"][y]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(depth):
        b = f"blocks.{i}"
        mod = ref_linear(sd, f"{b}.adaLN_modulation.1", ref_silu(cond)).unsqueeze(1)
        s1, sc1, g1, s2, sc2, g2 = mod.chunk(6, dim=-1)
        tokens = tokens + g1 * ref_attention(ref_layer_norm(tokens) * (1 + sc1) + s1, sd, f"{b}.attn", heads)
        hidden = ref_gelu_tanh(ref_linear(sd, f"{b}.mlp.fc1", ref_layer_norm(tokens) * (1 + sc2) + s2))
        tokens = tokens + g2 * ref_linear(sd, f"{b}.mlp.fc2", hidden)
    shift, scale = ref_linear(sd, "final_layer.adaLN_modulation.1", ref_silu(cond)).unsqueeze(1).chunk(2, dim=-1)
    vals = ref_linear(sd, "final_layer.linear", ref_layer_norm(tokens) * (1 + scale) + shift)  # (N, T, p*p*C)
    out = torch.zeros(n, out_channels, h, w, dtype=x.dtype)
    for i in range(gh):  # token (i, j) holds its patch as (row a, column b, channel) in that order
        for j in range(gw):
            out[:, :, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch] = (
                vals[:, i * gw + j].reshape(n, patch, patch, out_channels).permute(0, 3, 1, 2))
    return out


@pytest.mark.parametrize("kwargs", [
    dict(depth=6),  # the full DiT-T/2 preset, learned sigma, null row
    dict(patch_size=4, depth=2, learn_sigma=False, class_dropout_prob=0.0, in_channels=3),
])
def test_same_outputs_as_official_formulation(kwargs):
    model = tiny(**kwargs).double().eval()
    grid = model.input_size // model.patch_size
    official = torch.from_numpy(ref_pos_embed(model.pos_embed.shape[-1], grid)).float()  # stored as fp32
    assert torch.equal(model.pos_embed[0], official.double())
    # A state dict built outside the model: random everything, official pos_embed, loaded strictly.
    gen = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * 0.3 for k, v in model.state_dict().items()}
    sd["pos_embed"] = torch.from_numpy(ref_pos_embed(sd["pos_embed"].shape[-1], grid))[None]
    model.load_state_dict(sd, strict=True)
    x, t, y = inputs(c=model.in_channels, dtype=torch.float64)
    with torch.no_grad():
        ours = model(x, t, y)
    ref = ref_forward(sd, x, t, y, model.patch_size, model.num_heads, model.out_channels)
    assert ours.shape == (4, model.out_channels, 8, 8)
    assert ours.abs().mean() > 0.1  # the comparison is not between two zero tensors
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


def test_fp32_matches_reference_closely():
    model = randomize(tiny(), scale=0.1).eval()
    sd = {k: v.double() for k, v in model.state_dict().items()}
    x, t, y = inputs()
    with torch.no_grad():
        ours = model(x, t, y).double()
    ref = ref_forward(sd, x.double(), t, y, 2, 3, 8)
    assert ref.abs().mean() > 0.1
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# ----------------------------------------------------------------------------------------------
# Initialisation
# ----------------------------------------------------------------------------------------------

def test_official_initialisation():
    torch.manual_seed(0)
    model = tiny(num_classes=1000, depth=6)
    x, t, y = inputs()
    assert torch.count_nonzero(model(x, t, y)) == 0  # adaLN-Zero + zero final layer: output starts at 0
    zero = ["final_layer.linear", "final_layer.adaLN_modulation.1"]
    zero += [f"blocks.{i}.adaLN_modulation.1" for i in range(6)]
    sd = model.state_dict()
    for name in zero:
        assert torch.count_nonzero(sd[f"{name}.weight"]) == 0 and torch.count_nonzero(sd[f"{name}.bias"]) == 0
    for name in ["blocks.0.attn.qkv", "blocks.5.mlp.fc2", "blocks.3.attn.proj"]:
        w = sd[f"{name}.weight"]
        bound = math.sqrt(6 / (w.shape[0] + w.shape[1]))  # xavier uniform
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
        assert torch.count_nonzero(sd[f"{name}.bias"]) == 0
    patch = sd["x_embedder.proj.weight"]  # like a linear over C*p*p inputs
    assert patch.abs().max() <= math.sqrt(6 / (192 + 4 * 2 * 2))
    assert torch.count_nonzero(sd["x_embedder.proj.bias"]) == 0
    for name in ["y_embedder.embedding_table.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight"]:
        assert abs(sd[name].std().item() - 0.02) < 0.002 and abs(sd[name].mean().item()) < 0.002
    assert torch.count_nonzero(sd["t_embedder.mlp.0.bias"]) == 0


# ----------------------------------------------------------------------------------------------
# Attention backends
# ----------------------------------------------------------------------------------------------

def test_sdpa_and_math_attention_agree():
    model = randomize(tiny()).double().eval()
    x, t, y = inputs(dtype=torch.float64)
    assert model.attention == "sdpa"  # "auto" resolves to torch's scaled_dot_product_attention
    with torch.no_grad():
        sdpa = model(x, t, y)
        model.set_attention("math")
        assert all(b.attn.backend == "math" for b in model.blocks)
        math_out = model(x, t, y)
    torch.testing.assert_close(sdpa, math_out, rtol=1e-10, atol=1e-10)
    assert sdpa.abs().mean() > 0.1


def test_unknown_attention_backend_is_a_choice_error():
    with pytest.raises(ChoiceError, match="sdpa") as caught:
        tiny(attention="flash")
    assert (caught.value.setting, caught.value.value, caught.value.choices) == ("attention backend", "flash",
                                                                             list(ATTENTION_BACKENDS))
    assert "--attention 'flash'" in str(advise(caught.value, {"attention backend": "--attention"}))


def test_xformers_not_importable_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)  # makes `import xformers` raise ImportError
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    with pytest.raises(UserError, match="xformers cannot be imported.*attention backend sdpa") as caught:
        tiny(attention="xformers")
    assert "use --attention sdpa" in str(advise(caught.value, {"attention backend": "--attention"}))


def test_xformers_on_cpu_is_a_user_error_not_a_fallback(monkeypatch):
    """On CPU `import xformers` can succeed while its kernels raise; we must refuse, not fall back."""
    calls = []

    def kernel(q, k, v):
        calls.append(q.device)
        raise NotImplementedError("No operator found for `memory_efficient_attention_forward`")

    package, ops = types.ModuleType("xformers"), types.ModuleType("xformers.ops")
    ops.memory_efficient_attention, package.ops = kernel, ops
    monkeypatch.setitem(sys.modules, "xformers", package)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    model = tiny(attention="xformers")
    assert model.attention == "xformers"
    with pytest.raises(UserError, match="needs CUDA"):
        model(*inputs())
    assert calls == []  # refused before reaching a kernel that would not run


# ----------------------------------------------------------------------------------------------
# Gradient checkpointing
# ----------------------------------------------------------------------------------------------

def grads_and_saved(model, every):
    """Gradients of a fixed loss and the number of tensors autograd saved for backward."""
    model.set_grad_checkpointing(every)
    model.zero_grad()
    x, t, y = inputs(n=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(1) or tensor, lambda tensor: tensor):
        loss = model(x, t, y).square().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, len(saved)


def test_gradient_checkpointing_gives_identical_gradients():
    model = randomize(tiny(depth=3)).train()
    model.y_embedder.dropout_prob = 0.0  # same labels in every pass
    base, saved_off = grads_and_saved(model, 0)
    assert "pos_embed" not in base
    saved = {}
    for every in (1, 2):
        grads, saved[every] = grads_and_saved(model, every)
        for name, g in base.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
    assert saved[1] < saved[2] < saved_off  # 3, then 2 (blocks 0 and 2), then 0 blocks recomputed


def test_bad_checkpoint_interval_is_a_user_error():
    with pytest.raises(UserError):
        tiny(grad_checkpoint_every=-1)


# ----------------------------------------------------------------------------------------------
# Class dropout and classifier-free guidance
# ----------------------------------------------------------------------------------------------

def test_class_dropout_uses_null_label_and_global_rng():
    model = randomize(tiny(class_dropout_prob=0.5))
    x, t, y = inputs(n=8)
    model.eval()
    with torch.no_grad():
        cond = model(x, t, y)
        null = model(x, t, torch.full_like(y, model.null_label))
        model.train()
        torch.manual_seed(7)
        first = model(x, t, y)
        torch.manual_seed(7)
        again = model(x, t, y)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    dropped = [torch.allclose(first[i], null[i]) for i in range(8)]
    kept = [torch.allclose(first[i], cond[i]) for i in range(8)]
    assert all(d != k for d, k in zip(dropped, kept)) and 0 < sum(dropped) < 8


def test_force_drop_ids_and_eval_never_drops():
    model = tiny(class_dropout_prob=0.1)
    labels = torch.tensor([0, 1, 2, 3])
    forced = model.y_embedder.token_drop(labels, force_drop_ids=torch.tensor([1, 0, 1, 0]))
    assert forced.tolist() == [5, 1, 5, 3]
    table = model.y_embedder.embedding_table.weight
    torch.testing.assert_close(model.y_embedder(labels, train=False), table[labels])
    no_null = tiny(class_dropout_prob=0.0)
    assert no_null.y_embedder.embedding_table.weight.shape[0] == 5 and no_null.null_label == 5


def test_wrong_latent_shape_is_a_user_error():
    model = tiny()
    x, t, y = inputs(size=16)
    with pytest.raises(UserError, match="input_size"):
        model(x, t, y)


# ----------------------------------------------------------------------------------------------
# ModelConfig and preset inference
# ----------------------------------------------------------------------------------------------

def test_model_config_round_trip_and_build():
    config = ModelConfig(model="DiT-T/2", input_size=8, num_classes=5, learn_sigma=False)
    again = ModelConfig.from_dict(config.to_dict())
    assert again == config
    model = again.build(attention="math", grad_checkpoint_every=2)
    assert (model.input_size, model.num_classes, model.out_channels) == (8, 5, 4)
    assert model.attention == "math" and model.grad_checkpoint_every == 2


def test_model_config_rejects_bad_input():
    with pytest.raises(ChoiceError, match="DiT-XL/2") as caught:
        ModelConfig(model="DiT-XXL/2", input_size=32)
    assert caught.value.setting == "model preset" and caught.value.choices == list(DiT_models)
    check_preset("DiT-T/2")
    with pytest.raises(ChoiceError, match="unknown model preset 'DiT-Q/2'"):
        check_preset("DiT-Q/2")
    with pytest.raises(UserError, match="unknown keys"):
        ModelConfig.from_dict({"model": "DiT-T/2", "input_size": 8, "depth": 3})
    with pytest.raises(UserError, match="lacks keys"):
        ModelConfig.from_dict({"model": "DiT-T/2"})


def test_infer_official_xl2_layout():
    with torch.device("meta"):
        sd = DiT_models["DiT-XL/2"]().state_dict()
    assert infer_model_config(sd) == ModelConfig(model="DiT-XL/2", input_size=32)
    with torch.device("meta"):
        sd512 = DiT_models["DiT-XL/2"](input_size=64).state_dict()
    assert infer_model_config(sd512).input_size == 64


@pytest.mark.parametrize("config", [
    ModelConfig(model="DiT-T/2", input_size=8, num_classes=5),
    ModelConfig(model="DiT-S/4", input_size=16, in_channels=3, num_classes=1, learn_sigma=False),
    ModelConfig(model="DiT-B/8", input_size=16, num_classes=10, class_dropout_prob=0.0),
])
def test_infer_recovers_config(config):
    with torch.device("meta"):
        sd = config.build().state_dict()
    assert infer_model_config(sd, class_dropout_prob=config.class_dropout_prob) == config


def test_infer_without_matching_preset_names_the_shapes():
    with torch.device("meta"):
        sd = DiT_models["DiT-S/2"](depth=5, input_size=8).state_dict()
    with pytest.raises(UserError, match=r"depth 5, width 384, patch 2.*input size 8"):
        infer_model_config(sd)
    with pytest.raises(UserError, match="pos_embed"):
        infer_model_config({k: v for k, v in sd.items() if k != "pos_embed"})

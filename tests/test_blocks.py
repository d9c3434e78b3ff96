"""Block options (issue 19 item 3): RMSNorm, SwiGLU, 2-D RoPE, QK-norm as LightningDiT defines them.

Each option against a hand formula, the default against the official block op for op, state-dict inference,
module-counted MACs against the architecture arithmetic, and the real commands: training with every
option and checkpointing, resume with another block refused, an export sampled with no flags, and the
refusals (another image size, a diffusers export).
"""
import json

import pytest
import torch
import torch.nn.functional as F

from shared.runtime.errors import ChoiceError, UserError
from shared.weights.export import load_weights, save_weights
from shared.network.blocks import BLOCKS, RMSNorm, RotaryEmbedding2d, block_options, rotate_pairs, swiglu_hidden
from shared.network.dit import DiTBlock
from shared.network.models import PRESETS, ModelConfig, infer_model_config
from train.memory import forward_macs
from tests.helpers import inputs, randomize, tiny, space_of

ALL_ON = dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=True)


def block_model(seed=0, **options):
    """A randomised DiT-T/2-like model (2 blocks, 5 classes, 8x8 latents) with the given block options."""
    torch.manual_seed(seed)
    return randomize(tiny(depth=2, **options), seed=seed)


# ---------------------------------------------------------------------------------------------------------
# Each option against its formula
# ---------------------------------------------------------------------------------------------------------

def test_default_block_is_the_official_block_op_for_op():
    """DiTBlock() computes exactly the official ops (affine-free LayerNorm 1e-6, SDPA, tanh GELU): bitwise."""
    torch.manual_seed(0)
    block = DiTBlock(64, 4)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, c = torch.randn(2, 16, 64), torch.randn(2, 64)
    s1, a1, g1, s2, a2, g2 = block.adaLN_modulation(c).chunk(6, dim=1)

    def attn(h):
        q, k, v = block.attn.qkv(h).reshape(2, 16, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        return block.attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 16, 64))

    def mlp(h):
        return block.mlp.fc2(F.gelu(block.mlp.fc1(h), approximate="tanh"))

    ln = lambda h: F.layer_norm(h, (64,), eps=1e-6)  # noqa: E731
    y = x + g1.unsqueeze(1) * attn(ln(x) * (1 + a1.unsqueeze(1)) + s1.unsqueeze(1))
    y = y + g2.unsqueeze(1) * mlp(ln(y) * (1 + a2.unsqueeze(1)) + s2.unsqueeze(1))
    assert torch.equal(block(x, c), y)
    assert sorted(block.state_dict()) == sorted(  # official names only: no norm gains, no q/k norms
        f"{m}.{p}" for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")
        for p in ("weight", "bias"))


def test_old_config_without_block_fields_builds_the_dit_block():
    old = {"model": "DiT-T/2", "input_size": 8, "in_channels": 4, "num_classes": 5, "learn_sigma": True,
           "class_dropout_prob": 0.1}
    config = ModelConfig.from_dict(old)
    assert config.block == "dit" and config.block_options == BLOCKS["dit"]
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert "feat_rope.freqs_cos" not in config.build().state_dict()


def test_rmsnorm_is_the_formula_with_a_learned_gain():
    norm = RMSNorm(32)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 32) * 4 + 1
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    half = norm(x.bfloat16())  # normalised in fp32, rounded once to bf16, then the fp32 gain
    ref = (x.bfloat16().float() / x.bfloat16().float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    torch.testing.assert_close(half, ref.bfloat16().float() * norm.weight)


def test_rmsnorm_option_replaces_every_norm():
    model = tiny(depth=2, norm="rmsnorm")
    names = [n for n, m in model.named_modules() if isinstance(m, RMSNorm)]
    assert names == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "final_layer.norm_final"]
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_swiglu_is_the_formula_with_two_thirds_width():
    assert swiglu_hidden(1152) == 3072 and swiglu_hidden(192) == 512 and swiglu_hidden(1024) == 2730
    assert 3 * 1152 * swiglu_hidden(1152) == 2 * 1152 * 4 * 1152  # as many weights as the GELU MLP at XL
    model = block_model(mlp="swiglu")
    mlp = model.blocks[0].mlp
    x = torch.randn(2, 7, 192)
    w1, w2 = mlp.w12.weight.chunk(2, dim=0)
    b1, b2 = mlp.w12.bias.chunk(2)
    hidden = (x @ w1.T + b1) * torch.sigmoid(x @ w1.T + b1) * (x @ w2.T + b2)  # SiLU(x W1) * (x W2)
    torch.testing.assert_close(mlp(x), hidden @ mlp.w3.weight.T + mlp.w3.bias, rtol=1e-5, atol=1e-5)


def eva_rope_tables(head_dim, grid, theta=10000):
    """LightningDiT's VisionRotaryEmbeddingFast(dim=head_dim/2, pt_seq_len=grid) tables, written out independently."""
    dim = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim)  # (dim/2,)
    pos = torch.arange(grid).float()
    axis = (pos[:, None] * freqs[None]).repeat_interleave(2, dim=-1)  # (grid, dim): [f0, f0, f1, f1, ...]
    both = torch.cat([axis[:, None, :].expand(grid, grid, dim), axis[None, :, :].expand(grid, grid, dim)], dim=-1)
    return both.cos().reshape(-1, head_dim), both.sin().reshape(-1, head_dim)


def test_rope_tables_are_lightningdits():
    rope = RotaryEmbedding2d(64, 4)
    rope.reset_tables()
    cos, sin = eva_rope_tables(64, 4)
    torch.testing.assert_close(rope.freqs_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.freqs_sin, sin, rtol=0, atol=1e-6)
    x = torch.randn(64)
    assert torch.equal(rotate_pairs(x)[:4], torch.stack([-x[1], x[0], -x[3], x[2]]))


def test_rope_scores_depend_only_on_relative_position():
    """Shifting the query's and the key's grid positions together leaves q.k unchanged (RoFormer Sec. 3.4)."""
    grid, d = 6, 32
    rope = RotaryEmbedding2d(d, grid)
    rope.reset_tables()
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)

    def score(qpos, kpos):
        tq, tk = qpos[0] * grid + qpos[1], kpos[0] * grid + kpos[1]
        cos, sin = rope.freqs_cos.double(), rope.freqs_sin.double()
        rq = q * cos[tq] + rotate_pairs(q) * sin[tq]
        rk = k * cos[tk] + rotate_pairs(k) * sin[tk]
        return float(rq @ rk)

    base = score((1, 2), (3, 0))
    for dr, dc in [(1, 0), (0, 3), (2, 1), (-1, 2)]:
        assert score((1 + dr, 2 + dc), (3 + dr, 0 + dc)) == pytest.approx(base, abs=1e-5)
    assert abs(score((1, 2), (3, 1)) - base) > 1e-3  # another offset, another score: positions matter
    assert abs(score((1, 3), (3, 0)) - base) > 1e-3


def test_qk_norm_gives_unit_rms_queries_and_keys():
    model = block_model(norm="rmsnorm", qk_norm=True).eval()
    seen = {}
    for name in ("q_norm", "k_norm"):
        getattr(model.blocks[0].attn, name).register_forward_hook(lambda m, i, o, name=name: seen.update({name: o}))
    with torch.no_grad():
        model(*inputs())
    for name, out in seen.items():  # (N, H, T, d); randomize perturbed the gains, so divide them out
        gain = getattr(model.blocks[0].attn, name).weight
        rms = (out / gain).pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)
    layer = tiny(depth=1, qk_norm=True).blocks[0].attn.q_norm  # with the LayerNorm block: timm's LayerNorm
    assert isinstance(layer, torch.nn.LayerNorm) and layer.elementwise_affine and layer.eps == 1e-5


@pytest.mark.parametrize("option", [dict(norm="rmsnorm"), dict(mlp="swiglu"), dict(rope=True), dict(qk_norm=True)])
def test_each_option_changes_the_forward(option):
    """Same seed, same weights where names coincide: the option alone changes the output."""
    base, other = block_model(), block_model(**option)
    shared = {k: v for k, v in base.state_dict().items() if k in other.state_dict()
              and other.state_dict()[k].shape == v.shape}
    other.load_state_dict(shared, strict=False)
    x, t, y = inputs()
    with torch.no_grad():
        a, b = base.eval()(x, t, y), other.eval()(x, t, y)
    assert a.abs().mean() > 0.1 and (a - b).abs().max() > 1e-3


def test_sdpa_and_math_attention_agree_with_every_option():
    model = block_model(**ALL_ON).double().eval()
    x, t, y = inputs(dtype=torch.float64)
    with torch.no_grad():
        sdpa = model(x, t, y)
        model.set_attention("math")
        torch.testing.assert_close(model(x, t, y), sdpa, rtol=1e-10, atol=1e-10)


def test_gradient_checkpointing_gives_identical_gradients_with_every_option():
    model = block_model(**ALL_ON).train()
    x, t, y = inputs()
    grads = []
    for every in (0, 1):
        model.zero_grad()
        model.set_grad_checkpointing(every)
        model(x, t, y, force_drop_ids=torch.zeros(4)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "blocks.0.attn.q_norm.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-6, atol=1e-7)


def test_bf16_autocast_runs_with_every_option():
    model = block_model(**ALL_ON).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*inputs())
    assert torch.isfinite(out).all()


def test_rope_model_at_another_size_is_refused():
    model = tiny(depth=1, rope=True)
    x, t, y = inputs(size=16)
    with pytest.raises(UserError, match="rotary position tables are built for a 4x4 token grid"):
        model(x, t, y)


# ---------------------------------------------------------------------------------------------------------
# Presets, config, inference
# ---------------------------------------------------------------------------------------------------------

def test_presets_and_overrides():
    assert block_options("lightning") == dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=False)
    assert block_options("lightning", qk_norm=True, rope=None) == BLOCKS["lightning-qknorm"]
    assert block_options("dit", mlp="swiglu")["mlp"] == "swiglu"
    assert ModelConfig("DiT-T/2", 8, **block_options("dit", rope=True)).block == "custom"
    with pytest.raises(ChoiceError, match="block preset"):
        block_options("lightening")
    with pytest.raises(ChoiceError, match="block norm"):
        ModelConfig("DiT-T/2", 8, norm="batchnorm")
    with pytest.raises(UserError, match="rope must be true or false"):
        ModelConfig("DiT-T/2", 8, rope="yes")


@pytest.mark.parametrize("options", [BLOCKS["lightning"], BLOCKS["lightning-qknorm"], dict(mlp="swiglu"),
                                     dict(rope=True, qk_norm=True), dict(norm="rmsnorm")])
def test_infer_recognises_every_layout(options):
    config = ModelConfig("DiT-S/4", input_size=16, num_classes=10, **options)
    with torch.device("meta"):
        sd = config.build().state_dict()
    assert infer_model_config(sd) == config


def test_infer_refuses_an_unknown_block_layout():
    with torch.device("meta"):
        sd = ModelConfig("DiT-T/2", 8, num_classes=5, mlp="swiglu").build().state_dict()
    renamed = {k.replace("mlp.w12", "mlp.w1"): v for k, v in sd.items()}
    with pytest.raises(UserError, match=r"block mlp cannot be told from their tensors.*none of the registered values "
                                        r"\(gelu, swiglu"):
        infer_model_config(renamed)
    extra = dict(sd, **{"blocks.0.attn.q_proj.weight": torch.zeros(1, device="meta")})
    with pytest.raises(UserError, match="tensor names or shapes differ.*unexpected \\['blocks.0.attn.q_proj.weight'\\]"):
        infer_model_config(extra)


# ---------------------------------------------------------------------------------------------------------
# MACs counted from the modules
# ---------------------------------------------------------------------------------------------------------

def architecture_macs(name, image_size=256):
    """The pre-module-count arithmetic: T*in*out per token-wise linear, 2*T*T*D attention, per-image adaLN."""
    p = PRESETS[name]
    d, depth, patch = p["hidden_size"], p["depth"], p["patch_size"]
    tokens = (image_size // 8 // patch) ** 2
    return {"patch_embed": tokens * 4 * patch * patch * d, "timestep_mlp": 256 * d + d * d,
            "attention_linears": depth * tokens * 4 * d * d, "attention_matmuls": depth * 2 * tokens * tokens * d,
            "mlp": depth * tokens * 8 * d * d, "adaln": depth * 6 * d * d,
            "final_layer": tokens * d * patch * patch * 8 + 2 * d * d}


@pytest.mark.parametrize("name", ["DiT-XL/2", "DiT-L/4", "DiT-B/8", "DiT-S/2"])
def test_module_count_equals_the_architecture_arithmetic(name):
    macs = forward_macs(ModelConfig(name, 32).build(device="meta"))
    expected = architecture_macs(name)
    assert {k: v for k, v in macs.items() if k != "total"} == expected
    assert macs["total"] == sum(expected.values())


def test_macs_follow_the_block():
    """L's SwiGLU width rounds down (2730 < 8/3 * 1024), so its MLP costs less; norms and RoPE add no MACs."""
    dit = forward_macs(ModelConfig("DiT-L/2", 32).build(device="meta"))
    lightning = forward_macs(ModelConfig("DiT-L/2", 32, **BLOCKS["lightning-qknorm"]).build(device="meta"))
    tokens = 256
    assert lightning["mlp"] == 24 * tokens * 3 * 1024 * 2730 < dit["mlp"]
    assert {k: v for k, v in lightning.items() if k not in ("mlp", "total")} == \
           {k: v for k, v in dit.items() if k not in ("mlp", "total")}
    assert round(forward_macs(ModelConfig("DiT-XL/2", 32, **BLOCKS["lightning"]).build(device="meta"))
                 ["total"] / 1e9, 1) == 118.6  # XL's SwiGLU is exactly as wide in weights as its GELU MLP


# ---------------------------------------------------------------------------------------------------------
# The real commands
# ---------------------------------------------------------------------------------------------------------

from tests.helpers import checkpoints, expect_user_error, run_inprocess, train_args  # noqa: E402


def test_training_with_every_option_and_checkpointing_records_the_block(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2", "--block",
                        "lightning", "--qk-norm", "--grad-checkpoint", "--precision", "bf16")
    saved = json.loads((run / "config.json").read_text())
    assert (saved["block"], saved["norm"], saved["mlp"], saved["rope"], saved["qk_norm"]) == \
           ("lightning", "rmsnorm", "swiglu", True, True)
    state, config, _, step = load_weights(sorted((run / "exports").iterdir())[-1])
    assert step == 2 and config.block == "lightning-qknorm"
    assert "feat_rope.freqs_cos" in state and "blocks.0.mlp.w12.weight" in state
    assert all(torch.isfinite(v).all() for v in state.values())
    log = (run / "log.txt").read_text()
    assert "DiT-T/2 (lightning block: norm rmsnorm, mlp swiglu, rope True, qk_norm True)" in log


def test_resume_with_another_block_is_refused(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2")
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "4", "--block", "lightning"))
    assert "holds a run that differs from this command" in message
    assert "norm: 'layernorm' -> 'rmsnorm'" in message and "rope: False -> True" in message
    assert checkpoints(run) == ["step-0000002"]  # nothing written


def test_resume_of_a_run_written_before_block_options(latents, tmp_path):
    """A checkpoint whose configs lack the block fields resumes as the DiT block (what it was trained as)."""
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2")
    for path in [run / "config.json", run / "checkpoints" / "step-0000002" / "state.json"]:
        data = json.loads(path.read_text())
        cfg = data.get("config", data)  # state.json holds the config under "config"
        for key in ("block", "norm", "mlp", "rope", "qk_norm"):
            assert key in cfg
            del cfg[key]
        path.write_text(json.dumps(data))
    run_inprocess(latents, run, "--max-steps", "4", "--ckpt-every", "2")
    assert "resumed from" in (run / "log.txt").read_text() and checkpoints(run)[-1] == "step-0000004"


@pytest.fixture(scope="module")
def lightning_export(tmp_path_factory, tiny_vae_dir):
    """A run folder holding one export of a randomised lightning-qknorm DiT-T/2 on the tiny VAE's 4x8x8 latents."""
    from shared.tokenizers.locate import load_tokenizer
    from tests.helpers import random_dit

    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=5, **BLOCKS["lightning-qknorm"])
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8], "vae": vae.identity,
            "class_names": ["cat", "Dog", "sea eel", "ant", "bee"]}
    folder = tmp_path_factory.mktemp("blocks") / "run"
    save_weights(folder / "exports" / "ema-step-0000010.safetensors", random_dit(config).state_dict(), config,
                 space_of(meta), 10)
    return folder, config


def test_sample_rebuilds_the_block_with_no_flags(lightning_export, tmp_path, capsys):
    from tests.helpers import pngs, run_sample as run_cli

    folder, config = lightning_export
    code, err = run_cli(["--ckpt", folder, "--out", tmp_path / "out", "--num-samples", 2, "--num-sampling-steps", 2,
                         "--cpu"], capsys)
    assert code == 0, err
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert ModelConfig.from_dict(settings["identity"]["model"]) == config  # and strict load of w12, feat_rope, ...
    assert len(pngs(tmp_path / "out")) == 2


def test_sample_at_another_image_size_is_refused_naming_the_grid(lightning_export, tmp_path, capsys):
    from tests.helpers import run_sample as run_cli

    folder, _ = lightning_export
    code, err = run_cli(["--ckpt", folder, "--out", tmp_path / "out", "--num-samples", 2, "--num-sampling-steps", 2,
                         "--cpu", "--image-size", 32], capsys)
    assert code == 2 and "Traceback" not in err
    assert "--image-size 32 does not fit" in err and "built for that 4x4 token grid" in err
    assert "Pass --image-size 16 or drop it" in err and not (tmp_path / "out").exists()


def test_diffusers_export_of_another_block_is_refused(lightning_export, tmp_path, capsys):
    from tests.helpers import run_sample as run_cli

    folder, _ = lightning_export
    code, err = run_cli(["export", folder, "--format", "diffusers", tmp_path / "out"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "uses the lightning-qknorm block" in err and "only has the official DiT block" in err
    assert not (tmp_path / "out").exists()


def test_train_help_lists_the_block_flags():
    from train.config import build_parser

    text = build_parser().format_help()
    for flag in ("--block", "--norm", "--mlp", "--rope", "--no-rope", "--qk-norm"):
        assert flag in text

"""The memory planner: measured activations vs an independent count, FLOPs vs the paper, the CLI."""
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from shared.generative.diffusion import create_diffusion
from shared.generative.diffusion import DDPMObjective
from shared.network.models import ModelConfig
from train.memory import ActivationProfile, LinearBytes, forward_macs, measure_block_fit, measure_profile
from train.memory import fixed_state, largest_micro_batch
from tests.helpers import run_main
from train.plan import build_parser, main as plan_main
from train.units import MiB, parse_size

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model="DiT-T/2", image_size=64)  # 8x8 latents, 16 tokens, 6 blocks


class _Held:
    """What autograd keeps in place of a saved tensor: it dies with the graph node that holds it."""

    def __init__(self, tensor):
        self.tensor = tensor.detach()


def independent_saved_bytes(model, batch, dtype):
    """Bytes autograd still holds for backward at the end of one forward + loss, counted directly (written
    independently of train.memory): a node the forward already dropped (e.g. DDPM's exp of the learned log-variance,
    computed but unused by the loss) holds nothing."""
    # Parameters and buffers (e.g. RoPE tables) are resident anyway: the weights, not activations.
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    held = []

    def pack(t):
        kept = _Held(t)
        held.append(weakref.ref(kept))
        return kept

    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(batch, model.in_channels, model.input_size, model.input_size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    y = torch.randint(0, model.num_classes, (batch,), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda kept: kept.tensor), torch.autocast("cpu", dtype=dtype):
        loss = create_diffusion().training_losses(model, x0, t, {"y": y})["loss"].mean()
    alive = [kept.tensor.untyped_storage() for kept in (ref() for ref in held) if kept is not None]
    storages = {s.data_ptr(): s.nbytes() for s in alive}  # all alive together: no address reused
    del loss
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.fixture(scope="module")
def tiny_model():
    return ModelConfig(TINY["model"], TINY["image_size"] // 8).build(device="cpu", init=False)


@pytest.fixture(scope="module")
def block_bf16(tiny_model):
    return measure_block_fit(tiny_model, "bf16")


@pytest.fixture(scope="module")
def profiles(tiny_model, block_bf16):
    """bf16 profiles for checkpointing off, every block and every 2nd block."""
    return {k: measure_profile(tiny_model, k, "bf16", block_bf16, DDPMObjective()) for k in (0, 1, 2)}


@pytest.mark.parametrize("every", [0, 1, 2])
def test_measured_activations_match_an_independent_count(tiny_model, profiles, every):
    tiny_model.set_grad_checkpointing(every)
    for batch in (3, 5):  # neither is a batch the planner measured at (1 and 2)
        assert profiles[every].saved.at(batch) == independent_saved_bytes(tiny_model, batch, torch.bfloat16)
    assert profiles[every].saved.per_sample > 0 and profiles[every].cast_cache > 0


def test_checkpointing_keeps_less_and_recompute_is_one_block(tiny_model, profiles, block_bf16):
    off, every, second = profiles[0], profiles[1], profiles[2]
    depth = len(tiny_model.blocks)
    assert every.saved.per_sample < second.saved.per_sample < off.saved.per_sample
    assert every.saved.per_sample < off.saved.per_sample / 3
    assert off.recompute == LinearBytes(0, 0) and every.recompute == block_bf16
    # Without checkpointing the blocks' saved tensors make up most of the total.
    assert 0.5 * off.saved.per_sample < depth * block_bf16.per_sample < 1.2 * off.saved.per_sample
    assert every.peak(7) == max(every.resident.at(7), every.saved.at(7) + block_bf16.at(7))


def test_fp32_saves_more_than_bf16_and_casts_nothing(tiny_model, profiles):
    fp32 = measure_profile(tiny_model, 0, "no", LinearBytes(0, 0), DDPMObjective())
    assert fp32.cast_cache == 0 and profiles[0].cast_cache > 0
    assert 1.3 < fp32.saved.per_sample / profiles[0].saved.per_sample < 2.1


@pytest.mark.parametrize("name,gmac", [("DiT-S/2", 6.06), ("DiT-XL/2", 118.6), ("DiT-XL/8", 7.4), ("DiT-B/4", 5.57)])
def test_forward_macs_match_the_paper(name, gmac):
    model = ModelConfig(name, 32).build(device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    macs = forward_macs(model)
    digits = len(str(gmac).split(".")[1])  # as precise as the paper's figure
    assert round(macs["total"] / 1e9, digits) == gmac
    assert macs["total"] == sum(v for k, v in macs.items() if k != "total")


DH_TINY = dict(model="DiTDH-T", input_size=4, in_channels=16)  # 16x4x4 tokens, 4 body + 2 head blocks


def test_dit_dh_xl_parameters_and_head_macs_are_counted_from_the_modules():
    """DiTDH-XL on RAE's 768x16x16 tokens: parameters as RAE's paper (839M), head MACs as the arithmetic."""
    from train.memory import count_parameters, head_macs

    model = ModelConfig("DiTDH-XL", 16, in_channels=768, learn_sigma=False, objective="flow").build(device="meta")
    assert count_parameters(model)[0] == 838_675_796 and not model.learn_sigma
    tokens, width, hidden = 256, 2048, 5461  # head: SwiGLU hidden int(2/3 * 4 * 2048)
    per_token = 4 * width**2 + 3 * width * hidden + 6 * width**2 + 2 * tokens * width  # attn, mlp, per-token adaLN, QK/AV
    assert head_macs(model) == 2 * tokens * per_token
    macs = forward_macs(model)
    assert macs["total"] == sum(v for k, v in macs.items() if k != "total") and "other" not in macs
    assert macs["head_condition"] == tokens * 1152 * 2048  # s_projector


@pytest.fixture(scope="module")
def dh_tiny():
    return ModelConfig(**DH_TINY).build(device="cpu", init=False)


def test_dit_dh_head_blocks_are_measured_as_themselves(dh_tiny):
    """The head's blocks (wider, conditioned per token) are measured, and are the block a backward recomputes."""
    from train.memory import measure_block_fits, recompute_fit

    fits = measure_block_fits(dh_tiny, "bf16")
    body, head = fits[range(4)], fits[range(4, 6)]
    assert head.per_sample > 2 * body.per_sample
    assert recompute_fit(fits, 1) == head and recompute_fit(fits, 2) == head  # blocks 4 (and 5) checkpointed
    assert recompute_fit(fits, 3) == body and recompute_fit(fits, 0) == LinearBytes(0, 0)  # 0, 3: body only
    for every in (0, 1):
        profile = measure_profile(dh_tiny, every, "bf16", recompute_fit(fits, every), DDPMObjective())
        dh_tiny.set_grad_checkpointing(every)
        assert profile.saved.at(3) == independent_saved_bytes(dh_tiny, 3, torch.bfloat16)
        if not every:  # the blocks' saved tensors are most of the total, each kind at its own size
            assert 0.6 * profile.saved.per_sample < 4 * body.per_sample + 2 * head.per_sample <= profile.saved.per_sample


def test_xl2_at_512_macs():
    assert round(forward_macs(ModelConfig("DiT-XL/2", 64).build(device="meta"))["total"] / 1e9, 1) == 524.5


def test_fixed_state_of_the_dit_recipe_is_13_5_gb():
    xl = ModelConfig("DiT-XL/2", 32).build(device="meta")
    n_all = sum(p.numel() for p in xl.parameters())
    n_train = sum(p.numel() for p in xl.parameters() if p.requires_grad)
    state = fixed_state(n_all, n_train, "adamw", "gpu")
    assert round(state.total / 1e9, 1) == 13.5
    assert fixed_state(n_all, n_train, "adamw8bit", "cpu").total == 4 * n_all + 4 * n_train + 2 * n_train


def test_largest_micro_batch_divides_the_batch_and_fits():
    profile = ActivationProfile(
        every=0, saved=LinearBytes(10, 100), resident=LinearBytes(10, 100), recompute=LinearBytes(0, 0),
        cast_cache=0)
    assert largest_micro_batch(profile, fixed=1000, budget=1000 + 10 + 100 * 50, batch=256) == 32
    assert largest_micro_batch(profile, fixed=1000, budget=1000 + 10 + 100 * 64, batch=256) == 64
    assert largest_micro_batch(profile, fixed=1000, budget=1000 + 10 + 100 * 64, batch=48) == 48
    assert largest_micro_batch(profile, fixed=1000, budget=1000 + 10 + 99, batch=8) is None


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("1.5 GiB") == int(1.5 * 2**30)
    assert parse_size("22GB") == 22 * 10**9 and parse_size("512MiB") == 512 * MiB
    with pytest.raises(Exception, match="24GiB"):
        parse_size("lots")


def run_plan(*flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread is steadier on a shared CI machine
    return subprocess.run([sys.executable, "-m", "train.plan", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def table_row(stdout, label):
    """Cells of the table line whose checkpointing column is `label`."""
    line = next(l for l in stdout.splitlines() if l.lstrip("* ").startswith(label + "  "))
    return line.lstrip("* ")[len(label):].split()


@pytest.mark.slow
def test_plan_cli_tiny():
    budget = ["--gpu-memory", "200MiB", "--margin", "50MiB", "--global-batch-size", "256"]
    proc = run_plan("--model", "DiT-T/2", "--image-size", "64", "--mixed-precision", "bf16", "--grad-checkpoint", *budget)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in ("weights (fp32 master)", "gradients (fp32)", "optimizer state (AdamW", "EMA (fp32, on gpu)",
                 "workspace margin", "* every block", "every 2nd block", "--micro-batch-size"):
        assert text in out
    # off: "saved recompute const copies micro accum peak peak+margin" with units split off
    off, every = table_row(out, "off"), table_row(out, "every block")
    micro_off, micro_every = int(off[7]), int(every[8])
    assert 256 % micro_off == 0 and 256 % micro_every == 0 and micro_off < micro_every
    assert f"--micro-batch-size {micro_every} (gradient accumulation {256 // micro_every}" in out


@pytest.mark.slow
def test_plan_cli_dit_dh():
    """A DiT^DH preset is planned with its own block (lightning) and head, its MACs and its flow model's outputs."""
    proc = run_plan("--model", "DiTDH-T", "--image-size", "32", "--latent-channels", "16", "--objective", "flow",
                    "--gpu-memory", "200MiB", "--margin", "50MiB", "--global-batch-size", "8")
    assert proc.returncode == 0, proc.stderr
    config = ModelConfig(**DH_TINY, learn_sigma=False, objective="flow")
    params = sum(p.numel() for p in config.build(device="meta").parameters())
    assert f"(lightning block, DiT^DH head of 2 blocks at width 384)" in proc.stdout and f"{params:,} parameters" in proc.stdout
    macs = forward_macs(config.build(device="meta"))["total"]
    assert f"compute: forward {macs / 1e9:.1f} GMAC per image" in " ".join(proc.stdout.split())


@pytest.mark.slow
def test_plan_cli_errors(capsys):
    # As a user runs it: exit status 2 and the paragraph, no traceback.
    proc = run_plan("--model", "DiT-T/2", "--image-size", "64", "--verify")
    assert proc.returncode == 2 and "--verify" in proc.stderr and "CUDA" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The other refusals through the same main() in-process (a process each would only add an interpreter).
    code, _, err = run_main(plan_main, ["--model", "DiT-Q/2"], capsys)
    assert code == 2 and "DiT-XL/2" in err and "Traceback" not in err
    code, _, err = run_main(plan_main, ["--gpu-memory", "lots"], capsys)
    assert code == 2 and "24GiB" in err


def test_every_plan_flag_has_help():
    assert all(action.help for action in build_parser()._actions)

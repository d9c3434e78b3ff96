"""shared/generative/guidance.py: classifier-free guidance against an independent formula, channel handling, errors."""
import pytest
import torch

from shared.runtime.errors import ChoiceError, SettingError, UserError, advise
from shared.generative.guidance import GUIDE_CHANNELS, GuidedModelFn, check_guidance, guide_channel_count
from tests.helpers import inputs, randomize, tiny  # 2-block DiT-T/2, 8x8x4 latents, 5 classes


@pytest.mark.parametrize("guide_channels", [3, None])
def test_guided_prediction_matches_separate_passes(guide_channels):
    """Eq. 6 on the guided channels; the other noise channels and the variance are the conditional pass's."""
    model = randomize(tiny().double()).eval()
    x, t, y = inputs(n=3, dtype=torch.float64)
    with torch.no_grad():
        out = GuidedModelFn(model, 4.0, guide_channels)(x, t, y)
        cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, model.null_label))
    g = 4 if guide_channels is None else 3
    assert out.shape == (3, 8, 8, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, :g], (uncond[:, :g] + 4.0 * (cond[:, :g] - uncond[:, :g])).float())
    torch.testing.assert_close(out[:, g:], cond[:, g:].float())  # channel 3 (with "3") and all variance


def test_one_forward_of_cond_and_null_rows_and_plain_pass_at_scale_one():
    """cfg s: a single 2N-row pass with labels [y; null]; cfg 1: one N-row conditional pass, bit-equal."""
    model = randomize(tiny()).eval()
    seen = []
    model.y_embedder.register_forward_pre_hook(lambda m, args: seen.append(args[0].tolist()))
    x, t, y = inputs(n=3)
    with torch.no_grad():
        plain = GuidedModelFn(model, 1.0, 3)(x, t, y)
        GuidedModelFn(model, 2.5, 3)(x, t, y)
        cond = model(x, t, y)
    assert seen[:2] == [y.tolist(), y.tolist() + [model.null_label] * 3]
    assert torch.equal(plain, cond)


def test_rows_do_not_depend_on_the_batch():
    """Row i's guided output is the same in a batch of 3 as alone (float64, so kernels agree to rounding)."""
    model = randomize(tiny().double()).eval()
    x, t, y = inputs(n=3, dtype=torch.float64)
    fn = GuidedModelFn(model, 4.0, None)
    with torch.no_grad():
        batch = fn(x, t, y)
        alone = torch.cat([fn(x[i:i + 1], t[i:i + 1], y[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batch, alone)


def test_autocast_precision_follows_the_input_device():
    model = randomize(tiny(), scale=0.05).eval()  # small weights: bf16 rounding stays small next to the outputs
    x, t, y = inputs(n=3)
    with torch.no_grad():
        full = GuidedModelFn(model, 4.0, 3, "fp32")(x, t, y)
        half = GuidedModelFn(model, 4.0, 3, "bf16")(x, t, y)
    assert half.dtype == torch.float32 and not torch.equal(full, half)
    torch.testing.assert_close(half, full, rtol=0.1, atol=0.1)
    with pytest.raises(ChoiceError, match="precision"):
        GuidedModelFn(model, 4.0, 3, "fp8")


def test_guide_channel_vocabulary():
    """auto: what the weights' own sampler does (DiT/SiT releases: 3 of 4; REPA, diffusers, our runs: all); '3' is
    refused for any channel count but 4."""
    from shared.generative.guidance import describe_guidance
    assert GUIDE_CHANNELS == ("auto", "3", "all")
    assert guide_channel_count("3", 4) == 3 and guide_channel_count("all", 4) is None
    assert guide_channel_count("auto", 4) is None and guide_channel_count("auto", 8) is None  # our own runs
    assert guide_channel_count("auto", 2) is None and guide_channel_count("all", 8) is None
    with pytest.raises(ChoiceError) as caught:
        guide_channel_count("2", 4)
    assert (caught.value.setting, caught.value.choices) == ("guide-channel choice", list(GUIDE_CHANNELS))
    for channels in (2, 8):
        with pytest.raises(SettingError, match=f"has {channels} latent channels; use guide-channel choice all"):
            guide_channel_count("3", channels)
    from shared.weights.checkpoint import FORMATS

    auto = {f.name: f.auto_guide for f in FORMATS.values()}  # each weight source's own rule, in its record
    AUTO_DIT, AUTO_REPA, AUTO_DIFFUSERS = auto["dit"], auto["repa"], auto["diffusers"]
    AUTO_SIT = AUTO_DIT  # SiT's release has DiT's layout and its sampler keeps DiT's rule
    assert guide_channel_count("auto", 4, AUTO_DIT) == 3 and guide_channel_count("auto", 8, AUTO_DIT) is None
    assert guide_channel_count("auto", 4, AUTO_SIT) == 3 and guide_channel_count("auto", 4, AUTO_REPA) is None
    assert guide_channel_count("auto", 4, AUTO_DIFFUSERS) is None and guide_channel_count("3", 4, AUTO_REPA) == 3
    dit = describe_guidance("auto", 4, 4.0, auto=AUTO_DIT)
    assert "first 3 of 4" in dit and "DiT release" in dit
    assert "all 4 latent channels (auto: trained by this project" in describe_guidance("auto", 4, 4.0)
    assert "all 8 latent channels" in describe_guidance("auto", 8, 4.0, auto=AUTO_DIT)
    assert describe_guidance("3", 4, 1.0) == "guidance: none (cfg scale 1)"


def test_guidance_errors_name_the_setting_and_become_flag_advice():
    """Below 1, or > 1 on a model without a null class (class_dropout_prob 0): a SettingError."""
    with pytest.raises(UserError, match="no null class"):
        GuidedModelFn(tiny(class_dropout_prob=0.0), 1.5)
    GuidedModelFn(tiny(class_dropout_prob=0.0), 1.0)  # no guidance needs no null class
    with pytest.raises(SettingError, match="cfg scale 0.5 is below 1") as caught:
        check_guidance(0.5, True)
    assert "use --cfg-scale 1" in str(advise(caught.value, {"cfg scale": "--cfg-scale"}))

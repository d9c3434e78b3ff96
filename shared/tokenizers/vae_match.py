"""Choosing, checking and loading the VAE that turns sampled latents into pixels.

The latents were made by one VAE (recorded in the weights' or preview file's latent metadata). Another VAE
decodes them without any error into wrong pictures, so every difference is refused unless asked for:
channels and downsample factor always (the decode cannot work or gives the wrong image size), the tokenizer's own
normalisation record (its scaling factor, shift, per-channel statistics) and the config hash unless
--allow-other-vae. Decoding always inverts the normalisation the latents were trained with (`decode_norm`), so an
allowed swap changes the tokenizer, never the scaling.
"""
from __future__ import annotations

from shared.runtime.errors import UserError
from shared.runtime.precision import PRECISIONS
from shared.tokenizers.classes import tokenizer_class
from shared.tokenizers.norm import LatentNorm, norm_of_meta
from shared.tokenizers.vae import LatentVAE, downsample_factor, read_vae_config, resolve_vae_spec
from shared.tokenizers.vae import latent_channels as measured_channels

DEFAULT_VAE = "ema"  # the DiT release samples with sd-vae-ft-ema
# (identity key, words); the first two make decoding impossible or wrong-sized, so no flag overrides them.
_HARD = (("latent_channels", "latent channels"), ("downsample_factor", "downsample factor"))
_SOFT = (("class", "class"), ("scaling_factor", "scaling factor"), ("norm", "own normalisation"),
         ("config_sha256", "config hash"))


def recorded_vae(latent_meta: dict | None) -> str | None:
    """The VAE source a run's latent metadata records (identity dict or plain string), if any."""
    vae = (latent_meta or {}).get("vae")
    if isinstance(vae, dict):
        return vae.get("source")
    return vae if isinstance(vae, str) else None


def recorded_identity(latent_meta: dict | None) -> dict:
    """What the latent metadata says of the VAE that made the latents (only the fields it records)."""
    meta = latent_meta or {}
    vae = meta.get("vae")
    identity = dict(vae) if isinstance(vae, dict) else ({"source": vae} if isinstance(vae, str) else {})
    shape, size = meta.get("latent_shape"), meta.get("image_size")
    if meta.get("scaling_factor") is not None:
        identity.setdefault("scaling_factor", float(meta["scaling_factor"]))
    if shape:
        identity.setdefault("latent_channels", int(shape[0]))
        if size:  # pixels per latent cell, for metadata written before the identity carried it
            identity.setdefault("downsample_factor", int(size) // int(shape[-1]))
    return identity


def choose_vae(spec: str | None, latent_meta: dict | None) -> tuple[str, str]:
    """(--vae or the recorded VAE or 'ema', how it was chosen)."""
    if spec:
        return spec, "from --vae"
    recorded = recorded_vae(latent_meta)
    if recorded:
        return recorded, "recorded in the latent metadata"
    return DEFAULT_VAE, "default (no --vae, none recorded)"


def check_vae_matches(spec: str, vae_config_path, latent_channels: int, latent_meta: dict | None = None,
              allow_other: bool = False, measure: bool = True) -> tuple[str, int | None]:
    """Check the VAE from its config.json only -> (name, downsample factor); UserError when it cannot decode.

    measure=False (a process that must not import diffusers: train's --watch-vae check) compares the channels the
    config declares and no factor (None); the watcher measures both when it loads the VAE.
    """
    name = resolve_vae_spec(spec, vae_config_path)
    config = read_vae_config(spec, vae_config_path)
    kind = tokenizer_class(config, name)
    if measure:  # the encoder run on the meta device: what it really gives
        cheap = {"source": name, "latent_channels": measured_channels(config),
                 "downsample_factor": downsample_factor(config)}
    else:
        cheap = {"source": name, "latent_channels": kind.declared_channels(config)}
    cheap.update({"class": kind.name, **({"family": kind.family} if kind.family != "vae" else {})})
    if "scaling_factor" in config:  # else diffusers' default fills it in at load time: compared then
        cheap["scaling_factor"] = float(config["scaling_factor"])
    recorded = {"latent_channels": latent_channels, **recorded_identity(latent_meta)}
    compare_vae(recorded, cheap, allow_other)
    return name, cheap.get("downsample_factor")


def compare_vae(recorded: dict, actual: dict, allow_other: bool) -> str | None:
    """Refuse a VAE that differs from the recorded one (see the module doc); a note when a difference is allowed."""
    family_problem(recorded, actual)
    hard = _differences(recorded, actual, _HARD)
    if hard:
        raise UserError(f"the VAE {actual.get('source')} cannot decode these latents: {hard}. Decoding would fail "
                        f"or give images of the wrong size, so --allow-other-vae does not apply. Pass the --vae the "
                        f"latents were made with{_named(recorded)}.")
    soft = _differences(recorded, actual, _SOFT)
    if soft and not allow_other:
        raise UserError(f"the VAE {actual.get('source')} is not the one these latents were made with"
                        f"{_named(recorded)}: {soft}. Another VAE decodes them without any error into wrong "
                        f"colours or noise. Pass the --vae the latents were made with (drop --vae to use the "
                        f"recorded one), or add --allow-other-vae if the swap is deliberate.")
    if soft:
        return f"decoding with another VAE than the latents were made with, as --allow-other-vae asks ({soft})"
    if recorded.get("source") and actual.get("source") and recorded["source"] != actual["source"]:
        return (f"decoding with {actual['source']}, not {recorded['source']} recorded with the latents (same "
                f"channels, downsample factor{', scaling factor and config' if 'config_sha256' in actual else ''})")
    return None


FAMILY_WORDS = {"vae": "a VAE's latents", "rae": "RAE tokens (a frozen representation encoder's patch tokens)"}


def _family(identity: dict) -> str | None:
    """"rae" or "vae" for an identity that names its class; None for older metadata that names only a source."""
    if "class" not in identity:
        return None
    return identity.get("family", "vae")


def family_problem(recorded: dict, actual: dict) -> None:
    """Refuse RAE tokens decoded by a VAE and a VAE's latents decoded by an RAE decoder (no flag overrides it)."""
    made, decoder = _family(recorded), _family(actual)
    if made is None or decoder is None or made == decoder:
        return
    raise UserError(f"these latents are {FAMILY_WORDS[made]}, made by {recorded.get('source')} "
                    f"({recorded.get('class')}), but {actual.get('source')} is a {actual.get('class')}, whose "
                    f"decoder expects {FAMILY_WORDS[decoder]}: it would draw noise from them, so --allow-other-vae "
                    f"does not apply. Pass the --vae the latents were made with (drop --vae to use the recorded "
                    f"one).")


def _differences(recorded: dict, actual: dict, fields) -> str:
    """'scaling factor 0.5 in this VAE, 0.18 for the latents; ...' for the fields both sides know and that differ."""
    return "; ".join(f"{words} {_short(actual[key])} in this VAE, {_short(recorded[key])} for the latents"
                     for key, words in fields
                     if key in recorded and key in actual and recorded[key] != actual[key])


def _short(value) -> str:
    """A hash cut to 12 characters; other values as they are."""
    if isinstance(value, dict) and "kind" in value:  # a normalisation record
        return LatentNorm.from_dict(value).describe()
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text[:12] if len(text) == 64 else text


def _named(recorded: dict) -> str:
    """' (SOURCE)' when the metadata names the VAE."""
    return f" ({recorded['source']})" if recorded.get("source") else ""


def load_vae(spec: str, vae_config_path, device, precision: str, tiling: bool, slicing: bool) -> LatentVAE:
    """Load the VAE for decoding in `precision`, with diffusers' tiling/slicing switches."""
    vae = LatentVAE.load(spec, device=device, dtype=PRECISIONS[precision], config=vae_config_path)
    if tiling:
        vae.enable_tiling()
    if slicing:
        vae.enable_slicing()
    return vae


def decode_norm(vae: LatentVAE, latent_meta: dict | None) -> tuple[LatentNorm, str | None]:
    """The normalisation to invert before decoding: the one the latents were trained with, else the VAE's own."""
    trained = norm_of_meta(latent_meta)
    if trained is None:
        return vae.norm, None
    trained.check_channels(vae.latent_channels, f"the VAE {vae.identity['source']}")
    if vae.norm is None:  # a tokenizer without numbers of its own (an RAE without statistics): the training one
        return trained, None
    if trained == vae.norm:
        return trained, None
    return trained, (f"latents were normalised as {trained.describe()} in training, the VAE's own convention is "
                     f"{vae.norm.describe()}; decoding inverts the training one")


def check_loaded_vae(vae: LatentVAE, latent_meta: dict | None, allow_other: bool) -> tuple[LatentNorm, str | None]:
    """The full identity check once loaded (the hash needs diffusers' filled-in config) -> (norm to invert, note)."""
    note = compare_vae(recorded_identity(latent_meta), vae.identity, allow_other)
    norm, norm_note = decode_norm(vae, latent_meta)
    return norm, "; ".join(n for n in (note, norm_note) if n) or None

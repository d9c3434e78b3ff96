"""Choosing, checking and loading the VAE that turns sampled latents into pixels."""
from __future__ import annotations

from shared.errors import UserError
from shared.vae import LatentVAE, downsample_factor, read_vae_config, resolve_vae_spec

from shared.precision import PRECISIONS

DEFAULT_VAE = "ema"  # the DiT release samples with sd-vae-ft-ema


def recorded_vae(latent_meta: dict | None) -> str | None:
    """The VAE source a run's latent metadata records (identity dict or plain string), if any."""
    vae = (latent_meta or {}).get("vae")
    if isinstance(vae, dict):
        return vae.get("source")
    return vae if isinstance(vae, str) else None


def choose_vae(spec: str | None, latent_meta: dict | None) -> tuple[str, str]:
    """(--vae or the recorded VAE or 'ema', how it was chosen)."""
    if spec:
        return spec, "from --vae"
    recorded = recorded_vae(latent_meta)
    if recorded:
        return recorded, "recorded in the weights' latent metadata"
    return DEFAULT_VAE, "default (no --vae, none recorded)"


def check_vae(spec: str, vae_config_path, latent_channels: int) -> tuple[str, int]:
    """Resolve the spec cheaply (config only) -> (name, downsample factor); UserError on a channel mismatch."""
    name = resolve_vae_spec(spec, vae_config_path)
    config = read_vae_config(spec, vae_config_path)
    channels = int(config.get("latent_channels", 4))
    if channels != latent_channels:
        raise UserError(f"the VAE {name} has {channels} latent channels but the latents have {latent_channels}; "
                        f"pass the --vae the latents were extracted with (a {latent_channels}-channel VAE).")
    return name, downsample_factor(config)


def load_vae(spec: str, vae_config_path, device, precision: str, tiling: bool, slicing: bool) -> LatentVAE:
    """Load the VAE for decoding in `precision`, with diffusers' tiling/slicing switches."""
    vae = LatentVAE.load(spec, device=device, dtype=PRECISIONS[precision], config=vae_config_path)
    if tiling:
        vae.enable_tiling()
    if slicing:
        vae.enable_slicing()
    return vae


def latent_rescale(vae: LatentVAE, latent_meta: dict | None) -> tuple[float, str | None]:
    """Factor taking latents in the training scale to this VAE's scale, and a note when it is not 1."""
    trained = (latent_meta or {}).get("scaling_factor")
    if trained is None or float(trained) == vae.scaling_factor:
        return 1.0, None
    note = (f"latents were scaled by {trained} in training but this VAE's scaling_factor is "
            f"{vae.scaling_factor}; decoding divides by {trained}")
    return vae.scaling_factor / float(trained), note

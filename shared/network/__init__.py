"""The diffusion transformer: DiT and its presets and config, the REPA projector, the diffusers DiT layout mapping."""

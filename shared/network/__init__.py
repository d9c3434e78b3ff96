"""The diffusion transformer: DiT and its presets and config, the REPA projector, token routing (TREAD), the diffusers DiT layout mapping."""

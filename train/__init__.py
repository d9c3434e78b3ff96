"""The train stage: `python -m train` streams cached latents into a DiT under Accelerate.

Modules: config (TrainConfig, flags, checks), data (position-keyed draws), loop (the training loop),
checkpoint (run-folder state), logger, preview (--sample-every latents). Never imports diffusers.
"""

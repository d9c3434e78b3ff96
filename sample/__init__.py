"""The sample stage: DiT weights (run folder, export, official .pt or diffusers DiT) -> CFG sampling -> VAE -> PNGs.

Modules: generate.py (`python -m sample`: sample.generate.run_sample), image_draws.py (image i's label and
noise from (--seed, i)), checkpoint.py (the weights --ckpt names), official.py (the release's checkpoints by
name), lightningdit.py (LightningDiT's releases in the lightning block), diffusers_folder.py (diffusers DiTs), outputs.py (the --out folder: PNGs, settings.json, grid, npz),
decode.py (`python -m sample decode`), watch.py (`python -m sample watch`), export.py (`python -m sample
export`: a diffusers DiTPipeline folder).
"""

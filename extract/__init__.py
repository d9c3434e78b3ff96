"""The extract stage, `python -m extract`: an ImageFolder encoded once by a frozen VAE into latent shards.

Decoding (in DataLoader workers too) and ADM preprocessing live in shared.datasets.images, the ImageFolder scan in
shared.datasets.imagefolder and shared.datasets.duplicates (evaluate's reference command finds and crops images
alike). Modules: sizes.py (--image-size against the VAE and the DiT presets), config.py (the flags and the plan,
checked before any weights load), run.py (the resumable job: encode, index last), dry_run.py (`--dry-run`: the plan
in words), check.py (`--check`: the dataset without a VAE), verify.py (`--verify`: hash a finished folder), stats.py
(`--stats`: the per-channel latent statistics of a finished folder, from its stored moments).
"""

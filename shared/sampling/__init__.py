"""Drawing images from weights: the plan (flags, labels, sampler, guidance, the out folder's checks), each image's
label and noise from (seed, index), the guided sampler run, the VAE decode, and the output folder (PNGs, grid, npz,
settings); `python -m sample` and `python -m evaluate run` both draw through it."""

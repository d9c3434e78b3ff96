"""Images <-> latents: the tokenizers (the VAE wrapper, sole owner of the latent scaling), the VAE that decodes, REPA's representation encoder, pixel ranges."""

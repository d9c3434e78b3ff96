"""DiT weights from wherever they come: a run folder or export, the releases by name (DiT, SiT, REPA, RAE, LightningDiT), a diffusers DiT; checked and read with their config."""

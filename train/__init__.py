"""The train stage: `python -m train` streams cached latents into a DiT under Accelerate. Never imports diffusers.

Modules: config.py (TrainConfig: every flag, the checks), recipes.py (--recipe dit|sit|lightning|rae|meanflow), init_from.py (--init-from: a flow model's weights, checked, into a MeanFlow run), step.py (the one
training step), loop.py (setup, resume, the position-keyed data stream, guards, checkpoints), checkpoint.py (run-folder state), callbacks.py
(hooks), logger.py (log.txt, metrics.jsonl), preview.py (--sample-every latents), trackers.py (--report-to,
curves at checkpoints, --watch-vae), plot.py (`python -m train.plot`), memory.py and units.py (the step's
cost and memory sizes), plan.py (`python -m train.plan`), bench.py (`python -m train.bench`), autotune.py (the `auto` micro-batch,
precision and checkpointing), launcher.py (the accelerate config: followed or refused), latents.py (--latents
URLs copied to a local cache), estimate.py (a step's duration on a CPU, said before the model is built).
"""

"""The DiT training loop over cached latents: `train` = make_plan -> setup_run -> run_training.

make_plan resolves every object of the run once (TrainPlan); setup_run builds the learner and restores a resume;
run_training logs, loops, guards, checkpoints; make_loader is the data stream (positions and per-position draws).
The optimizer step is train/step.py's; Accelerate provides the processes, DDP, `no_sync` and the reductions.
"""
from __future__ import annotations

import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from shared.runtime import rundir
from shared.runtime.distributed import default_workers
from shared.runtime.errors import UserError
from shared.weights.export import save_weights, write_safetensors
from shared.runtime.fsio import atomic_write_json, atomic_write_text, link_file, publish_dir, space_guard
from shared.sampling.previews import write_preview
from shared.runtime.lock import FolderLock, hold_lock
from shared.network.attention import resolve_attention
from shared.network.blocks import block_summary
from shared.runtime.precision import set_tf32
from shared.datasets.shards import LatentDataset
from shared.generative.objectives import Objective, objective_of
from shared.network.models import ModelConfig
from shared.network.routing import draw_kept
from shared.runtime.seeding import generator_for
from shared.tokenizers.space import LatentSpace
from train import checkpoint as ckpt_io
from train.callbacks import Callback, CallbackList
from train.autotune import describe as describe_auto, resolve_auto_for
from train.config import DEBUG_STEPS, TrainConfig, check_config, check_resume, model_config_for, resolve_config
from train.init_from import InitWeights, apply_init, fit_init, read_init
from train.latents import StreamSampler, follow, open_latents, resolve_shard_window
from train.launcher import check_strategy, resolve_precision_with_launcher
from train.logger import Meter, RunLogger
from train.preview import sample_preview
from train.step import Learner, check_compile, import_bitsandbytes, make_learner, train_step
from train.trackers import accelerator_kwargs, check_watch, default_callbacks


class NonFiniteError(UserError):
    """Training produced too many consecutive non-finite losses or gradient norms."""


class InconsistentRanksError(UserError):
    """The processes of a multi-process run hold different weights (DDP went out of sync)."""


@dataclass(frozen=True)
class TrainPlan:
    """What a run is, resolved once by make_plan before any model exists; everything after only reads it."""
    cfg: TrainConfig                 # every "auto" resolved, checked against the latents and the resume source
    dataset: LatentDataset
    space: LatentSpace               # the run's latent space (tokenizer + normalisation): recorded in every export
    model_config: ModelConfig        # the DiT this run trains (a resumed run keeps its checkpoint's output layout)
    objective: Objective             # time draws, loss and previews (shared/generative/objectives.py)
    source: Path | None = None       # the checkpoint this run continues from
    changes: tuple[str, ...] = ()    # the config changes a resume allows (logged)
    init: InitWeights | None = None  # --init-from's weights, checked, for a run that starts now


@dataclass
class Run:
    """Everything the loop needs, built once by setup_run: the plan, the learner, logs and hooks."""
    plan: TrainPlan
    learner: Learner
    logger: RunLogger
    callbacks: CallbackList = field(default_factory=CallbackList)
    data_position: int = 0  # global stream position of the next sample (all processes together)
    # on the device (track_nonfinite): the non-finite streak, the step it first reached --max-nonfinite (-1: not yet)
    nonfinite_streak: torch.Tensor | int = 0
    nonfinite_at: torch.Tensor | None = None
    last_checkpoint: Path | None = None

    dataset = property(lambda self: self.plan.dataset, doc="The plan's LatentDataset.")
    cfg = property(lambda self: self.plan.cfg, doc="The plan's resolved TrainConfig.")
    accelerator = property(lambda self: self.learner.accelerator, doc="The learner's Accelerator.")
    step = property(lambda self: self.learner.step, doc="Optimizer steps taken so far (the learner's).")
    device = property(lambda self: self.learner.device, doc="The learner's torch.device.")
    is_main = property(lambda self: self.accelerator.is_main_process, doc="Whether this is the main process.")
    run_dir = property(lambda self: Path(self.cfg.results_dir), doc="The run folder, --results-dir.")


def make_plan(cfg: TrainConfig, accelerator) -> TrainPlan:
    """Open the latents, find the resume source, resolve and check the config: each object of the run, once."""
    dataset = open_latents(cfg.latents, accelerator, cfg.cache_limit)  # URL -> local cache; verified once per node
    check_config(cfg, dataset)  # the flags against the latents; fills the block, objective options, cfg.space
    resolve_shard_window(cfg, dataset)  # the data order: before the resume check compares it
    source, saved = ckpt_io.resume_source(cfg)
    # --init-from's weights, before the model config (it records their convention); a resumed run keeps its record
    init = read_init(cfg, dataset) if cfg.init_from and saved is None else None
    if cfg.init_from:
        cfg.init = saved.init if saved is not None else init.record
    resumed = ckpt_io.checkpoint_config(source) if source is not None else None  # its output layout is kept
    model_config = model_config_for(cfg, dataset.latent_shape, dataset.num_classes, resumed)
    init = fit_init(init, model_config) if init is not None else None
    resolve_auto_for(cfg, model_config, accelerator)  # train/autotune.py: micro-batch, precision, checkpointing
    resolve_config(cfg, dataset, accelerator.num_processes)
    # what this machine and install must provide for the settings: attention kernel, compile, 8-bit AdamW, VAE
    check_watch(cfg, dataset)
    resolve_attention(cfg.attention)
    check_compile(cfg, accelerator.device)
    if cfg.attention == "xformers" and not torch.cuda.is_available():
        raise UserError("--attention xformers needs a CUDA GPU; this machine has none. Use --attention sdpa.")
    if cfg.optimizer == "adamw8bit":
        import_bitsandbytes()
    if cfg.debug:
        cfg.log_every = 1  # --debug logs every step
    changes = check_resume(saved, cfg, source) if saved is not None else []
    return TrainPlan(cfg=cfg, dataset=dataset, space=cfg.space, model_config=model_config,
                     objective=objective_of(model_config, **cfg.objective_options), source=source,
                     changes=tuple(changes), init=init)


def setup_run(plan: TrainPlan, accelerator, callbacks: list[Callback]) -> Run:
    """Build the learner on this process's device, start it from --init-from's weights or restore the resume source."""
    cfg = plan.cfg
    set_tf32(accelerator.device)  # TF32 matmuls on CUDA
    torch.autograd.set_detect_anomaly(cfg.debug)  # anomaly detection in --debug
    learner = make_learner(cfg, plan.model_config, accelerator=accelerator, objective=plan.objective)
    if plan.init is not None:
        apply_init(learner.dit, learner.ema, plan.init)  # in place: the wrappers and the optimizer share the tensors
    seed = cfg.seed * 1009 + accelerator.process_index  # per rank (the training draws are keyed by stream position)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    logger = RunLogger(Path(cfg.results_dir), enabled=accelerator.is_main_process, write_files=not cfg.debug)
    run = Run(plan=plan, learner=learner, logger=logger,
              callbacks=CallbackList(default_callbacks(cfg) + list(callbacks)))
    if plan.source is not None:
        ckpt_io.restore(run, plan.source)  # in place into the parameters the compiled/DDP wrappers share
    run.callbacks.on_setup(run)
    return run


def track_nonfinite(run: Run, result: dict) -> None:
    """Count consecutive non-finite steps on the device (no host sync); guard_nonfinite reads the count."""
    bad = ~(torch.isfinite(result["loss"]) & torch.isfinite(result["grad_norm"]))  # () bool
    run.nonfinite_streak = (run.nonfinite_streak + 1) * bad  # () int64: 0 after a finite step
    limit = run.cfg.max_nonfinite
    if limit:
        first = run.nonfinite_at if run.nonfinite_at is not None else torch.full_like(run.nonfinite_streak, -1)
        run.nonfinite_at = torch.where((run.nonfinite_streak >= limit) & (first < 0), run.step, first)


def guard_nonfinite(run: Run) -> None:
    """Stop with advice once --max-nonfinite consecutive non-finite steps were counted (one host sync)."""
    if run.nonfinite_at is not None and int(run.nonfinite_at) >= 0:
        raise NonFiniteError(_nonfinite_message(run, int(run.nonfinite_at)))


def _nonfinite_message(run: Run, at: int | None = None) -> str:
    """Why the run stopped (the limit reached at step `at`), likely causes, and where the last good state is."""
    last = run.last_checkpoint or "none yet (the run never reached a checkpoint)"
    precision = ("fp16 overflow: switch to --precision bf16, or lower --lr" if run.cfg.precision == "fp16" else
                 "a learning rate too high for this model/batch: lower --lr or add --warmup-steps / --max-grad-norm")
    streak = run.cfg.max_nonfinite if at is not None else int(run.nonfinite_streak)
    at = run.step if at is None else at
    when = (f"at step {at}" if at == run.step else
            f"at step {run.step} (checked at --log-every points) from step {at} on")
    return (f"training stopped {when}: {streak} consecutive steps had a non-finite loss or "
            f"gradient norm (weights were not updated on those steps). Likely causes: {precision}; or bad latents "
            f"(NaN/inf moments: re-extract, or check the folder with a verifying reader). The last good checkpoint "
            f"is {last}; rerun the same command with the changed flags (--precision, --lr, --warmup-steps, "
            "--max-grad-norm may change on resume) and it continues from there.")


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (a non-finite checkpoint is never written); one host sync."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def check_consistency(run: Run) -> None:
    """Every rank must hold the same weights and EMA (as edm2's check_ddp_consistency); else stop, naming them."""
    acc = run.accelerator
    if acc.num_processes == 1:
        return
    models = (("model", run.learner.dit), ("ema", run.learner.ema))
    names = [f"{tag}.{n}" for tag, model in models for n, _ in model.named_parameters()]
    with torch.no_grad():  # (P, 2) float64 per parameter: sum and sum of squares (bitwise equal on ranks that agree)
        mine = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]).to(run.device)
                            for _, model in models for p in model.parameters()])
    everyone = acc.gather(mine[None]).cpu()  # (world, P, 2)
    differ = ~(everyone == everyone[:1]).all(dim=2)  # (world, P): NaN also counts as a difference
    if bool(differ.any()):
        ranks = sorted({int(r) for r in differ.any(dim=1).nonzero().flatten()})
        first = names[int(differ.any(dim=0).nonzero()[0])]
        raise InconsistentRanksError(
            f"at step {run.step} the weights of process(es) {ranks} differ from process 0 (first: {first}); the "
            "processes went out of sync, so no checkpoint was written at this step. This points at a broken "
            "data-parallel setup (a custom launcher, mismatched library versions across nodes, or a hardware "
            f"fault). The last consistent checkpoint is {run.last_checkpoint or 'none yet'}; rerun the same "
            "command to resume from it.")


def save_checkpoint(run: Run) -> Path | None:
    """Write the full state (all ranks take part), the EMA export, and prune old checkpoints."""
    if run.cfg.debug:
        return None
    if not (weights_finite(run.learner.dit) and weights_finite(run.learner.ema)):
        raise NonFiniteError(f"the weights became non-finite at step {run.step}; no checkpoint was written. "
                             + _nonfinite_message(run))
    check_consistency(run)
    acc = run.accelerator
    tmp = rundir.staging_path(run.run_dir, run.step)
    if run.is_main:  # a fresh staging folder: any leftover from a killed run is removed first
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    torch.save(ckpt_io.capture_rng(), tmp / rundir.rng_file(acc.process_index))  # each process its own RNG state
    acc.wait_for_everyone()
    if run.is_main:
        try:
            # the guard judges torch.save's opaque full-disk error by the free space: before the staging folder goes
            with space_guard(tmp / rundir.MODEL_FILE):
                _write_main(run, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the rerun resumes from the last checkpoint
            raise
    acc.wait_for_everyone()
    run.last_checkpoint = rundir.checkpoint_path(run.run_dir, run.step)
    run.callbacks.on_checkpoint(run, run.last_checkpoint)
    return run.last_checkpoint


def _write_main(run: Run, tmp: Path) -> None:
    """Main process part of a checkpoint: weights, optimizer, scaler, state.json, publish, export, prune."""
    learner = run.learner
    for name, model in ((rundir.MODEL_FILE, learner.dit), (rundir.EMA_FILE, learner.ema)):  # as write_export's
        save_weights(tmp / name, model.state_dict(), learner.model_config, run.plan.space, run.step)
    state = {"step": run.step, "data_position": run.data_position, "world_size": run.cfg.world_size,
             "skipped_steps": learner.skipped_steps, "config": run.cfg.to_dict()}
    for column, _ in learner.consumers:
        head = learner.heads[column.name].state_dict()
        write_safetensors(tmp / column.checkpoint_file, {k: v.detach().cpu().contiguous() for k, v in head.items()})
    torch.save(learner.optimizer.state_dict(), tmp / rundir.OPTIMIZER_FILE)
    torch.save(learner.scaler.state_dict(), tmp / rundir.SCALER_FILE)
    atomic_write_json(tmp / rundir.STATE_FILE, state, indent=2)  # last
    final = publish_dir(tmp, rundir.checkpoint_path(run.run_dir, run.step))  # fsync, then one atomic rename
    run.callbacks.on_publish(run, final)
    write_export(run)
    pruned = ckpt_io.prune(run.run_dir, run.cfg.keep_last, run.cfg.keep_exports)
    run.logger.info(f"saved checkpoint {final}" + (f" (removed {', '.join(p.name for p in pruned)})" if pruned else ""))


def write_export(run: Run) -> Path:
    """The slim EMA export of this step: a hard link to its checkpoint's EMA file (same bytes), else a fresh write."""
    path = rundir.export_path(run.run_dir, run.step)
    stored = rundir.checkpoint_path(run.run_dir, run.step) / rundir.EMA_FILE
    if stored.is_file() and link_file(stored, path):
        return path
    return save_weights(path, run.learner.ema.state_dict(), run.learner.model_config, run.plan.space, run.step)


def save_samples(run: Run) -> None:
    """Main process: EMA preview latents -> RUN/samples/step-X.safetensors (others wait)."""
    if run.is_main and not run.cfg.debug:
        ema, home = run.learner.ema, next(run.learner.ema.parameters()).device
        ema.to(run.device)  # an EMA kept on the CPU visits the GPU for sampling (exact fp32 round trip)
        try:
            latents, labels = sample_preview(ema, run.dataset.latent_shape, run.cfg.sample_steps,
                                             run.cfg.sample_cfg_scale, run.cfg.sample_guide_channels, run.device,
                                             run.learner.objective, run.learner.model_config.sampling)
        finally:
            ema.to(home)
        path = write_preview(rundir.sample_path(run.run_dir, run.step), latents, labels, run.plan.space, run.step)
        run.logger.info(f"saved samples {path}")
    run.accelerator.wait_for_everyone()


def start_logs(run: Run) -> None:
    """config.json, the resume note, metrics truncated to the resumed step, a missing export repaired."""
    source = run.plan.source
    if run.is_main and not run.cfg.debug:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        removed = rundir.list_partial(run.run_dir)  # half-written checkpoint folders of a killed run
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        atomic_write_text(rundir.config_path(run.run_dir), run.cfg.to_json() + "\n")
        run.logger.truncate_after(run.step)
        for path in removed:
            run.logger.info(f"removed a half-written checkpoint {path.name} left by an interrupted run")
        if source is not None and not rundir.export_path(run.run_dir, run.step).is_file():
            write_export(run)  # a kill between publishing a checkpoint and writing its export
            run.logger.info(f"wrote the missing EMA export of step {run.step}")
    run.accelerator.wait_for_everyone()
    cfg, n = run.cfg, run.accelerator.num_processes
    where = f"resumed from {source} at step {run.step}" if source else "starting a new run"
    run.logger.info(f"{where}: {cfg.model} ({cfg.block} block: {block_summary(cfg.block_options)}), "
                    f"{sum(p.numel() for p in run.learner.dit.parameters()):,} parameters, {n} process(es) on "
                    f"{run.device}, global batch {cfg.global_batch_size} = {cfg.micro_batch_size} x "
                    f"{cfg.grad_accum_steps} accumulation x {n}, precision {cfg.precision}, {cfg.total_steps} steps")
    if run.learner.route:
        tokens, kept = run.learner.route
        run.logger.info(f"token routing (TREAD): {tokens - kept} of {tokens} tokens per sample skip blocks "
                        f"{cfg.route_start}..{cfg.route_end} in training; sampling uses every token")
    if cfg.autotune:
        run.logger.info(describe_auto(cfg.autotune))
    for change in run.plan.changes:
        run.logger.info(f"changed on resume: {change}")


# Each sample in the global stream has a position p (samples consumed before it by all processes together, see
# train.latents.StreamSampler). All of its randomness (time, class dropout, flip variant, posterior draw, noise, routed
# tokens) comes from one generator seeded by (seed, p), as edm2 keys its randomness on (seed, images seen): the same
# draws whatever the number of processes, micro-batch size, DataLoader workers, or where a run was interrupted.

class PositionedSampler(StreamSampler):
    """StreamSampler that also yields each index's global stream position: (position, index) pairs."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # Rank r owns the positions p >= start with p % world_size == r, in order (StreamSampler contract).
        position = self.start + (self.rank - self.start) % self.world_size
        for index in super().__iter__():
            yield position, index
            position += self.world_size


class TrainingDraws(torch.utils.data.Dataset):
    """Wraps a LatentDataset: a batch of (position, index) pairs -> the tensors one training micro-step needs:
    x0 (B,C,h,w) fp32 latents normalised by `norm` (the run's LatentNorm; default: the tokenizer's own), label (B,),
    drop (B,) class dropout, t (B,) the objective's times, noise (B,C,h,w), position (B,) (keys all of its draws);
    each `extra` column (B, ...) fp32 of the latent's flip variant (REPA's "repr"); with `route` (tokens T, kept K),
    route_keep (B,K): the tokens that pass the routed blocks (shared/network/routing.py)."""

    def __init__(self, dataset: LatentDataset, seed: int, class_dropout_prob: float, objective,
                 extra: tuple = (), route: tuple[int, int] | None = None, norm=None):
        self.dataset, self.seed, self.class_dropout_prob, self.objective = dataset, seed, class_dropout_prob, objective
        self.norm = norm or dataset.native_norm
        self.extra, self.route = tuple(extra), route  # extra: besides the moments, the only columns read

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, pairs) -> dict:
        positions = torch.tensor([p for p, _ in pairs], dtype=torch.int64)  # (B,)
        gens = [generator_for(self.seed, int(p)) for p in positions]
        # Draw order per sample is fixed: timestep, dropout coin, flip variant, posterior eps, diffusion noise.
        t = torch.cat([self.objective.draw_time(g) for g in gens])  # (B,)
        drop = torch.cat([torch.rand(1, generator=g) for g in gens]) < self.class_dropout_prob  # (B,)
        flips = self.dataset.flips
        variant = torch.cat([torch.randint(0, flips, (1,), generator=g) for g in gens])  # (B,)
        # Only the drawn flip of each column is read (the other frames' bytes stay on disk).
        batch = self.dataset.draw(np.array([i for _, i in pairs], dtype=np.int64), variant.tolist(), self.norm, gens,
                                  self.extra)
        x0 = batch["x0"]  # (B, C, h, w) fp32, normalised
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])  # (B, C, h, w)
        out = {"x0": x0, "label": batch["label"].long(), "drop": drop, "t": t, "noise": noise, "position": positions}
        if self.route:  # drawn last, so the draws above are the same with routing on or off
            out["route_keep"] = torch.stack([draw_kept(g, *self.route) for g in gens])  # (B, K)
        out.update({name: batch[name].float() for name in self.extra})  # (B, ...), of flip `variant`
        return out


def make_loader(dataset: LatentDataset, *, micro_batch: int, rank: int, world_size: int, seed: int, start: int,
                class_dropout_prob: float, num_workers: int, pin_memory: bool, objective,
                extra: tuple = (), route: tuple[int, int] | None = None, norm=None, window: int = 0,
                global_batch: int | None = None) -> Iterator[dict]:
    """An endless iterator of micro-batches for this rank from global stream position `start`; window K > 0: the
    shard-aware order (train.latents.windowed_permutation). `follow` tells a streamed dataset what was consumed."""
    sampler = PositionedSampler(len(dataset), rank, world_size, seed, start=start,
                                counts=dataset.shard_counts if window else None, window=window)
    loader = torch.utils.data.DataLoader(
        TrainingDraws(dataset, seed, class_dropout_prob, objective, extra, route, norm), batch_size=micro_batch,
        sampler=sampler, num_workers=num_workers, pin_memory=pin_memory, collate_fn=dict,  # already batched
        generator=torch.Generator().manual_seed(seed),  # its own: worker seeding never consumes the global torch RNG
        persistent_workers=False)
    global_batch = global_batch or micro_batch * world_size
    ahead = global_batch + (loader.prefetch_factor or 0) * num_workers * micro_batch * world_size  # positions
    return follow(iter(loader), dataset, seed=seed, window=window, start=start, global_batch=global_batch,
                  accum=max(1, global_batch // (micro_batch * world_size)), readahead=ahead)


def _due(step: int, every: int) -> bool:
    """Whether a periodic action is due after `step` steps."""
    return every > 0 and step % every == 0


def micro_batches(run: Run, loader) -> Iterator[dict]:
    """The next step's micro-batches, drawn lazily (callbacks see each just before its forward)."""
    for _ in range(run.cfg.grad_accum_steps):
        batch = next(loader)
        run.callbacks.on_micro_batch(run, batch)
        yield batch


WORKER_CAP = 4  # DataLoader workers per process by default (--num-workers), where the cores allow


def run_loop(run: Run) -> dict:
    """Train until total_steps; checkpoint, preview and log along the way; return the last metrics."""
    cfg = run.cfg
    total = min(cfg.total_steps, run.step + DEBUG_STEPS) if cfg.debug else cfg.total_steps
    workers = default_workers(WORKER_CAP, run.accelerator.num_processes) if cfg.num_workers is None else cfg.num_workers
    loader = make_loader(run.dataset, micro_batch=cfg.micro_batch_size, rank=run.accelerator.process_index,
                         world_size=run.accelerator.num_processes, seed=cfg.seed, start=run.data_position,
                         class_dropout_prob=cfg.class_dropout_prob, num_workers=workers,
                         pin_memory=run.device.type == "cuda", objective=run.learner.objective,
                         extra=tuple(c.name for c, _ in run.learner.consumers), route=run.learner.route,
                         norm=run.plan.space.norm, window=cfg.shard_window, global_batch=cfg.global_batch_size)
    meter, last = Meter(), {}
    bar = tqdm(total=total, initial=run.step, desc="train", unit="step", disable=not run.is_main, dynamic_ncols=True)
    with bar:
        while run.step < total:
            result = train_step(run.learner, micro_batches(run, loader))  # device tensors: nothing waits here
            run.data_position += cfg.global_batch_size
            run.callbacks.on_step_end(run, result)
            meter.add(result)
            track_nonfinite(run, result)
            bar.update(1)
            log, preview = _due(run.step, cfg.log_every) or run.step == total, _due(run.step, cfg.sample_every)
            save = _due(run.step, cfg.ckpt_every) or run.step == total
            if log or preview or save:  # the only points where the host reads the device
                guard_nonfinite(run)
            if log:
                last = meter.summary(run)
                run.logger.metrics(run.step, last)
                bar.set_postfix(loss=f"{last['loss']:.4f}", skipped=last["skipped_total"])
            if preview:
                save_samples(run)
            if save:
                save_checkpoint(run)
    return last


def lock_run_folder(cfg: TrainConfig, accelerator) -> FolderLock | None:
    """Rank 0 takes the run folder's exclusive lock (before reading checkpoints); every rank stops if it is busy."""
    from accelerate.utils import broadcast_object_list

    if cfg.dry_run or cfg.debug:  # they write nothing: no lock
        return None
    lock, error = None, None
    if accelerator.is_main_process:
        try:
            ckpt_io.check_results_dir(cfg)
            lock = hold_lock(cfg.results_dir, "run folder")
        except UserError as err:
            error = err
    if accelerator.num_processes > 1:
        error = broadcast_object_list([error], from_process=0)[0]
    if error is not None:
        raise error if accelerator.is_main_process else SystemExit(2)  # rank 0 prints the paragraph; others leave
    return lock


def train(cfg: TrainConfig, callbacks: list[Callback] = ()) -> dict:
    """Run (or resume) the training run `cfg` describes: plan, set up, loop; returns the last logged metrics."""
    from accelerate import Accelerator

    check_strategy()  # FSDP / DeepSpeed launcher configs: refused before anything exists
    resolve_precision_with_launcher(cfg.precision)  # a contradicting --precision: refused before anything exists
    accelerator = Accelerator(mixed_precision="no", **accelerator_kwargs(cfg))  # one per process; precision: step.py's
    lock = lock_run_folder(cfg, accelerator)
    try:
        plan = make_plan(cfg, accelerator)  # every check and resolution, before any model exists
        if accelerator.is_main_process and accelerator.device.type == "cpu":  # what a step will cost
            from train.estimate import describe_cpu_step

            print(f"train: {describe_cpu_step(plan.model_config, cfg.global_batch_size, cfg.total_steps)}",
                  file=sys.stderr, flush=True)
        if accelerator.is_main_process and (cfg.dry_run or cfg.debug):
            print(cfg.to_json())  # the resolved config
        if cfg.dry_run:
            return {}
        return run_training(setup_run(plan, accelerator, list(callbacks)))
    finally:
        if lock is not None:
            lock.release()


def run_training(run: Run) -> dict:
    """Logs started, the loop to the last step (checkpointing on the way and at the end); an OOM as one paragraph."""
    try:
        start_logs(run)
        last = run_loop(run)
        run.callbacks.on_train_end(run)
        run.logger.info(f"done: step {run.step}, last checkpoint {run.last_checkpoint}")
        return last
    except torch.OutOfMemoryError as err:  # checkpoints are published whole or not at all: the last one stands
        from train.plan import out_of_memory_error  # the smaller settings and the planner's command

        card = torch.cuda.get_device_properties(run.device).total_memory if run.device.type == "cuda" else None
        stop = out_of_memory_error(run.cfg, run.dataset.latent_shape, run.dataset.num_classes, run.step,
                                   run.last_checkpoint, err, card)
    finally:
        run.logger.close()
    raise stop  # outside the handler, so the paragraph does not hold the failed step's tensors

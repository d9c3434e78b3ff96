"""`python -m train.plot RUN`: a run's curves as one PNG (RUN/curves.png).

Panels: TRAIN_PANELS where metrics.jsonl has them, and one per quality metric of RUN/eval.jsonl. Drawn on
matplotlib's Agg canvas without pyplot (no display, no global state), so the loop redraws it at every checkpoint.
"""
from __future__ import annotations

from shared.runtime.interrupt import guard_imports, interruptible

guard_imports(__name__)  # before the imports below: a Ctrl-C during them ends in one line, exit status 130

import argparse
import math
import sys
import time
from pathlib import Path

from shared.runtime import rundir
from shared.runtime.errors import UserError, cli_errors
from shared.sampling.evalcurve import draw_metric, is_number, metric_lines, metric_title, metrics_of
from shared.runtime.fsio import atomic_write

PROG = "python -m train.plot"
SMOOTH_SHARE = 50  # default smoothing: an EMA over about 1/50 of the logged points (TensorBoard's fixed 0.9
#                    flattens a 20-point demo run and barely smooths 4,000 points of a long one)
# (metrics.jsonl key, panel title, style, y scale): "smoothed" = raw (faint) + TensorBoard-style smoothing.
TRAIN_PANELS = (("loss", "training loss", "smoothed", "linear"), ("lr", "learning rate", "line", "linear"),
                ("grad_norm", "gradient norm (before clipping)", "smoothed", "log"),
                ("images_per_s", "throughput (images/s)", "smoothed", "linear"),
                ("loss_scale", "fp16 loss scale", "line", "log"),
                ("peak_mem_gb", "peak GPU memory (GiB)", "line", "linear"),
                ("skipped_total", "skipped steps (total)", "line", "linear"))
COLUMNS = 3
LOG_RANGE = 20  # a "log" panel switches to a log axis when its values span more than this factor


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that hold a number under `key`."""
    pairs = [(r["step"], float(r[key])) for r in rows if is_number(r.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def auto_weight(count: int) -> float:
    """EMA weight averaging about count/SMOOTH_SHARE points (at least 2: 0.5), up to 0.999."""
    window = max(2.0, count / SMOOTH_SHARE)
    return min(1 - 1 / window, 0.999)


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average; non-finite values are skipped (shown as gaps)."""
    out, avg, seen = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            avg, seen = avg * weight + (1 - weight) * v, seen + 1
        out.append(avg / (1 - weight ** seen) if seen else math.nan)
    return out


def panels(train: list[dict], evals: list[dict]) -> list[tuple]:
    """(title, [(label, steps, values)], style, y scale) of every panel that has data."""
    out = []
    for key, title, style, scale in TRAIN_PANELS:  # a panel is drawn when its key has values
        steps, values = series(train, key)
        if steps and not (key == "skipped_total" and not any(values)):
            out.append((title, [(None, steps, values)], style, scale))
    for key in metrics_of(evals):  # one line per evaluation setting (shared/sampling/evalcurve.py), as in eval.png
        out.append((f"{metric_title(evals, key)} ({rundir.EVAL_FILE})", metric_lines(evals, key), "points", "linear"))
    return out


def draw_panel(ax, title: str, lines: list[tuple], style: str, scale: str, weight: float | None) -> None:
    """One panel: raw and smoothed (weight None: auto_weight), eval metrics as points, or a plain line."""
    from matplotlib.ticker import EngFormatter

    for label, steps, values in lines:
        if style == "smoothed":
            weight = auto_weight(len(values)) if weight is None else weight
            ax.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=0.8, label="raw")
            ax.plot(steps, smooth(values, weight), color="tab:blue", linewidth=1.5, label=f"smoothed ({weight:.3g})")
        elif style == "line":
            ax.plot(steps, values, color="tab:orange", linewidth=1.2)
    if style == "points":
        draw_metric(ax, lines)
    elif style == "smoothed":
        ax.legend(fontsize="small")
    finite = [v for _, _, values in lines for v in values if math.isfinite(v)]
    if scale == "log" and finite and min(finite) > 0 and max(finite) > LOG_RANGE * min(finite):
        ax.set_yscale("log")  # grad norms and loss scales span decades; a narrow range reads better linear
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, not 400000
    ax.grid(alpha=0.3)


def plot_run(run, out=None, weight: float | None = None) -> Path:
    """Draw RUN/metrics.jsonl (and RUN/eval.jsonl) into `out` (default RUN/curves.png); returns the path."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"RUN {run} is not a folder; pass a training run folder (train's --results-dir).")
    train, evals = rundir.read_step_rows(rundir.metrics_path(run)), rundir.read_step_rows(rundir.eval_path(run))
    chosen = panels(train, evals)
    if not chosen:
        raise UserError(f"{run} has no metrics to draw yet: training appends to {rundir.METRICS_FILE} every "
                        f"--log-every steps (and evaluation to {rundir.EVAL_FILE}); rerun once some are logged.")
    try:  # matplotlib's Figure: the Agg canvas, no pyplot
        from matplotlib.figure import Figure
    except ImportError as err:
        raise UserError(f"drawing curves needs matplotlib ({err}); install it with `pip install matplotlib` (it "
                        "is in requirements.txt).") from None
    rows, cols = math.ceil(len(chosen) / COLUMNS), min(COLUMNS, len(chosen))  # one axes per panel, COLUMNS wide
    height = 2.9 * rows + 0.5  # inches: the panels plus a title band
    fig = Figure(figsize=(4.2 * cols, height), dpi=90)
    # Fixed margins rather than a layout engine: constrained layout doubled the drawing time.
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.8 / height, wspace=0.28, hspace=0.6)
    fig.suptitle(f"{run.resolve().name}: step {max(r['step'] for r in train + evals):,}", y=1 - 0.12 / height)
    for i, panel in enumerate(chosen):
        draw_panel(fig.add_subplot(rows, cols, i + 1), *panel, weight)
    out = Path(out) if out else rundir.curves_path(run)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png"), durable=False)  # redrawn at every checkpoint
    return out


def build_parser() -> argparse.ArgumentParser:
    """The `python -m train.plot` argument parser."""
    p = argparse.ArgumentParser(prog=PROG, description="Draw a training run's curves (loss raw and smoothed, LR, "
                                "grad norm, throughput, eval.jsonl metrics) into one PNG.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run", metavar="RUN", help="the training run folder (train's --results-dir)")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN/curves.png)")
    p.add_argument("--smooth", type=float, default=None,
                   help="weight in [0, 1) of the exponential moving average drawn over loss, grad norm and throughput "
                        "(TensorBoard's smoothing; 0 = none). Default: about 1/50 of the logged points")
    return p


@interruptible(PROG)
def main(argv=None) -> int:
    """Parse flags, draw, print where the PNG is; UserErrors become one paragraph and exit status 2."""
    args = build_parser().parse_args(argv)
    with cli_errors(PROG):
        if args.smooth is not None and not 0 <= args.smooth < 1:
            raise UserError(f"--smooth {args.smooth} must lie in [0, 1) (0 = no smoothing).")
        if args.out and Path(args.out).suffix.lower() != ".png":
            raise UserError(f"--out {args.out} must name a .png file.")
        start = time.perf_counter()
        out = plot_run(args.run, args.out, args.smooth)
        print(f"wrote {out} ({time.perf_counter() - start:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

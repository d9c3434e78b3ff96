"""Training steps/s from a bounded streamed cache (127.0.0.1 HTTP server) against the same latents in a local folder.

Run: .venv/bin/python tests/bench/bench_stream.py [--num 1280] [--per-shard 32] [--cache-fraction 0.1]
     [--micro-batch 16] [--steps 60] [--delay-ms 0]

Both runs train the same tiny DiT-T/2 with the same micro-batch and the same shard-aware order (--shard-window
resolved by the streamed run, passed to the local one), so the difference is the data path alone: shards fetched
over HTTP by the background thread, sha256-checked, evicted, with the cache at --cache-fraction of the folder.
--delay-ms adds a pause before every HTTP response (a slower network). Steps/s is measured after --warmup steps.
Prints both rates, their ratio, the cache's largest size seen, the shards fetched, and how long the streamed
loader waited for a shard to arrive (the streaming's own cost, untouched by other jobs on the machine).
"""
import argparse
import http.server
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import make_latents, train_args  # noqa: E402
from train import latents as remote  # noqa: E402
from train.__main__ import main as train_main  # noqa: E402
from train.callbacks import Callback  # noqa: E402


def parse_args(argv=None):
    """Benchmark options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, default=1280, help="latents in the folder")
    p.add_argument("--per-shard", type=int, default=32, help="samples per shard")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="--cache-limit as a fraction of the folder")
    p.add_argument("--micro-batch", type=int, default=16, help="micro-batch (= global batch: one process)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the rate")
    p.add_argument("--delay-ms", type=float, default=0.0, help="pause before every HTTP response")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each, alternating (streamed, local, ...); the best rate of each is kept (noisy CPUs)")
    return p.parse_args(argv)


class Clock(Callback):
    """Step end times, and the cache folder's largest size."""

    def __init__(self, cache: Path | None):
        self.times, self.cache, self.peak = [], cache, 0

    def on_step_end(self, run, result):
        self.times.append(time.perf_counter())
        if self.cache is not None:
            self.peak = max(self.peak, sum(p.stat().st_size for p in self.cache.rglob("*") if p.is_file()))

    def rate(self, warmup: int) -> float:
        return (len(self.times) - 1 - warmup) / (self.times[-1] - self.times[warmup])


def serve(folder: Path, delay_s: float) -> str:
    """A threaded 127.0.0.1 HTTP server over the folder; returns its URL."""
    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_head(self):
            time.sleep(delay_s)
            return super().send_head()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: Handler(*a, directory=str(folder), **k))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def train_once(latents, run: Path, flags: list, cache: Path | None) -> Clock:
    """One in-process training run; its clock."""
    clock = Clock(cache)
    assert train_main(train_args(latents, run, *flags), [clock]) == 0
    return clock


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_latents(tmp / "lat", n=args.num, per_shard=args.per_shard)
        folder_bytes = sum(p.stat().st_size for p in data.iterdir())
        limit = int(folder_bytes * args.cache_fraction)
        cache = tmp / "cache"
        os.environ[remote.CACHE_ENV] = str(cache)
        fetched, real = [], remote.ShardStream._fetch
        remote.ShardStream._fetch = lambda self, shard: (real(self, shard), fetched.append(shard))[0]
        waited, real_map = [], remote.StreamedLatents._map

        def timed_map(self, shard):  # time the loader spends waiting for a shard to arrive (0 when prefetch keeps up)
            begin = time.perf_counter()
            try:
                return real_map(self, shard)
            finally:
                waited.append(time.perf_counter() - begin)

        remote.StreamedLatents._map = timed_map
        flags = ["--global-batch-size", str(args.micro_batch), "--micro-batch-size", str(args.micro_batch),
                 "--max-steps", str(args.steps), "--ckpt-every", str(10 ** 9), "--log-every", str(10 ** 9),
                 "--keep-last", "1"]
        url, rates, peak = serve(data, args.delay_ms / 1000), {"streamed": [], "local": []}, 0
        for repeat in range(args.repeats):
            if cache.exists():
                shutil.rmtree(cache)  # every streamed run starts from an empty cache
            streamed = train_once(url, tmp / f"streamed{repeat}", ["--cache-limit", str(limit), *flags], cache)
            window = json.loads((tmp / f"streamed{repeat}" / "config.json").read_text())["shard_window"]
            local = train_once(data, tmp / f"local{repeat}", ["--shard-window", str(window), *flags], None)
            rates["streamed"].append(streamed.rate(args.warmup))
            rates["local"].append(local.rate(args.warmup))
            peak = max(peak, streamed.peak)
        a, b = max(rates["streamed"]), max(rates["local"])
        print(f"folder {folder_bytes / 2**20:.2f} MiB in {len(json.loads((data / 'index.json').read_text())['shards'])} "
              f"shards; cache limit {limit / 2**20:.2f} MiB ({args.cache_fraction:.0%}), --shard-window {window}, "
              f"largest cache seen {peak / 2**20:.2f} MiB; {len(fetched) // args.repeats} shard fetches per run of "
              f"{args.steps} steps at micro-batch {args.micro_batch}; best of {args.repeats} runs each")
        print(f"time the streamed loader waited for shards: {sum(waited):.3f} s in total over {args.repeats} runs, "
              f"longest {max(waited, default=0):.3f} s (a machine shared with other jobs makes steps/s noisy; this is not)")
        print(f"steps/s  streamed (HTTP, bounded cache): {a:.2f}   local folder: {b:.2f}   ratio streamed/local: "
              f"{a / b:.3f}")


if __name__ == "__main__":
    main()

"""The architecture's numbers (issue 35, item 5): lines, one image's walk, import graph, JSON per RAE checkpoint.

Run: nice -n 5 env OMP_NUM_THREADS=1 .venv/bin/python tests/bench/architecture.py [--rev REV] [--walk] [--json]

Measures the checkout it runs in; with --rev, also REV (checked out with `git worktree add` into a temporary
folder and measured by this same file, so both columns use one definition). Definitions:

1. Production lines: every .py outside tests/ that git tracks or would track (`wc -l`), split into docstring
   lines (the string that opens a module, class or function), comment lines (only a comment), blank lines and
   code (the rest); modules = those files.
2. One image's walk: the README's four commands run in-process at tiny size under `sys.setprofile` (a random
   ImageFolder -> `python -m extract` with the committed digits VAE -> `python -m train`, DiT-T/2, 2 steps, a
   checkpoint and its EMA export -> `python -m sample --npz`, 8 images -> `python -m evaluate --features
   digits`). A production function *carries the image* when an argument other than self/cls, or its return or
   yield value, is data (a PIL image, or a tensor or numpy array of 2 or more dimensions not on the meta
   device) or a list, tuple, dict or dataclass holding data directly. Each call into such a function from a
   function of another production file is a step from the caller's file to the callee's (torch and library
   frames in between are skipped; module-level code is not a caller); a call site (caller and callee function)
   counts once, at its first call (a loop's second pass shows a reader nothing new). The walk is, per stage,
   its entry file, then for each step in call order the caller's file and the callee's file, consecutive
   repeats collapsed: the files a reader opens, in order, to follow the data through the code.
   files = distinct files in the walk; a return = a position whose file appeared earlier in the walk (not just
   before it, repeats being collapsed); returns are reported with the number of distinct files returned to.
   Plumbing that never holds the data (flags, locks, atomic writes of bytes, logging, loss scalars, shapes
   measured on the meta device) never enters the walk by this rule, whatever its depth. The evaluate step uses
   the digits yardstick (no Inception download). Also printed: the hand-written walk of docs/ARCHITECTURE.md
   counted the same way (its file names in reading order: the way issue 35 counted 40 files and 32 returns to
   17 files at 0c67dfe, where this count finds 41 files).
3. Import graph: every import statement of a production module (top level or inside a function) that names
   another production module; cycles are its strongly connected components; and the imports from
   shared/runtime/ (plumbing) into the domain packages of shared/.
4. JSON per RAE checkpoint: a tiny RAE (tests/tiny_tokenizers.py `rae`: 64x4x4 tokens, per-element statistics in
   its config) extracted, then DiTDH-T trained 2 steps with a checkpoint, an EMA export and a preview at step 2.
   Every JSON file and every safetensors `__metadata__` (compact JSON) in the latent and run folders is sized;
   per checkpoint = those whose path names the checkpoint's step. Per-element statistics grow with the token
   shape: a base64 string decoding to exactly E float32 or float64 values, or a JSON list of E numbers (E = 1024
   elements of the tiny tokens), is scaled by 196,608 / E (RAE's real 768x16x16 tokens); the rest is kept.
CPU time: about 35 s per checkout (one thread; 2 minutes of wall time on a busy machine); the --rev checkout is
measured at the same time, on another core.
"""
from __future__ import annotations

import argparse
import ast
import base64
import binascii
import collections
import contextlib
import dataclasses
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOMAIN = ("shared.generative", "shared.network", "shared.tokenizers", "shared.datasets", "shared.weights",
          "shared.sampling")
RAE_REAL = 768 * 16 * 16  # RAE's DINOv2-B tokens at 256 px (C, h, w)
META = None  # torch.device("meta"), set when torch is imported: meta tensors hold no numbers


# ---------------------------------------------------------------------------------------------------------
# 1. Production lines
# ---------------------------------------------------------------------------------------------------------

def production_files(root: Path) -> list[str]:
    """Every .py outside tests/ that git tracks or would track, relative to root."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout.split()
    return sorted(p for p in out if not p.startswith("tests/") and (root / p).is_file())


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the docstrings of the module, its classes and its functions."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def line_kinds(text: str) -> collections.Counter:
    """Counts of code, docstring, comment and blank lines of one file (total = wc -l)."""
    lines = text.splitlines()
    docs = docstring_lines(ast.parse(text))
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    kinds = collections.Counter()
    for number, line in enumerate(lines, 1):
        if number in docs:
            kinds["docstring"] += 1
        elif number in code_lines:
            kinds["code"] += 1
        elif line.strip():
            kinds["comment"] += 1
        else:
            kinds["blank"] += 1
    kinds["total"] = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    return kinds


def measure_lines(root: Path) -> dict:
    """Line kinds over every production file, the module count and the largest files."""
    total, sizes = collections.Counter(), {}
    for path in production_files(root):
        kinds = line_kinds((root / path).read_text())
        total += kinds
        sizes[path] = kinds["total"]
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    return {"modules": len(sizes), **{k: total[k] for k in ("total", "code", "docstring", "comment", "blank")},
            "largest": largest}


# ---------------------------------------------------------------------------------------------------------
# 3. Import graph
# ---------------------------------------------------------------------------------------------------------

def module_name(path: str) -> str:
    """Dotted module name of a repository path (a package's __init__.py is the package)."""
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: str, tree: ast.AST, modules: set[str]) -> set[str]:
    """The production modules one file imports (absolute or relative, at any depth of the file)."""
    package = module_name(path) if path.endswith("__init__.py") else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from a.b import c`: the module a.b.c, else a.b
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                break
    found.discard(module_name(path))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def measure_imports(root: Path) -> dict:
    """Cycles between production modules and imports from shared/runtime/ into shared's domain packages."""
    files = production_files(root)
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imported_modules(p, ast.parse((root / p).read_text()), modules) for p in files}
    runtime = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("shared.runtime")
                     for b in deps if b.startswith(DOMAIN))
    stages = ("extract", "train", "sample", "evaluate")
    across = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.split(".")[0] in stages
                    for b in deps if b.split(".")[0] in stages and b.split(".")[0] != a.split(".")[0])
    return {"edges": sum(map(len, graph.values())), "cycles": cycles(graph), "runtime_to_domain": runtime,
            "stage_to_stage": across}


# ---------------------------------------------------------------------------------------------------------
# 2. One image's walk
# ---------------------------------------------------------------------------------------------------------

class WalkTracer:
    """sys.setprofile hook: the cross-file calls into production functions that carry the image (module doc)."""

    def __init__(self, root: Path):
        self.root = str(root) + os.sep
        self.files: dict[str, str | None] = {}
        self.stack: list[list] = []   # production frames: [frame, file, seq, caller entry, carries at call]
        self.steps: list[tuple] = []  # (seq, caller file, callee file, call-site key)
        self.seq = 0
        import numpy
        import torch
        from PIL import Image
        self.array_types, self.image_type = (torch.Tensor, numpy.ndarray), Image.Image
        global META
        META = torch.device("meta")

    def production(self, filename: str) -> str | None:
        """The repository path of a production file, else None (cached per code file name)."""
        rel = self.files.get(filename, "")
        if rel == "":
            rel = None
            if filename.startswith(self.root) and filename.endswith(".py"):
                rel = filename[len(self.root):].replace(os.sep, "/")
                rel = None if rel.startswith(("tests/", ".venv/")) else rel
            self.files[filename] = rel
        return rel

    def is_data(self, value) -> bool:
        """An image, or a tensor or array of 2 or more dimensions holding numbers (not on the meta device)."""
        if isinstance(value, self.image_type):
            return True
        return isinstance(value, self.array_types) and value.ndim >= 2 and getattr(value, "device", None) != META

    def holds_data(self, value) -> bool:
        """Data, or a list, tuple, dict or dataclass holding data directly."""
        if self.is_data(value):
            return True
        if isinstance(value, (list, tuple)):
            return any(self.is_data(v) for v in value[:16])
        if isinstance(value, dict):
            return any(self.is_data(v) for _, v in zip(range(16), value.values()))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return any(self.is_data(getattr(value, f.name, None)) for f in dataclasses.fields(value))
        return False

    def args_hold_data(self, frame) -> bool:
        """Whether an argument other than self/cls holds the data."""
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        local = frame.f_locals
        for name in code.co_varnames[:count]:
            if name not in ("self", "cls") and self.holds_data(local.get(name)):
                return True
        return False

    def __call__(self, frame, event, arg):
        if event == "call":
            rel = self.production(frame.f_code.co_filename)
            if rel is None:
                return
            self.seq += 1
            is_module = frame.f_code.co_name == "<module>"
            caller = self.stack[-1] if self.stack else None
            carries = False if is_module else self.args_hold_data(frame)
            self.stack.append([frame, rel, self.seq, caller, carries, is_module])
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            _, rel, seq, caller, carries, is_module = self.stack.pop()
            if is_module or caller is None or caller[5] or caller[1] == rel:
                return
            if carries or self.holds_data(arg):
                self.steps.append((seq, (caller[1], caller[0].f_code.co_qualname), (rel, frame.f_code.co_qualname),
                                   (caller[0].f_code, frame.f_code)))

    def trace(self, entry_file: str, fn, *args):
        """Run fn(*args) under the hook; the stage's entry file starts its part of the walk."""
        self.steps.append((self.seq + 0.5, (entry_file, "main"), (entry_file, "main"), ("entry", entry_file)))
        sys.setprofile(self)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)
            self.stack.clear()

    def walk(self) -> list[tuple[str, str]]:
        """(file, first function read there) in reading order (module doc), consecutive repeats collapsed."""
        seen, order = set(), []
        for _, caller, callee, key in sorted(self.steps, key=lambda s: s[0]):
            if key in seen:
                continue
            seen.add(key)
            for place in (caller, callee):
                if not order or order[-1][0] != place[0]:
                    order.append(place)
        return order


def count_walk(order: list[str]) -> dict:
    """Files, returns (a file met again after others) and the files returned to most."""
    seen, back = set(), collections.Counter()
    previous = None
    for f in order:
        if f in seen and f != previous:
            back[f] += 1
        seen.add(f)
        previous = f
    return {"files": len(seen), "returns": sum(back.values()), "returned_to": len(back),
            "most": back.most_common(4), "order": order}


def doc_walk(root: Path) -> dict | None:
    """docs/ARCHITECTURE.md's hand-written walk: its file names in reading order, counted as count_walk."""
    path = root / "docs" / "ARCHITECTURE.md"
    match = re.search(r"^## The walk of one image\n(.*?)(?=^## )", path.read_text(), flags=re.S | re.M) \
        if path.exists() else None
    if not match:
        return None
    section = match.group(1).split("The walk opens")[0]
    files = [w for w in re.findall(r"`([^`\n]+)`", section) if re.fullmatch(r"[\w/.]+\.py", w)]
    return count_walk([f for i, f in enumerate(files) if i == 0 or files[i - 1] != f])


def run_cli(main, argv: list) -> None:
    """A CLI's main(argv) in this process; a non-zero exit is an error of this measurement."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    if code not in (0, None):
        raise RuntimeError(f"{main.__module__} {argv} exited with {code}")


def quietly(fn, *args):
    """fn(*args) with its stdout and stderr kept (printed only if it fails)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return fn(*args)
    except BaseException:
        sys.stderr.write(out.getvalue()[-4000:])
        raise


def measure_walk(root: Path, tmp: Path) -> dict:
    """The traced walk of one image through extract, train, sample and evaluate (module doc, definition 2)."""
    from evaluate.__main__ import main as evaluate_main
    from extract.__main__ import main as extract_main
    from sample.__main__ import main as sample_main
    from tests.conftest import make_image_folder
    from train.__main__ import main as train_main

    vae = root / "data" / "vae-digits"
    images = make_image_folder(tmp / "images", classes=("a", "b"), per_class=2, size=(36, 40))
    lat, run, samples = tmp / "latents", tmp / "run", tmp / "samples"
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # the digits yardstick's fit, never the user's cache
    tracer = WalkTracer(root)
    stages = [
        ("extract/__main__.py", extract_main, ["--data-path", images, "--out", lat, "--vae", vae, "--image-size", 32,
                                               "--flip", "none", "--batch-size", 4, "--num-workers", 0]),
        ("train/__main__.py", train_main, ["--model", "DiT-T/2", "--latents", lat, "--results-dir", run,
                                           "--global-batch-size", 4, "--num-workers", 0, "--max-steps", 2,
                                           "--ckpt-every", 2, "--sample-every", 0, "--log-every", 1]),
        ("sample/__main__.py", sample_main, ["--ckpt", run, "--vae", vae, "--num-samples", 8, "--batch-size", 8,
                                             "--num-sampling-steps", 2, "--seed", 0, "--out", samples, "--npz"]),
        ("evaluate/__main__.py", evaluate_main, [samples / "samples.npz", "--features", "digits", "--no-save"]),
    ]
    for entry, main, argv in stages:
        quietly(tracer.trace, entry, run_cli, main, argv)
    order = tracer.walk()
    return {**count_walk([f for f, _ in order]), "order": [f"{f} {name}" for f, name in order]}


# ---------------------------------------------------------------------------------------------------------
# 4. JSON per RAE checkpoint
# ---------------------------------------------------------------------------------------------------------

def safetensors_metadata(path: Path) -> str | None:
    """The `__metadata__` of a safetensors file as compact JSON (None without any)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    meta = header.get("__metadata__")
    return json.dumps(meta, separators=(",", ":")) if meta else None


def per_element_chars(value, elements: int) -> int:
    """Characters of per-element statistics (E values) inside a parsed JSON value (module doc, definition 4)."""
    if isinstance(value, str):
        if value[:1] in "{[":
            with contextlib.suppress(ValueError):
                return per_element_chars(json.loads(value), elements)
        if len(value) >= 4 * elements // 3 and re.fullmatch(r"[A-Za-z0-9+/]+=*", value):
            with contextlib.suppress(binascii.Error):
                if len(base64.b64decode(value)) in (4 * elements, 8 * elements):
                    return len(value)
        return 0
    if isinstance(value, list):
        if count_numbers(value) == elements:
            return len(json.dumps(value, separators=(",", ":")))
        return sum(per_element_chars(v, elements) for v in value)
    if isinstance(value, dict):
        return sum(per_element_chars(v, elements) for v in value.values())
    return 0


def count_numbers(value) -> int:
    """Numbers in a nested list (-1 if it holds anything else)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return 1
    if isinstance(value, list):
        counts = [count_numbers(v) for v in value]
        return -1 if -1 in counts else sum(counts)
    return -1


def json_texts(folder: Path):
    """(path, JSON text) of every .json file and every safetensors metadata under folder."""
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".json":
            yield path, path.read_text()
        elif path.suffix == ".safetensors":
            meta = safetensors_metadata(path)
            if meta:
                yield path, meta


def measure_rae_json(root: Path, tmp: Path) -> dict:
    """Sizes of the JSON a tiny RAE run writes, as is and scaled to 768x16x16 tokens (module doc, definition 4)."""
    from extract.__main__ import main as extract_main
    from tests.conftest import make_image_folder
    from tests.tiny_tokenizers import RAE_TINY, rae
    from train.__main__ import main as train_main

    grid = RAE_TINY["encoder_input_size"] // RAE_TINY["encoder_patch_size"]
    elements = RAE_TINY["encoder_hidden_size"] * grid * grid
    tokenizer = rae(tmp / "rae")
    images = make_image_folder(tmp / "rae-images", classes=("a", "b"), per_class=2, size=(36, 40))
    lat, run = tmp / "rae-latents", tmp / "rae-run"
    quietly(run_cli, extract_main, ["--data-path", images, "--out", lat, "--vae", tokenizer, "--image-size", 32,
                                    "--num-workers", 0])
    quietly(run_cli, train_main, ["--model", "DiTDH-T", "--latents", lat, "--results-dir", run,
                                  "--global-batch-size", 4, "--num-workers", 0, "--max-steps", 2, "--ckpt-every", 2,
                                  "--sample-every", 2, "--sample-steps", 2, "--log-every", 1])
    ratio = RAE_REAL / elements
    items = []
    for folder in (lat, run):
        for path, text in json_texts(folder):
            size = len(text.encode())
            stats = per_element_chars(json.loads(text), elements)
            items.append({"path": path.relative_to(tmp).as_posix(), "bytes": size,
                          "scaled": round(size + stats * (ratio - 1))})
    step = re.compile(r"(^|[^0-9A-Za-z])0*2([^0-9]|$)")  # names carrying the checkpoint's step, 2 (not "v2")
    checkpoint = [i for i in items if i["path"].startswith("rae-run/") and step.search(i["path"].split("/", 1)[1])]
    return {"elements": elements, "ratio": ratio, "items": sorted(items, key=lambda i: -i["scaled"]),
            "largest": max(items, key=lambda i: i["scaled"]),
            "checkpoint_largest": max(checkpoint, key=lambda i: i["scaled"]),
            "checkpoint_total": sum(i["bytes"] for i in checkpoint),
            "checkpoint_total_scaled": sum(i["scaled"] for i in checkpoint), "checkpoint_files": len(checkpoint)}


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------

def measure(root: Path, walk: bool, rae_json: bool, work: Path | None = None) -> dict:
    """Every number for one checkout."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = {"root": str(root), "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                                       capture_output=True, text=True).stdout.strip(),
           "lines": measure_lines(root), "imports": measure_imports(root), "doc_walk": doc_walk(root)}
    with contextlib.nullcontext(work) if work else tempfile.TemporaryDirectory(prefix="architecture-") as tmp:
        if walk:
            start = time.time()
            out["walk"] = measure_walk(root, Path(tmp))
            out["walk"]["seconds"] = round(time.time() - start, 1)
        if rae_json:
            start = time.time()
            out["rae_json"] = measure_rae_json(root, Path(tmp))
            out["rae_json"]["seconds"] = round(time.time() - start, 1)
    return out


@contextlib.contextmanager
def measuring_rev(rev: str, args):
    """Yields a function returning REV's numbers, measured meanwhile by this file on a temporary git worktree."""
    with tempfile.TemporaryDirectory(prefix="architecture-rev-") as tmp:
        tree, out, err = Path(tmp) / "tree", Path(tmp) / "out.json", Path(tmp) / "err.txt"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
        child = None
        try:
            cmd = [sys.executable, __file__, "--root", str(tree), "--json"]
            cmd += ["--no-walk"] * (not args.walk_on) + ["--no-rae"] * (not args.rae_on)
            with open(out, "w") as stdout, open(err, "w") as stderr:  # files: a full pipe would stall the child
                child = subprocess.Popen(cmd, cwd=tree, stdout=stdout, stderr=stderr,
                                         env={**os.environ, "PYTHONPATH": str(tree)})

            def result() -> dict:
                if child.wait():
                    sys.stderr.write(err.read_text()[-4000:])
                    raise SystemExit(f"measuring {rev} failed (exit {child.returncode})")
                return json.loads(out.read_text().strip().splitlines()[-1])  # stray prints come first

            yield result
        finally:
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


def kib(n: int) -> str:
    """Bytes in KiB, thousands separated."""
    return f"{n / 1024:,.1f} KiB"


def report(results: list[dict], show_walk: bool) -> None:
    """One column per measured checkout."""
    def row(label, values):
        """One label and one right-aligned value per checkout."""
        print(f"{label:<44}" + "".join(f"{v:>22}" for v in values))

    row("", [r["commit"] + (" (checkout)" if r is results[-1] else "") for r in results])
    print("1. production lines (every .py outside tests/)")
    for key in ("total", "code", "docstring", "comment", "blank", "modules"):
        row(f"   {key}", [f"{r['lines'][key]:,}" for r in results])
    print("2. one image's walk to an FID number (traced; files, returns to how many files)")
    if all("walk" in r for r in results):
        row("   traced walk", [f"{r['walk']['files']} files, {r['walk']['returns']} -> {r['walk']['returned_to']}"
                               for r in results])
    docs = [r["doc_walk"] for r in results]
    row("   docs/ARCHITECTURE.md walk", [f"{d['files']} files, {d['returns']} -> {d['returned_to']}" if d else "none"
                                        for d in docs])
    print("3. import graph")
    row("   import edges", [r["imports"]["edges"] for r in results])
    row("   cycles", [len(r["imports"]["cycles"]) for r in results])
    row("   shared/runtime -> domain imports", [len(r["imports"]["runtime_to_domain"]) for r in results])
    row("   ... from how many runtime modules", [len({e.split(" ")[0] for e in r["imports"]["runtime_to_domain"]})
                                                  for r in results])
    row("   stage -> other stage imports", [len(r["imports"]["stage_to_stage"]) for r in results])
    if all("rae_json" in r for r in results):
        print("4. JSON of a tiny RAE run (scaled to 768x16x16 tokens)")
        for key, label in (("largest", "largest JSON"), ("checkpoint_largest", "largest JSON per checkpoint")):
            row(f"   {label}, as written", [kib(r["rae_json"][key]["bytes"]) for r in results])
            row(f"   {label}, scaled", [kib(r["rae_json"][key]["scaled"]) for r in results])
        row("   JSON per checkpoint in all, scaled", [kib(r["rae_json"]["checkpoint_total_scaled"]) for r in results])
    for r in results:
        print(f"\n== {r['commit']}: details")
        print("   largest files: " + ", ".join(f"{p} {n}" for p, n in r["lines"]["largest"]))
        for c in r["imports"]["cycles"]:
            print("   cycle: " + " <-> ".join(c))
        for e in r["imports"]["runtime_to_domain"] + r["imports"]["stage_to_stage"]:
            print(f"   import: {e}")
        if "walk" in r:
            w = r["walk"]
            print(f"   traced walk ({w['seconds']} s): " + ", ".join(f"{f} {n + 1}x" for f, n in w["most"]))
            if show_walk:
                for i, f in enumerate(w["order"], 1):
                    print(f"     {i:3d} {f}")
        if r["doc_walk"]:
            print("   docs walk: " + ", ".join(f"{f} {n + 1}x" for f, n in r["doc_walk"]["most"]))
        if "rae_json" in r:
            j = r["rae_json"]
            print(f"   RAE JSON ({j['seconds']} s; E = {j['elements']}, x{j['ratio']:.0f} to 768x16x16; "
                  f"{j['checkpoint_files']} items per checkpoint):")
            for i in j["items"]:
                print(f"     {i['path']:<64} {kib(i['bytes']):>14} {kib(i['scaled']):>14}")


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", help="also measure this git revision (a temporary git worktree), printed first")
    p.add_argument("--walk", action="store_true", help="print the traced walk's files in order")
    p.add_argument("--no-walk", dest="walk_on", action="store_false", help="skip the traced walk")
    p.add_argument("--no-rae", dest="rae_on", action="store_false", help="skip the tiny RAE run")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument("--keep", type=Path, help="run the pipelines in this new folder and keep it (default: a "
                                             "temporary folder, removed)")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # the checkout measured (--rev)
    return p.parse_args(argv)


def main(argv=None) -> None:
    """Measure, then print the table (or the JSON)."""
    args = parse_args(argv)
    root = args.root.resolve()
    sys.path.insert(0, str(root))
    os.chdir(root)
    if args.keep:
        args.keep.mkdir(parents=True)
    with measuring_rev(args.rev, args) if args.rev else contextlib.nullcontext() as rev_result:
        here = measure(root, args.walk_on, args.rae_on, args.keep and args.keep.resolve())
        results = [rev_result(), here] if args.rev else [here]
    if args.json:
        print(json.dumps(results if args.rev else here))
    else:
        report(results, args.walk)


if __name__ == "__main__":
    main()

"""The architecture's numbers (issues 35 and 43, item 5): lines, one image's walk, imports, JSON, the goals.

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
5. Issue 43's goals, printed as a table (metric | REV | checkout | goal) and in --json as each checkout's
   `goal_table` (its evidence under `goals`):
   a. Core walk: the distinct files of the traced walk (definition 2) and the sum of their `wc -l` lines; the
      hand-written walk of docs/ARCHITECTURE.md is counted the same way beside it.
   b. Returns to library files: the walk's returns (definition 2) to a file that is not an orchestrator. The
      orchestrators are the files that drive a stage, which a main that plans and then calls library
      functions in order comes back to by design: a stage package's `__main__.py` and `run.py`, and
      ORCHESTRATORS (train/loop.py, train/step.py, shared/sampling/generate.py: `python -m sample`'s code path,
      evaluate/evaluation.py). Every other production file, in shared/ or in a stage package, is a library
      file; the returns to shared/ files alone are printed too.
   c. A->B->A ping-pongs: positions i of the walk (repeats in a row collapsed) with file(i) == file(i + 2);
      counted again for A a library file alone (an orchestrator calling library functions in turn makes A->B->A->C
      by design, as returns to it are not counted);
      each is listed by its pair of files (and, with --walk, its functions).
   d. Guard lines: the union of the lines of every `raise` statement (its full span), of every `if` whose body
      is only raises (from `if` to the last raise; an elif is an `if` of its own, an else is not counted) and
      of every function named check_* or _check_* (decorators to last line), over the production files; as a
      % of production lines (definition 1). Also: raises spanning 2+ lines, and raises by kind: of UserError or
      a production class deriving from it by name, of another exception class, re-raises (bare or of a
      lower-case name), or via a helper function (`raise refuse(...)`). Lines of `assert` statements are
      counted apart, not as guards (a one-line assert is the issue's form of an internal contract).
   e. Compat lines: code keeping the project's own earlier formats, found by markers: names matching
      COMPAT_NAME (legacy|upgrade|from_legacy|unpack_tensor|space_parts, any case) and `#` comments matching
      COMPAT_COMMENT ("older" or "legacy" followed within a word by form, record, folder, file, sidecar,
      config, version, metadata or key) that name no outside project (OUTSIDE_PROJECT: diffusers, torch, TF,
      Pillow, GPU). Counted, outermost first: a def or class whose name is a marker (its whole span); an
      if/elif branch (from `if` to the end of its body) whose test or header comment holds a marker, or whose
      body does with no `if` nested in it (else the innermost branch holding it); any other simple statement
      mentioning a marker name, or with a marker comment on its lines or on the comment lines right above it.
      Each span is printed with its reason.
   f. Files a new sampler, tokenizer class, converted tokenizer, weight format, shard column, objective or
      block option touches, derived from its register_* function (EXTENSIONS): the file defining it (the
      owner), its registry (the module-level upper-case names that function uses), the files registering
      built-in records (calling or decorating with it, or the owner calling REGISTRY.register), their names
      (a record's first string argument or `name=`, a class's `name`), module-level tuples of module names
      naming a registering module (a hard-coded import list) and the files importing one, literal tuples,
      lists, sets or dict keys of 2+ strings, all registered names, outside those files (a hard-coded name
      list), and the files calling load_plugins. A user's module named by --plugin touches 1 file plus one per
      file holding such a name list (none where no command loads plugins); a new module of the package, 1 +
      the files of the hard-coded import lists, or + 1 (the import that loads it) where there are none.
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
# 5. Issue 43's goals
# ---------------------------------------------------------------------------------------------------------

STAGES = ("extract", "train", "sample", "evaluate")
# The files that drive a stage (module doc, definition 5b): what a plan-then-call-in-order main may come back to.
ORCHESTRATORS = ("train/loop.py", "train/step.py", "shared/sampling/generate.py", "evaluate/evaluation.py")
GUARD_FUNCTION = re.compile(r"_?check_\w*")
COMPAT_NAME = re.compile(r"legacy|upgrade|from_legacy|unpack_tensor|space_parts", re.I)
COMPAT_COMMENT = re.compile(r"\b(older|legacy)\b\W+(\S+\s+)?(forms?|records?|folders?|files?|sidecars?|configs?|"
                            r"versions?|metadata|keys?)\b", re.I)
OUTSIDE_PROJECT = re.compile(r"diffusers|torch|TF1?\b|Pillow|GPU", re.I)  # their old formats are not ours
COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef,
            ast.AsyncFunctionDef, ast.ClassDef, getattr(ast, "TryStar", ast.Try), getattr(ast, "Match", ast.Try))
EXTENSIONS = (("sampler", "register_sampler"), ("tokenizer class", "register_tokenizer"),
              ("converted tokenizer", "register_converted"), ("weight format", "register_format"),
              ("shard column", "register_column"), ("objective", "register_objective"),
              ("block option", "register_block_option"))


def is_orchestrator(path: str) -> bool:
    """A stage's driving file (module doc, definition 5b): its __main__.py or run.py, or one of ORCHESTRATORS."""
    top, _, name = path.partition("/")
    return path in ORCHESTRATORS or (top in STAGES and name in ("__main__.py", "run.py"))


def walk_goals(order: list[str], sizes: dict[str, int]) -> dict:
    """Files and lines of a walk, its returns to library files and its A->B->A ping-pongs (definition 5a-c)."""
    seen, library, previous = set(), collections.Counter(), None
    for f in order:
        if f in seen and f != previous and not is_orchestrator(f):
            library[f] += 1
        seen.add(f)
        previous = f
    pongs = [(order[i], order[i + 1]) for i in range(len(order) - 2) if order[i] == order[i + 2]]
    pairs = collections.Counter(" <-> ".join(sorted(p)) for p in pongs)
    return {"files": len(seen), "lines": sum(sizes.get(f, 0) for f in seen),
            "library_returns": sum(library.values()), "library_returned_to": library.most_common(),
            "shared_returns": sum(n for f, n in library.items() if f.startswith("shared/")),
            "ping_pongs": len(pongs), "ping_pong_pairs": pairs.most_common(),
            "library_ping_pongs": sum(not is_orchestrator(a) for a, _ in pongs),
            "ping_pong_at": [i + 1 for i in range(len(order) - 2) if order[i] == order[i + 2]]}


def node_lines(node: ast.AST) -> range:
    """The lines of a statement, its decorators included."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
    return range(start, node.end_lineno + 1)


def exception_family(trees: dict[str, ast.AST], base: str = "UserError") -> set[str]:
    """Names of the production classes deriving from `base` (by name, transitively), `base` included."""
    bases = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    family, grown = {base}, True
    while grown:
        more = {name for name, parents in bases.items() if parents & family} - family
        family |= more
        grown = bool(more)
    return family


def raise_kind(node: ast.Raise, user: set[str]) -> str:
    """'user' (a UserError class), 'other' (another exception class), 're-raise' (bare or a variable) or 'helper'."""
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", None)
    if name in user:
        return "user"
    if node.exc is None or (isinstance(node.exc, ast.Name) and not name[:1].isupper()):
        return "re-raise"
    if name and name[:1].isupper():
        return "other"
    return "helper"  # a function building the exception (e.g. `raise refuse(...)`)


def guard_lines(tree: ast.AST, user: set[str]) -> dict:
    """Guard lines of one file (definition 5d): raises, guard-ifs whose body only raises, check_* functions."""
    lines, kinds, multi = set(), collections.Counter(), 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            lines.update(node_lines(node))
            kinds[raise_kind(node, user)] += 1
            multi += node.end_lineno > node.lineno
        elif isinstance(node, ast.If) and all(isinstance(b, ast.Raise) for b in node.body):
            lines.update(range(node.lineno, node.body[-1].end_lineno + 1))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and GUARD_FUNCTION.fullmatch(node.name):
            lines.update(node_lines(node))
    asserts = {n for node in ast.walk(tree) if isinstance(node, ast.Assert) for n in node_lines(node)}
    return {"lines": lines, "raises": sum(kinds.values()), "multi_line": multi, "kinds": kinds,
            "assert_lines": asserts}


def marker_names(node: ast.AST) -> set[str]:
    """The compat marker names (COMPAT_NAME) a node mentions: names, attributes, defs and imported names."""
    found = set()
    for n in ast.walk(node):
        for name in (getattr(n, "id", None), getattr(n, "attr", None), getattr(n, "name", None),
                     getattr(n, "asname", None)):
            if isinstance(name, str) and COMPAT_NAME.search(name):
                found.add(name)
    return found


def compat_comments(text: str) -> dict[int, str]:
    """Comment lines naming an older form of the project's own (COMPAT_COMMENT, not OUTSIDE_PROJECT), by line."""
    found = {}
    with contextlib.suppress(tokenize.TokenError):
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT and COMPAT_COMMENT.search(tok.string) \
                    and not OUTSIDE_PROJECT.search(tok.string):
                found[tok.start[0]] = tok.string
    return found


def compat_spans(tree: ast.AST, text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, why) of the compat code of one file (definition 5e), outermost spans only."""
    comments, lines = compat_comments(text), text.splitlines()
    spans = []

    def said(first: int, last: int) -> list[str]:
        """Marker comments on lines first..last, or on the comment-only lines right above first."""
        found = [comments[c] for c in range(first, last + 1) if c in comments]
        above = first - 1
        while above >= 1 and lines[above - 1].lstrip().startswith("#"):
            found += [comments[above]] if above in comments else []
            above -= 1
        return found

    def why(names: set[str], comments_found: list[str]) -> str:
        """The reason printed for a span: the marker names, else the first marker comment."""
        return ", ".join(sorted(names)) or comments_found[0].strip() if names or comments_found else ""

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.stmt):
                if isinstance(child, ast.ExceptHandler):
                    visit(child)
                continue
            span = node_lines(child)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if COMPAT_NAME.search(child.name):
                    spans.append((span.start, span.stop - 1, f"def {child.name}"))
                else:
                    visit(child)
            elif isinstance(child, ast.If):
                innermost = not any(isinstance(n, ast.If) for b in child.body for n in ast.walk(b))
                body = {n for b in child.body for n in marker_names(b)} if innermost else set()
                reason = why(marker_names(child.test) | body, said(child.lineno, child.test.end_lineno))
                if reason:
                    spans.append((child.lineno, child.body[-1].end_lineno, "if: " + reason))
                else:
                    visit(ast.Module(body=child.body, type_ignores=[]))
                visit(ast.Module(body=child.orelse, type_ignores=[]))  # an elif or else of its own
            elif isinstance(child, COMPOUND):
                visit(child)
            else:
                reason = why(marker_names(child), said(span.start, span.stop - 1))
                if reason:
                    spans.append((span.start, span.stop - 1, reason))

    visit(tree)
    return spans


def registry_evidence(trees: dict[str, ast.AST]) -> dict:
    """Per extension kind (EXTENSIONS), the registry's files and lists (definition 5f) and the files it touches."""
    modules = {module_name(p): p for p in trees}
    lists = module_lists(trees, set(modules))
    plugin_loaders = sorted(p for p, t in trees.items() if any(isinstance(n, ast.Call) and call_name(n) ==
                                                               "load_plugins" for n in ast.walk(t)))
    out = {}
    for kind, function in EXTENSIONS:
        owner = next((p for p, t in trees.items() for n in t.body
                      if isinstance(n, ast.FunctionDef) and n.name == function), None)
        if owner is None:
            out[kind] = {"function": function, "owner": None}
            continue
        registry = registry_names(trees[owner], function)
        registrants = sorted(p for p, t in trees.items() if registers(t, function, registry, p == owner))
        named = [f"{p}:{line} {name} = {values}" for p, line, name, values in lists
                 if set(values) & {module_name(r) for r in registrants}]
        importers = sorted({f"{p} imports {module_name(r)}" for r in registrants if r != owner
                            for p, t in trees.items() if p != r and module_name(r) in imported_modules(
                                p, t, set(modules))})
        names = registered_names([trees[p] for p in registrants], function, trees[owner])
        hard = name_lists(trees, names, {owner, *registrants})
        package = 1 + len({entry.split(":")[0] for entry in named} or {owner})
        out[kind] = {"function": function, "owner": owner, "registry": sorted(registry),
                     "registrants": registrants, "module_lists": named, "importers": importers,
                     "names": sorted(names), "name_lists": hard, "plugin_loaders": plugin_loaders,
                     "plugin_files": 1 + len({h.split(":")[0] for h in hard}) if plugin_loaders else None,
                     "package_files": package}
    return out


def call_name(node: ast.Call) -> str | None:
    """The called name of a call (`f(...)` or `x.f(...)`)."""
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)


def registry_names(tree: ast.AST, function: str) -> set[str]:
    """The module-level names the register function writes to or calls (its registry)."""
    top = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
           for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return {n.id for n in ast.walk(body) if isinstance(n, ast.Name) and n.id in top and n.id.isupper()}


def registers(tree: ast.AST, function: str, registry: set[str], is_owner: bool) -> bool:
    """Whether a file registers a record: calls (or decorates with) the register function, or (the owner) the
    registry's `register`/item assignment outside the register function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            continue
        if isinstance(node, ast.Call) and call_name(node) == function:
            return True
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and any(
                (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == function
                for d in node.decorator_list):
            return True
    if is_owner:
        for node in tree.body:  # module level only: the register function's own body is not a record
            for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
                if isinstance(n, ast.Call) and call_name(n) == "register" and \
                        getattr(n.func.value, "id", None) in registry:
                    return True
    return False


def registered_names(trees: list[ast.AST], function: str, owner: ast.AST) -> set[str]:
    """Names the built-in records are registered under: a record's first string argument (or `name=`), a
    registered class's `name`, a register_block_option's value."""
    body = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == function)
    first = body.args.args[0] if body.args.args else None
    record = getattr(first.annotation, "id", None) if first is not None and first.annotation is not None else None
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and record and call_name(node) == record:
                values = [a for a in node.args[:1]] + [k.value for k in node.keywords if k.arg == "name"]
            elif isinstance(node, ast.Call) and call_name(node) == function and first is not None \
                    and first.arg == "slot":
                values = node.args[1:2]
            elif isinstance(node, ast.Call) and call_name(node) == function and node.args \
                    and isinstance(node.args[0], ast.Tuple):
                values = node.args[0].elts  # register_converted(("vavae", ...), locate)
            elif isinstance(node, ast.ClassDef) and record == "type" and any(
                    getattr(d, "id", None) == function for d in node.decorator_list):
                values = [n.value for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
                    getattr(t, "id", None) == "name" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            else:
                continue
            names.update(v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return names


def module_lists(trees: dict[str, ast.AST], modules: set[str]) -> list[tuple[str, int, str, list[str]]]:
    """Module-level tuples or lists of strings naming production modules: (file, line, name, the strings)."""
    found = []
    for path, tree in trees.items():
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, (ast.Tuple, ast.List)) and value.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts) and any(
                    e.value in modules for e in value.elts):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                found.append((path, node.lineno, getattr(target, "id", "?"), [e.value for e in value.elts]))
    return found


def name_lists(trees: dict[str, ast.AST], names: set[str], skip: set[str]) -> list[str]:
    """Literal tuples, lists, sets or dict keys of 2 or more strings, all registered names, outside the registry's
    own files: a list a new record's name would have to join."""
    found = []
    for path, tree in trees.items():
        if path in skip:
            continue
        for node in ast.walk(tree):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
            values = [e.value for e in items or () if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(values) >= 2 and len(values) == len(items) and set(values) <= names:
                found.append(f"{path}:{node.lineno} {values}")
    return found


def measure_goals(root: Path, walk_order: list[str] | None, doc_order: list[str] | None) -> dict:
    """Every number issue 43's goals name (module doc, definition 5)."""
    files = production_files(root)
    texts = {p: (root / p).read_text() for p in files}
    trees = {p: ast.parse(t) for p, t in texts.items()}
    sizes = {p: t.count("\n") + (0 if t.endswith("\n") or not t else 1) for p, t in texts.items()}
    total = sum(sizes.values())
    user = exception_family(trees)
    guard, kinds, raises, multi, asserts = 0, collections.Counter(), 0, 0, 0
    for tree in trees.values():
        g = guard_lines(tree, user)
        guard += len(g["lines"])
        kinds += g["kinds"]
        raises += g["raises"]
        multi += g["multi_line"]
        asserts += len(g["assert_lines"])
    compat = [(p, a, b, why) for p in files for a, b, why in compat_spans(trees[p], texts[p])]
    out = {"production_lines": total, "guard_lines": guard, "guard_percent": round(100 * guard / total, 1),
           "raises": raises, "raises_multi_line": multi, "raise_kinds": dict(kinds), "assert_lines": asserts,
           "compat_lines": sum(b - a + 1 for _, a, b, _ in compat),
           "compat": [f"{p}:{a}-{b} {why}" for p, a, b, why in compat], "extensions": registry_evidence(trees)}
    if walk_order is not None:
        out["walk"] = walk_goals(walk_order, sizes)
    if doc_order is not None:
        out["doc_walk"] = walk_goals(doc_order, sizes)
    return out


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
    walked = [o.split(" ")[0] for o in out["walk"]["order"]] if "walk" in out else None
    out["goals"] = measure_goals(root, walked, out["doc_walk"]["order"] if out["doc_walk"] else None)
    out["goal_table"] = goal_table(out)
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


def goal_table(r: dict) -> list[dict]:
    """Issue 43's goals for one checkout: {metric, value, goal} rows (value None where not measured)."""
    g = r["goals"]
    walk, docs = g.get("walk", {}), g.get("doc_walk", {})
    kinds = g["raise_kinds"]
    rows = [("core walk files (traced)", walk.get("files"), "<= 20"),
            ("core walk lines (traced)", walk.get("lines"), "<= 6,000"),
            ("hand-written walk files (docs)", docs.get("files"), ""),
            ("hand-written walk lines (docs)", docs.get("lines"), ""),
            ("traced walk returns, all", r.get("walk", {}).get("returns"), ""),
            ("traced walk returns to library files", walk.get("library_returns"), "<= 5"),
            ("... of them to shared/ files", walk.get("shared_returns"), ""),
            ("traced walk A->B->A ping-pongs", walk.get("ping_pongs"), "0"),
            ("... of them with A a library file", walk.get("library_ping_pongs"), ""),
            ("guard lines", g["guard_lines"], ""),
            ("guard lines, % of production", g["guard_percent"], "<= 6%"),
            ("raises", g["raises"], ""),
            ("raises spanning 2+ lines", g["raises_multi_line"], ""),
            ("raises of UserError (and subclasses)", kinds.get("user", 0), ""),
            ("raises of other exception classes", kinds.get("other", 0), ""),
            ("raises re-raising / via a helper", f"{kinds.get('re-raise', 0)} / {kinds.get('helper', 0)}", ""),
            ("assert lines", g["assert_lines"], ""),
            ("production lines", g["production_lines"], "<= 18,000, not growing"),
            ("compat lines", g["compat_lines"], "0")]
    for kind, _ in EXTENSIONS:
        e = g["extensions"].get(kind, {})
        value = None if not e.get("owner") else f"{e['plugin_files']} (package module: {e['package_files']})"
        rows.append((f"files a new {kind} touches", value, "1"))
    return [{"metric": m, "value": v, "goal": goal} for m, v, goal in rows]


def show(value) -> str:
    """A table cell: thousands separated, '-' where not measured."""
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else str(value)


def report_goals(results: list[dict], show_walk: bool) -> None:
    """Issue 43's table (metric | REV | checkout | goal), then the evidence behind each number."""
    tables = [r["goal_table"] for r in results]
    heads = [r["commit"] + (" (checkout)" if r is results[-1] and len(results) > 1 else "") for r in results]
    print("\n5. issue 43's goals")
    print(f"| {'metric':<40} | " + " | ".join(f"{h:>30}" for h in heads) + " | goal")
    for i, row in enumerate(tables[-1]):
        print(f"| {row['metric']:<40} | " + " | ".join(f"{show(t[i]['value']):>30}" for t in tables)
              + f" | {row['goal']}")
    for r in results:
        g = r["goals"]
        print(f"\n== {r['commit']}: issue 43 evidence")
        for name in ("walk", "doc_walk"):
            if name in g:
                w = g[name]
                print(f"   {name}: returns to library files: " +
                      ", ".join(f"{f} {n}x" for f, n in w["library_returned_to"]))
                print(f"   {name}: ping-pongs: " + (", ".join(f"{p} {n}x" for p, n in w["ping_pong_pairs"])
                                                     or "none"))
                if show_walk and name == "walk":
                    for i in w["ping_pong_at"]:
                        print(f"     ping-pong at {i}: " + " -> ".join(r["walk"]["order"][i - 1:i + 2]))
        print("   raises by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(g["raise_kinds"].items())))
        print(f"   compat ({g['compat_lines']} lines):")
        for c in g["compat"]:
            print(f"     {c}")
        for kind, e in g["extensions"].items():
            if not e.get("owner"):
                print(f"   a new {kind}: no {e['function']} found")
                continue
            print(f"   a new {kind}: {e['function']} in {e['owner']} (registry {', '.join(e['registry'])}); "
                  f"built-ins registered in {', '.join(e['registrants'])} as {', '.join(e['names']) or '?'}")
            for line in e["module_lists"] or ["no hard-coded module list"]:
                print(f"     module list: {line}")
            for line in e["importers"]:
                print(f"     import: {line}")
            for line in e["name_lists"] or ["no hard-coded list of its names outside the registry's files"]:
                print(f"     name list: {line}")
            print(f"     --plugin loaded by: {', '.join(e['plugin_loaders']) or 'none'}")


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
    report_goals(results, show_walk)
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

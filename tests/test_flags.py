"""Each flag's default and help live once, on its options dataclass; parsers are derived from the fields."""
import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from shared.datasets.columns import columns
from shared.generative.objectives import OBJECTIVES, training_fields, training_flags
from shared.runtime.cli import FLAG_KEY, Flag, HelpFormatter, add_flags, flag_fields, from_args, option

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "evaluate", "extract", "sample", "shared", "train")


def _options_classes():
    """Every options dataclass of the CLIs, imported (their modules register nothing else on import)."""
    from evaluate.curve import RunEvalOptions
    from evaluate.evaluation import EvalOptions
    from evaluate.floor import FloorOptions
    from evaluate.reference import ReferenceOptions
    from extract.config import ExtractConfig, ExtractModes
    from sample.decode import DecodeOptions
    from sample.to_diffusers import ToDiffusersOptions
    from shared.sampling.plan import SampleOptions
    from sample.watch import WatchOptions
    from train.config import TrainConfig

    return (TrainConfig, SampleOptions, DecodeOptions, WatchOptions, ToDiffusersOptions, EvalOptions, RunEvalOptions,
            FloorOptions, ReferenceOptions, ExtractConfig, ExtractModes,
            *(flags for c in columns().values() for flags in (c.extract_flags, c.train_flags)))


def _parsers():
    """(parser, options dataclass) of every command whose flags are derived from a dataclass."""
    import evaluate.__main__ as evaluate_main
    import extract.__main__ as extract_main
    import sample.__main__ as sample_main
    from evaluate.curve import RunEvalOptions, run_parser
    from evaluate.evaluation import EvalOptions
    from evaluate.floor import FloorOptions, build_parser as floor_parser
    from evaluate.reference import ReferenceOptions, reference_parser
    from extract.config import ExtractConfig
    from sample.decode import DecodeOptions
    from sample.to_diffusers import ToDiffusersOptions
    from shared.sampling.plan import SampleOptions
    from sample.watch import WatchOptions
    from train.config import TrainConfig, build_parser

    return [(build_parser(), TrainConfig), (sample_main.sample_parser(), SampleOptions),
            (sample_main.decode_parser(), DecodeOptions), (sample_main.watch_parser(), WatchOptions),
            (sample_main.export_parser(), ToDiffusersOptions), (evaluate_main.eval_parser(), EvalOptions),
            (run_parser(), RunEvalOptions), (floor_parser(), FloorOptions), (reference_parser(), ReferenceOptions), (extract_main.build_parser(), ExtractConfig)]


# ---------------------------------------------------------------------------------------------------------
# Defaults stated twice: counted in the source
# ---------------------------------------------------------------------------------------------------------

def _dest(call: ast.Call) -> str | None:
    """The namespace name an add_argument call writes (dest=, else its first long flag, else its name)."""
    for kw in call.keywords:
        if kw.arg == "dest" and isinstance(kw.value, ast.Constant):
            return kw.value.value
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    longs = [n for n in names if n.startswith("--")]
    return longs[0][2:].replace("-", "_") if longs else (names[0] if names else None)


def _field_default(value: ast.expr) -> ast.expr | None:
    """The default expression of a dataclass field: `x = 3`, `x = option(3, ...)`, `x = F.field(default=3)`."""
    if not isinstance(value, ast.Call):
        return value
    for kw in value.keywords:
        if kw.arg == "default":
            return kw.value
    if isinstance(value.func, ast.Name) and value.func.id == "option" and value.args:
        return value.args[0]
    return None


SCRIPT_PACKAGES = ("data",)  # independent scripts: an options class of one is not another's (scope: the module)


def defaults_stated_twice(root: Path = ROOT) -> list[str]:
    """`add_argument(..., default=X)` calls whose dest is a field of an options dataclass (a class named
    *Options or *Config) of the same package with the same default X: the knowledge written twice."""
    fields, calls = {}, []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            scope = str(path) if package in SCRIPT_PACKAGES else package
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Options", "Config")):
                    for stmt in node.body:
                        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                            default = _field_default(stmt.value)
                            if default is not None:
                                fields.setdefault((scope, stmt.target.id), set()).add(ast.dump(default))
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                    for kw in node.keywords:
                        if kw.arg == "default":
                            calls.append((scope, _dest(node), ast.dump(kw.value), f"{path.relative_to(root)}"))
    return [f"{where}: --{dest}" for package, dest, dump, where in calls if dump in fields.get((package, dest), ())]


def test_no_default_is_stated_twice():
    """0: every default of an options dataclass reaches its parser from the field, never copied by hand."""
    assert defaults_stated_twice() == []


def test_the_counter_finds_a_copied_default(tmp_path):
    """The counter is not blind: a hand-written parser copying a field's default is found (and only that)."""
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "config.py").write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\nclass TrainConfig:\n    lr: float = option(1e-4, 'lr')\n    seed: int = 0\n"
        "def parser(p):\n"
        "    p.add_argument('--lr', type=float, default=1e-4, help='lr')\n"
        "    p.add_argument('--seed', '--global-seed', type=int, default=1, help='another default: not a copy')\n")
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    assert defaults_stated_twice(tmp_path) == ["train/config.py: --lr"]


def sampler_defaults_stated_twice(root: Path = ROOT) -> list[str]:
    """Places that restate a sampler option's default instead of reading its record (shared/generative/samplers.py):
    a flag field named after the option with a default other than None (not given), `x.get("<option>", <number>)`,
    or a literal tuple pairing the option's name with a number (as default_out once held ("time_shift", ..., 1.0))."""
    from shared.generative.samplers import SAMPLER_OPTIONS

    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in SAMPLER_OPTIONS \
                        and node.value is not None:
                    default = _field_default(node.value)
                    if isinstance(default, ast.Constant) and default.value is not None:
                        found.append(f"{where}: field {node.target.id}")
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and len(node.args) == 2 \
                        and isinstance(node.args[0], ast.Constant) and node.args[0].value in SAMPLER_OPTIONS \
                        and isinstance(node.args[1], ast.Constant):
                    found.append(f"{where}: .get({node.args[0].value!r}, {node.args[1].value!r})")
                elif isinstance(node, ast.Tuple):
                    names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in SAMPLER_OPTIONS]
                    numbers = [e for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, (int, float))
                               and not isinstance(e.value, bool)]
                    if names and numbers:
                        found.append(f"{where}: tuple with {names[0]}")
    return found


def test_no_sampler_option_default_is_stated_outside_its_record():
    """0: the sampler options' defaults live in their records; flags, folder names and processes read them."""
    assert sampler_defaults_stated_twice() == []


def test_the_sampler_counter_finds_restated_defaults(tmp_path):
    """The counter is not blind: the three ways a default used to be restated are each found."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "shared" / "sampling").mkdir()
    (tmp_path / "shared" / "sampling" / "generate.py").write_text(
        "class SampleOptions:\n    time_shift: float | None = option(None, 'shift')\n"
        "    ddim_eta: float = option(0.0, 'eta')\n"
        "def f(o):\n    return o.get('last_step_size', 0.04), (('time_shift', 'shift', 1.0),)\n")
    assert sampler_defaults_stated_twice(tmp_path) == [
        "shared/sampling/generate.py: field ddim_eta", "shared/sampling/generate.py: .get('last_step_size', 0.04)",
        "shared/sampling/generate.py: tuple with time_shift"]


def model_defaults_restated(root: Path = ROOT) -> list[str]:
    """Places that restate a model default instead of importing its one home: a number given to a field, parameter
    or keyword `class_dropout_prob` (home: shared/network/models.py CLASS_DROPOUT_PROB), the objective "ddpm" as a
    default (`objective = "ddpm"`, `.get("objective", "ddpm")`, `return "ddpm", ...`; home: DEFAULT_OBJECTIVE of
    shared/generative/objectives.py), or RAE's shift rounded or computed outside flow.auto_shift."""
    found = []

    def number(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                          bool)

    def ddpm(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == "ddpm"

    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                named = []  # (name, default expression) of fields, parameters and keywords
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                    named.append((node.target.id, _field_default(node.value)))
                elif isinstance(node, ast.arguments):
                    positional = [*node.posonlyargs, *node.args]
                    named += [(a.arg, d) for a, d in zip(positional[len(positional) - len(node.defaults):],
                                                         node.defaults)]
                    named += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
                elif isinstance(node, ast.keyword) and node.arg:
                    named.append((node.arg, node.value))
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and len(node.args) == 2 \
                        and isinstance(node.args[0], ast.Constant) and node.args[0].value == "objective" \
                        and ddpm(node.args[1]):
                    found.append(f"{where}:{node.lineno} objective default")
                elif isinstance(node, ast.Return) and node.value is not None and (
                        ddpm(node.value) or isinstance(node.value, ast.Tuple) and any(map(ddpm, node.value.elts))):
                    found.append(f"{where}:{node.lineno} objective default")
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "round" and node.args:
                    inner = ast.dump(node.args[0])
                    if "auto_shift" in inner or "Pow" in inner and "0.5" in inner:
                        found.append(f"{where}:{node.lineno} shift rounded")
                for name, default in named:
                    if name == "class_dropout_prob" and number(default) and default.value != 0:
                        found.append(f"{where}:{default.lineno} class_dropout_prob {default.value}")
                    elif name == "objective" and ddpm(default):
                        found.append(f"{where}:{default.lineno} objective default")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0]), f))


def test_no_model_default_is_restated():
    """0: label dropout, the default objective and RAE's rounded shift each have one home that the others import."""
    assert model_defaults_restated() == []


def test_the_model_defaults_counter_finds_each_restatement(tmp_path):
    """The counter is not blind: each way those defaults used to be restated is found (a dropout of 0 is a choice)."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "shared" / "copies.py").write_text(
        "class ModelConfig:\n    class_dropout_prob: float = 0.1\n    objective: str = option('ddpm', 'what')\n"
        "def dit(depth, class_dropout_prob=0.1, *, objective='ddpm'):\n"
        "    return build(class_dropout_prob=0.1, off=dict(class_dropout_prob=0))\n"
        "def kind(d):\n    if d.get('objective', 'ddpm') == 'flow':\n        return 'ddpm', 'assumed'\n"
        "SHIFT = round((768 * 16 * 16 / 4096) ** 0.5, 6)\nshift = round(auto_shift(shape), 6)\n")
    assert model_defaults_restated(tmp_path) == [
        "shared/copies.py:2 class_dropout_prob 0.1", "shared/copies.py:3 objective default",
        "shared/copies.py:4 class_dropout_prob 0.1", "shared/copies.py:4 objective default",
        "shared/copies.py:5 class_dropout_prob 0.1", "shared/copies.py:7 objective default",
        "shared/copies.py:8 objective default", "shared/copies.py:9 shift rounded",
        "shared/copies.py:10 shift rounded"]


@pytest.mark.parametrize("index", range(10))
def test_help_does_not_restate_the_default(index):
    """The formatter prints each default from the field; a help text that also spells it out would drift."""
    cls = _options_classes()[index]
    for f in flag_fields(cls):
        spec = f.metadata[FLAG_KEY]
        assert spec.help, f"{cls.__name__}.{f.name} has no help"
        if spec.default not in (dataclasses.MISSING, None) and not isinstance(spec.default, bool):
            shown = " ".join(map(str, spec.default)) if isinstance(spec.default, tuple) else str(spec.default)
            assert f"default: {shown}" not in spec.help and f"default {shown}" not in spec.help, (cls, f.name)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_training_fields_are_flags_of_train(name):
    """Each registered objective's training fields are python -m train flags, with the field's default and help."""
    from train.config import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    for f in training_fields(OBJECTIVES[name]):
        spec = f.metadata[FLAG_KEY]
        assert f.name in actions and spec.help in actions[f.name].help, (name, f.name)
        assert f"(default: {spec.default})" in actions[f.name].help and f"default: {spec.default}" not in spec.help


# ---------------------------------------------------------------------------------------------------------
# Parsers derived from the fields
# ---------------------------------------------------------------------------------------------------------

STAGES = ("TrainConfig", "ExtractConfig")  # their parsers add the registered shard columns' flags


@pytest.mark.parametrize("index", range(9))
def test_parser_defaults_are_the_fields(index):
    """Parsing only the required arguments gives exactly the dataclass built with only those."""
    parser, cls = _parsers()[index]
    required = {}
    argv = []
    for f in flag_fields(cls):
        spec = f.metadata[FLAG_KEY]
        if spec.default is dataclasses.MISSING:
            value = "7" if f.type in ("int", int) else f"given-{f.name}"
            required[f.name] = int(value) if value == "7" else value
            argv += [value] if spec.positional else [spec.name or "--" + f.name.replace("_", "-"), value]
    assert from_args(cls, parser.parse_args(argv)) == cls(**required)
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    objective_flags = set(training_flags()) if cls.__name__ == "TrainConfig" else set()  # from the registry
    column_flags = {f.name for c in columns().values() for f in dataclasses.fields(  # from the column registry
        c.train_flags if cls.__name__ == "TrainConfig" else c.extract_flags)} if cls.__name__ in STAGES else set()
    allowed = {f.name for f in dataclasses.fields(cls)} | {"check", "dry_run", "verify"}
    assert dests <= allowed | objective_flags | column_flags


def test_train_flags_keep_their_official_names_and_choices():
    """The names DiT users type still work: --global-seed, --mixed-precision no, a bare --grad-checkpoint."""
    from train.config import TrainConfig, build_parser, config_from_args

    args = build_parser().parse_args(["--latents", "L", "--results-dir", "R", "--global-seed", "3",
                                      "--mixed-precision", "no", "--grad-checkpoint", "--adam-betas", "0.5", "0.6"])
    cfg = config_from_args(args)
    assert (cfg.seed, cfg.precision, cfg.grad_checkpoint, cfg.adam_betas) == (3, "fp32", 1, (0.5, 0.6))
    assert cfg == TrainConfig(latents="L", results_dir="R", seed=3, precision="fp32", grad_checkpoint=1,
                              adam_betas=(0.5, 0.6))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--latents", "L", "--results-dir", "R", "--max-steps", "1", "--epochs", "1"])


def test_one_field_is_one_flag():
    """What a new setting needs: one field. Switches, aliases, choices, types and exclusive groups follow."""
    @dataclasses.dataclass
    class Options:
        path: str = option(help="where", positional=True, metavar="PATH")
        size: int | None = option(None, "how big", aliases=("--official-size",))
        ratio: float = option(0.5, "how much", exclusive="amount")
        count: int = option(2, "how many", exclusive="amount")
        mode: str = option("a", "which", choices=("a", "b"))
        fast: bool = option(False, "go fast")
        tf32: bool = option(True, "no TF32", name="--no-tf32")
        pair: tuple = option((1, 2), "two numbers", type=int, nargs=2)

    parser = add_flags(argparse.ArgumentParser(formatter_class=HelpFormatter), Options)
    got = from_args(Options, parser.parse_args(["P", "--official-size", "3", "--ratio", "0.25", "--mode", "b",
                                                "--fast", "--no-tf32", "--pair", "3", "4"]))
    assert got == Options("P", 3, 0.25, 2, "b", True, False, (3, 4))
    assert from_args(Options, parser.parse_args(["P"])) == Options("P")
    for bad in (["P", "--ratio", "1", "--count", "1"], ["P", "--mode", "c"], ["P", "--size", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    text = parser.format_help()
    assert "(default: 0.5)" in text and "(default: 1 2)" in text and "(default: off)" in text


def test_a_family_flag_changes_per_command():
    """A shared Flag keeps its help where a command changes only its default (evaluate draws 50 steps; sample the
    recorded count, else 250)."""
    from evaluate.curve import RunEvalOptions
    from shared.sampling.plan import SampleOptions
    from shared.sampling.flags import NUM_SAMPLING_STEPS, STEPS_HELP

    assert isinstance(NUM_SAMPLING_STEPS, Flag)
    sample_field = {f.name: f for f in dataclasses.fields(SampleOptions)}["num_sampling_steps"]
    eval_field = {f.name: f for f in dataclasses.fields(RunEvalOptions)}["num_sampling_steps"]
    assert (sample_field.default, eval_field.default) == (None, 50)
    assert sample_field.metadata[FLAG_KEY].help == NUM_SAMPLING_STEPS.help
    # evaluate run keeps the shared sentence, then states its own number (not sample's recorded-count rule).
    assert NUM_SAMPLING_STEPS.help.startswith(STEPS_HELP) and eval_field.metadata[FLAG_KEY].help == STEPS_HELP


def test_a_flag_family_dataclass_lists_after_the_commands_own_flags():
    """Commands deriving from DecodeFlags get every VAE flag, after their own (the help reads command first)."""
    from sample.__main__ import decode_parser, sample_parser, watch_parser
    from shared.sampling.flags import DecodeFlags

    family = [f.name for f in dataclasses.fields(DecodeFlags)]
    for parser in (sample_parser(), decode_parser(), watch_parser()):
        dests = [a.dest for a in parser._actions if a.dest != "help"]
        assert dests[-len(family):] == family, parser.prog


def test_a_declared_bound_is_checked_once_by_from_args():
    """`option(min=..., max=...)` refuses an out-of-range value in one paragraph naming the flag and the bound."""
    from shared.runtime.errors import UserError

    @dataclasses.dataclass
    class Bounded:
        steps: int = option(4, "how many", min=1)
        scale: float = option(0.5, "a fraction", min=0.0, max=1.0)
        sizes: tuple = option((2,), "sizes", nargs="+", type=int, min=1)

    parser = add_flags(argparse.ArgumentParser(), Bounded)
    assert from_args(Bounded, parser.parse_args(["--steps", "1", "--scale", "1"])) == Bounded(1, 1.0, (2,))
    for argv, needle in ((["--steps", "0"], "--steps must be at least 1; got 0."),
                         (["--scale", "1.5"], "--scale must be at most 1; got 1.5."),
                         (["--sizes", "3", "0"], "--sizes must be at least 1; got 0.")):
        with pytest.raises(UserError, match="^" + needle.replace(".", r"\.")):
            from_args(Bounded, parser.parse_args(argv))


def test_strict_bounds_words_and_nan():
    """above=/below= are strict; a word ("auto") is left for later; NaN lies in no range; the refusal names the range."""
    from shared.runtime.cli import check_flag_bounds
    from shared.runtime.errors import UserError

    @dataclasses.dataclass
    class Strict:
        prob: float = option(0.1, "a probability", min=0, below=1)
        rate: float = option(1.0, "a rate", above=0)
        micro: int | str = option("auto", "a size or auto", type=str, min=1)

    parser = add_flags(argparse.ArgumentParser(), Strict)
    assert from_args(Strict, parser.parse_args(["--prob", "0", "--rate", "1e-9"])) == Strict(0.0, 1e-9, "auto")
    for argv, needle in ((["--prob", "1"], "--prob must be below 1; got 1. Pass a value in [0, 1)."),
                         (["--rate", "0"], "--rate must be above 0; got 0. Pass a value above 0."),
                         (["--rate", "nan"], "--rate must be above 0; got nan.")):
        with pytest.raises(UserError, match="^" + needle.replace(".", r"\.").replace("[", r"\[").replace(")", r"\)")):
            from_args(Strict, parser.parse_args(argv))
    with pytest.raises(UserError, match="^--micro must be at least 1; got 0"):
        check_flag_bounds(Strict(micro=0))  # an instance built in Python is checked the same way

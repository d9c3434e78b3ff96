"""Issue 35, item 5: the definitions of tests/bench/architecture.py, checked on constructed inputs."""
import ast
import base64
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "tests" / "bench" / "architecture.py")
arch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch)


def test_returns_count_every_file_met_again_after_others():
    walk = arch.count_walk(["a", "b", "a", "c", "b", "a"])
    assert (walk["files"], walk["returns"], walk["returned_to"]) == (3, 3, 2)
    assert walk["most"][0] == ("a", 2)


def test_line_kinds_split_code_docstrings_comments_and_blanks():
    text = textwrap.dedent('''\
        """Module doc,
        on two lines."""
        # a comment

        X = """not a docstring,
        code"""  # trailing comment: a code line


        def f():
            """One line."""
            return X
        ''')
    kinds = arch.line_kinds(text)
    assert {k: kinds[k] for k in ("total", "code", "docstring", "comment", "blank")} == \
        {"total": 11, "code": 4, "docstring": 3, "comment": 1, "blank": 3}


def test_imports_at_any_depth_make_a_cycle():
    modules = {"p.x", "p.y", "p.z"}
    x = ast.parse("from p.y import f\nimport numpy\n")
    y = ast.parse("def g():\n    from . import x\n    from .z import h\n")
    graph = {"p.x": arch.imported_modules("p/x.py", x, modules), "p.y": arch.imported_modules("p/y.py", y, modules),
             "p.z": set()}
    assert graph == {"p.x": {"p.y"}, "p.y": {"p.x", "p.z"}, "p.z": set()}
    assert arch.cycles(graph) == [["p.x", "p.y"]]


def test_per_element_statistics_are_found_as_base64_or_lists_even_inside_a_json_string():
    stats = base64.b64encode(np.arange(8, dtype="<f4").tobytes()).decode()
    nested = [[[0.5, 1.5], [2.5, 3.5]], [[4.5, 5.5], [6.5, 7.5]]]
    record = {"norm": {"mean": {"data": stats}, "std": nested}, "other": [1.0, 2.0], "name": "abcd"}
    found = arch.per_element_chars({"latents": json.dumps(record)}, 8)
    assert found == len(stats) + len(json.dumps(nested, separators=(",", ":")))
    assert arch.per_element_chars(record, 16) == 0  # another element count: nothing scales


def test_the_walk_follows_the_data_across_files_not_plumbing(tmp_path):
    """pkg/a.py hands a tensor to pkg/b.py twice (counted once) and a path to pkg/c.py (plumbing, left out)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent("""\
        import torch
        from pkg import b, c

        def main():
            c.log("run/x.txt")
            for _ in range(2):
                x = b.encode(torch.ones(2, 3))
            c.log("done")
            return b.decode(x).sum().item()
        """))
    (pkg / "b.py").write_text(textwrap.dedent("""\
        from pkg import c

        def encode(x):
            return c.scale(x) + 1

        def decode(x):
            return x * 2
        """))
    (pkg / "c.py").write_text(textwrap.dedent("""\
        def log(path):
            return len(path)

        def scale(x):
            return x * 3
        """))
    sys.path.insert(0, str(tmp_path))
    try:
        from pkg import a
        tracer = arch.WalkTracer(tmp_path)
        assert tracer.trace("pkg/a.py", a.main) == 48.0
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "pkg" or m.startswith("pkg.")]:
            del sys.modules[name]
    order = tracer.walk()
    assert order == [("pkg/a.py", "main"), ("pkg/b.py", "encode"), ("pkg/c.py", "scale"), ("pkg/a.py", "main"),
                     ("pkg/b.py", "decode")]
    walk = arch.count_walk([f for f, _ in order])
    assert (walk["files"], walk["returns"], walk["returned_to"]) == (3, 2, 2)
    assert not tracer.is_data(torch.ones(2, 3, device="meta")) and not tracer.is_data(torch.ones(3))


def test_library_returns_leave_out_orchestrators_and_ping_pongs_are_listed_by_pair():
    order = ["train/__main__.py", "train/loop.py", "shared/a.py", "train/loop.py", "shared/a.py", "train/data.py",
             "shared/a.py", "train/__main__.py"]
    goals = arch.walk_goals(order, {"train/loop.py": 10, "shared/a.py": 5, "train/data.py": 2})
    assert (goals["files"], goals["lines"]) == (4, 17)
    # returns: loop (orchestrator), a, a, __main__ (orchestrator): two to a library file
    assert (goals["library_returns"], goals["shared_returns"]) == (2, 2)
    assert goals["ping_pongs"] == 3  # loop-a-loop, a-loop-a, a-data-a
    assert goals["library_ping_pongs"] == 2  # a-loop-a, a-data-a: loop-a-loop is the orchestrator's turn
    assert goals["ping_pong_pairs"] == [("shared/a.py <-> train/loop.py", 2), ("shared/a.py <-> train/data.py", 1)]
    assert arch.is_orchestrator("extract/run.py") and not arch.is_orchestrator("shared/run.py")


def test_guard_lines_are_raises_guard_ifs_and_check_functions_counted_once():
    tree = ast.parse(textwrap.dedent("""\
        class UserError(Exception):
            pass
        class Refusal(UserError):
            pass

        def check_size(n):
            if n < 0:
                raise Refusal(
                    "negative")
            return n

        def f(x):
            if x:
                raise ValueError("x")
            else:
                return 1
            if x > 2:
                x += 1
                raise
            assert x, "contract"
            raise refuse(x)
        """))
    user = arch.exception_family({"m.py": tree})
    assert user == {"UserError", "Refusal"}
    g = arch.guard_lines(tree, user)
    # check_size (6-10), the guard-if 13-14 (not its else), the bare raise 19 (its if holds more than raises), 21
    assert sorted(g["lines"]) == [6, 7, 8, 9, 10, 13, 14, 19, 21]
    assert (g["raises"], g["multi_line"], sorted(g["assert_lines"])) == (4, 1, [20])
    assert g["kinds"] == {"user": 1, "other": 1, "re-raise": 1, "helper": 1}


def test_compat_spans_follow_the_marker_names_and_comments():
    text = textwrap.dedent("""\
        import json
        from pkg.export import space_parts

        def read(meta):
            if "latents" in meta:
                return from_legacy(meta)
            x = json.loads(meta)  # an older record keeps its numbers inline
            y = x  # older GPUs: not a format of ours
            # the legacy form of the config
            z = y
            return z

        def upgrade(d):
            return d
        """)
    spans = arch.compat_spans(ast.parse(text), text)
    assert [(a, b) for a, b, _ in spans] == [(2, 2), (5, 6), (7, 7), (10, 10), (13, 14)]
    assert spans[1][2] == "if: from_legacy" and spans[-1][2] == "def upgrade"


def test_registry_evidence_finds_import_lists_and_name_lists():
    files = {
        "shared/reg.py": "BUILT_IN = ('shared.extra',)\nTHINGS = {}\n\n"
                         "def register_sampler(spec: Spec):\n    THINGS[spec.name] = spec\n\n"
                         "THINGS.register('a', Spec('a'))\n",
        "shared/extra.py": "from shared.reg import register_sampler\nregister_sampler(Spec('b', 1))\n",
        "sample/__main__.py": "from shared.runtime.plugins import load_plugins\nCHOICES = ('a', 'b')\n"
                              "def main(argv):\n    load_plugins(argv)\n",
    }
    trees = {p: ast.parse(t) for p, t in files.items()}
    e = arch.registry_evidence(trees)["sampler"]
    assert (e["owner"], e["registry"], e["registrants"]) == ("shared/reg.py", ["THINGS"],
                                                              ["shared/extra.py", "shared/reg.py"])
    assert e["names"] == ["a", "b"] and e["plugin_loaders"] == ["sample/__main__.py"]
    assert e["module_lists"] == ["shared/reg.py:1 BUILT_IN = ['shared.extra']"]
    assert e["name_lists"] == ["sample/__main__.py:2 ['a', 'b']"]
    assert (e["plugin_files"], e["package_files"]) == (2, 2)
    assert arch.registry_evidence(trees)["shard column"] == {"function": "register_column", "owner": None}

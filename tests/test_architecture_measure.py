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

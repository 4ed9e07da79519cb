"""Every command-line flag of the package and of scripts/ says what it does in --help (an argparse flag
without help= prints its bare name)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_add_argument_has_help():
    bare = []
    for path in sorted([*ROOT.glob("strata_ray/**/*.py"), *ROOT.glob("scripts/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                    and "help" not in {k.arg for k in node.keywords}):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, bare

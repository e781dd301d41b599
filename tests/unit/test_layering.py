"""The import layering (launch -> kimi_jax -> {checkpoints, pallas_kernels}): checkpoints/ is file
formats only and imports nothing of kimi_jax, pallas_kernels, launch or absl; kimi_jax/ imports nothing
of launch and nothing of absl. Read from the sources'
import statements (ast), so a lazy import inside a function counts too."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _imports(package: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                    if isinstance(node, ast.Import):
                        yield path, [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        yield path, [node.module]


@pytest.mark.parametrize("package,forbidden", [
    ("checkpoints", ("kimi_jax", "launch", "pallas_kernels", "absl")),
    ("kimi_jax", ("launch", "absl")),
])
def test_imports_only_go_downward(package, forbidden):
    bad = [(os.path.relpath(p, ROOT), n) for p, names in _imports(package) for n in names
           if n.split(".")[0] in forbidden]
    assert not bad, bad

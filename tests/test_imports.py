"""Dependency direction: scheduler never imports jax; scheduler and pallas_kernels never import jaxhybrid."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORBIDDEN = {
    "scheduler": {"jax", "jaxlib", "flax", "jaxhybrid", "pallas_kernels", "torch"},
    "pallas_kernels": {"jaxhybrid", "scheduler", "torch"},
    "jaxhybrid": {"torch"},
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_allowed_modules(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_modules(f) & FORBIDDEN[package]) for f in files}
    assert not {f: bad for f, bad in offenders.items() if bad}


def test_importing_scheduler_loads_no_jax():
    """The static scan cannot see imports done through importlib; the interpreter can."""
    code = (
        "import sys, pkgutil, importlib, scheduler\n"
        "for m in pkgutil.walk_packages(scheduler.__path__, 'scheduler.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('jax', 'jaxlib', 'flax', 'jaxhybrid'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

"""Import rules: the layers import only downward, scheduler never imports jax, nothing imports torch."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
# Top to bottom. A module may import its own package (the longest prefix below that names it) and any package
# of a lower layer; packages that share a layer do not import each other. Every other jaxhybrid module (llm,
# score, serve/, tiny/, ...) is an entry point.
LAYERS = (
    ("scheduler.sim",),                 # test support on top: the runtime never imports the simulator
    ("jaxhybrid",),                     # entry points: LLM, engine_args, generate, score, ray_data, serve/, tiny/
    ("jaxhybrid.engine",),              # the loop, output processing, detokenizing
    ("jaxhybrid.parsers", "jaxhybrid.structured_output"),  # text parsers (a tokenizer by duck typing); grammars
    ("jaxhybrid.worker",),              # the runner: pools, the jitted step per bucket, multi-host
    ("jaxhybrid.spec_decode",),         # MTP drafting inside the step
    ("jaxhybrid.sample",),              # sampling parameters and the on-device sampler
    ("jaxhybrid.models",),              # config, weights, the Flax model and its tensor-parallel layout
    ("pallas_kernels", "scheduler"),
)
EXTERNAL = {  # third-party modules a package must not import (the longest prefix applies)
    "scheduler": {"jax", "jaxlib", "flax", "torch"},
    "pallas_kernels": {"torch"},
    "jaxhybrid": {"torch", "optax", "matplotlib"},  # the last two come with the `train` extra
    "jaxhybrid.tiny": {"torch"},
    "jaxhybrid.train_tiny": {"torch"},
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path) -> set[str]:
    """Absolute names of what a file imports (relative imports resolved), function-local imports included."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from a import b` may name module a.b
    return names


def _place(module: str) -> tuple[int, str] | None:
    """(layer index, package prefix) of the longest prefix that owns `module`; None outside the layers."""
    owners = [(len(prefix), depth, prefix) for depth, layer in enumerate(LAYERS) for prefix in layer
              if module == prefix or module.startswith(prefix + ".")]
    if not owners:
        return None
    _, depth, prefix = max(owners)
    return depth, prefix


def layer_violations(root: Path) -> list[str]:
    """'importer -> imported' for every import that goes up a layer or sideways into another package."""
    found = []
    for top in sorted({prefix.split(".")[0] for layer in LAYERS for prefix in layer}):
        for path in sorted((root / top).rglob("*.py")):
            importer = _place(_module_name(path, root))
            for name in sorted(_imports(path, root)):
                imported = _place(name)
                if imported and imported[1] != importer[1] and imported[0] <= importer[0]:
                    found.append(f"{path.relative_to(root)} -> {name}")
    return found


def test_layers_import_only_downward():
    assert layer_violations(ROOT) == []


def test_an_upward_or_sideways_import_is_reported(tmp_path):
    files = {
        "jaxhybrid/llm.py": "from jaxhybrid.engine.core import Engine\n",       # down: allowed
        "jaxhybrid/engine/core.py": "from ..worker import runner\nfrom . import outputs\n",  # down, own package
        "jaxhybrid/models/model.py": "def f():\n    from jaxhybrid.engine.core import Engine\n",  # up
        "jaxhybrid/sample/sampler.py": "from jaxhybrid import llm\n",                # up, to the entry points
        "pallas_kernels/gdn.py": "import scheduler.plan\n",                          # sideways
        "scheduler/plan.py": "import numpy\n",
        "scheduler/schedule.py": "from scheduler.sim.invariants import check_invariants\n",  # up, to test support
        "scheduler/sim/simulator.py": "from scheduler.plan import BatchPlan\n",   # down
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_violations(tmp_path) == [
        "jaxhybrid/models/model.py -> jaxhybrid.engine.core.Engine",
        "jaxhybrid/sample/sampler.py -> jaxhybrid.llm",
        "pallas_kernels/gdn.py -> scheduler.plan",
        "scheduler/schedule.py -> scheduler.sim.invariants.check_invariants",
    ]


def test_no_module_imports_a_forbidden_library():
    offenders = {}
    for top in ("scheduler", "pallas_kernels", "jaxhybrid"):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path, ROOT)
            rule = max((p for p in EXTERNAL if module == p or module.startswith(p + ".")), key=len)
            bad = {name.split(".")[0] for name in _imports(path, ROOT)} & EXTERNAL[rule]
            if bad:
                offenders[module] = sorted(bad)
    assert offenders == {}


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

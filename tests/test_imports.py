"""Import rules: the layers import only downward, no module imports itself back, scheduler never imports jax,
nothing imports torch."""

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).parent.parent
# Top to bottom. A module may import its own package (the longest prefix below that names it) and any package
# of a lower layer; packages that share a layer do not import each other. Every other jaxhybrid module
# (cli, the console script; generate; tiny/; the package's exports) is an entry point.
LAYERS = (
    ("scheduler.sim",),                 # test support on top: the runtime never imports the simulator
    ("jaxhybrid",),                     # entry points: cli, the package's exports, generate, tiny/, train_tiny
    ("jaxhybrid.serve", "jaxhybrid.run_batch"),  # the programs: the HTTP server, the batch job's command line
    ("jaxhybrid.ray_data",),            # the batch job on Ray Data actors
    ("jaxhybrid.flags", "jaxhybrid.malloc"),  # the programs' flags; their allocator
    ("jaxhybrid.llm", "jaxhybrid.batch_job"),  # the Python API; the batch job's lines over a built engine
    ("jaxhybrid.scoring",),             # candidates scored by their prompt logprobs
    ("jaxhybrid.openai",),              # the OpenAI protocol: request bodies, chat rendering, responses, errors
    ("jaxhybrid.engine.builder",),      # EngineArgs -> model, tokenizer, pools and Engine, built once
    ("jaxhybrid.engine",),              # the loop, output processing, detokenizing, prompts, the engine's settings
    ("jaxhybrid.parsers", "jaxhybrid.structured_output"),  # text parsers (a tokenizer by duck typing); grammars
    ("jaxhybrid.worker",),              # the runner: pools, the jitted step per bucket, multi-host
    ("jaxhybrid.spec_decode",),         # MTP drafting inside the step
    ("jaxhybrid.sample",),              # sampling parameters and the on-device sampler
    ("jaxhybrid.models",),              # config, weights, the Flax model and its tensor-parallel layout
    ("pallas_kernels", "scheduler"),
)
CYCLE_CHECKED = ("scheduler", "pallas_kernels", "jaxhybrid")  # the packages whose modules must form no cycle
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


def module_graph(root: Path, tops: tuple[str, ...] = CYCLE_CHECKED) -> dict[str, set[str]]:
    """Module -> the modules of `tops` it imports anywhere in its file: function-local and TYPE_CHECKING
    imports count, since they hide a cycle rather than remove it. `from a import b` names module a.b where
    there is one, else module a; importing a module is not counted as importing the packages above it."""
    paths = {_module_name(path, root): path for top in tops for path in sorted((root / top).rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        graph[module] = set()
        for name in _imports(path, root):
            parts = name.split(".")
            owners = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
            owner = next((o for o in owners if o in paths), None)
            if owner is not None and owner != module:
                graph[module].add(owner)
    return graph


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The modules of the shortest import path from `start` back to itself (breadth first), start first."""
    parents, queue = {start: None}, deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph[module]):
            if target == start:
                path = [module]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return path[::-1]
            if target not in parents:
                parents[target] = module
                queue.append(target)
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every module's shortest cycle, as 'a -> b -> a' written from its smallest module, each cycle once."""
    cycles = set()
    for start in graph:
        ring = _shortest_cycle(graph, start)
        if ring:
            first = ring.index(min(ring))
            ring = ring[first:] + ring[:first]
            cycles.add(" -> ".join([*ring, ring[0]]))
    return sorted(cycles)


def test_no_module_imports_itself_back():
    assert import_cycles(module_graph(ROOT)) == []


def test_a_cycle_hidden_in_a_function_or_type_checking_is_reported(tmp_path):
    files = {
        "jaxhybrid/__init__.py": "from jaxhybrid.llm import LLM\n",  # a package above its modules: no cycle
        "jaxhybrid/llm.py": "from jaxhybrid.engine import core\n",
        "jaxhybrid/engine/__init__.py": "",
        "jaxhybrid/engine/core.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                    "    from jaxhybrid.llm import LLM\n",
        "jaxhybrid/engine/outputs.py": "from . import core\n",
        "scheduler/__init__.py": "from scheduler.plan import BatchPlan\n",
        "scheduler/plan.py": "import numpy\nfrom scheduler import config\n",
        "scheduler/config.py": "def f():\n    from .buckets import ladder\n",
        "scheduler/buckets.py": "import scheduler.plan\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_graph(tmp_path, ("jaxhybrid", "scheduler"))
    assert graph["scheduler.plan"] == {"scheduler.config"} and graph["jaxhybrid"] == {"jaxhybrid.llm"}
    assert import_cycles(graph) == [
        "jaxhybrid.engine.core -> jaxhybrid.llm -> jaxhybrid.engine.core",
        "scheduler.buckets -> scheduler.plan -> scheduler.config -> scheduler.buckets",
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

"""The cost of a jitted program: XLA's cost model for its XLA ops, the Pallas kernels' own estimates for them.

XLA cannot see the kernels on GPU: jax's Triton lowering drops a pallas_call's cost_estimate, and XLA's cost
model counts the custom call it becomes as 0 FLOPs and 0 bytes. So a program's cost is `xla_cost` of its compiled module
plus `kernel_cost` of its jaxpr, the sum of the `pl.CostEstimate` every pallas_call carries.

The walk reads each pallas_call equation of the jaxpr, through every sub-jaxpr (jit, shard_map,
custom_jvp/vjp, remat, loops, conditionals). Inside shard_map a kernel sees one device's shards, so its
estimate, and the sum, is per device. A scan counts its body `length` times; a while loop (fori_loop with a
traced trip count) counts it once; a cond counts the branch `branch` picks (max: its costliest, by FLOPs
then bytes; min: its cheapest). `kernel_costs` keeps the sum per kernel name.

XLA's own analysis of a `conditional` takes, property by property, the maximum over its branches: a decode step
is charged for the prefill path of every mixer, the fallback layout of every MoE layer and the costliest sampling
mode, none of which runs in it. `xla_costs` therefore costs each top-level instruction of the compiled module on
its own (the same HloCostAnalysis, on a module holding that one instruction) and resolves each conditional to the
branch a policy picks (`cheapest`, `most_kernels`), recursively; it keeps each instruction's `op_name`, so the
bytes can be attributed to the model's parts. It also charges a fusion that only gathers from an operand for the
slices it gathers, not the whole operand as XLA does (`_unread`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax


class Cost(NamedTuple):
    """FLOPs, transcendentals and bytes accessed of some kernels, and how many launches they are."""

    flops: float = 0
    transcendentals: float = 0
    bytes_accessed: float = 0
    kernels: float = 0

    def __add__(self, other: Cost) -> Cost:  # type: ignore[override]
        return Cost(*(a + b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> Cost:
        return Cost(*(n * a for a in self))


def _kernel_name(eqn: Any) -> str:
    named = eqn.params.get("name_and_src_info")
    return eqn.params.get("name") or getattr(named, "name", None) or str(named)


def _estimate(eqn: Any) -> Cost:
    estimate = eqn.params.get("cost_estimate")
    if estimate is None:
        raise ValueError(f"pallas_call {_kernel_name(eqn)!r} carries no cost_estimate")
    return Cost(estimate.flops, estimate.transcendentals, estimate.bytes_accessed, 1)


def _total(costs: dict[str, Cost]) -> Cost:
    return sum(costs.values(), Cost())


def _add(into: dict[str, Cost], costs: dict[str, Cost], times: float = 1) -> None:
    for name, cost in costs.items():
        into[name] = into.get(name, Cost()) + cost.times(times)


def _jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs in one equation parameter (a Jaxpr, a ClosedJaxpr, or a tuple of them)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value, "consts"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _jaxprs(item)


def kernel_costs(jaxpr: Any, branch: Callable[..., Any] = max) -> dict[str, Cost]:
    """The CostEstimates of the pallas_calls in `jaxpr` (a Jaxpr or ClosedJaxpr, e.g. `jax.make_jaxpr`'s or a
    `Traced.jaxpr`), summed per kernel name (the pallas_call's `name`, tile parameters included); a cond adds the
    branch whose total `branch` (max or min, called with `key=`) picks. Raises ValueError for a pallas_call
    without an estimate."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr
    found: dict[str, Cost] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            _add(found, {_kernel_name(eqn): _estimate(eqn)})
        elif name == "cond":
            _add(found, branch((kernel_costs(b, branch) for b in eqn.params["branches"]), key=_total))
        else:
            times = eqn.params["length"] if name == "scan" else 1
            for inner in (kernel_costs(j, branch) for p in eqn.params.values() for j in _jaxprs(p)):
                _add(found, inner, times)
    return found


def kernel_cost(jaxpr: Any, branch: Callable[..., Any] = max) -> Cost:
    """The summed CostEstimates of the pallas_calls in `jaxpr` (`kernel_costs`, all names together)."""
    return _total(kernel_costs(jaxpr, branch))


def xla_cost(compiled: jax.stages.Compiled, branch: BranchPolicy | None = None) -> Cost:
    """XLA's HloCostAnalysis of a compiled program's optimised modules (one device's, after SPMD partitioning);
    with `branch`, each conditional costed as the branch it picks (`xla_costs`), else as XLA costs it (each
    property's maximum over the branches).

    `Compiled.cost_analysis()` is None for a deviceless compile (`pallas_kernels.aot`), so the same analysis
    runs on the modules' HLO through the host's client. It counts a Triton custom call as 0 FLOPs and 0 bytes:
    `ssd_decode` at Nemotron-H-8B's shapes (256 rows, 300 slots) compiled alone costs 2.1 MFLOP and 2.525 GB
    there, all of it the output's zero-padding fusion and a copy of the (undonated) 1.26 GB pool."""
    if branch is not None:
        return sum((cost for _, cost in xla_costs(compiled, branch)), Cost())
    client, total = jax.devices("cpu")[0].client, Cost()
    for module in compiled.runtime_executable().hlo_modules():
        total += _analysis(client, module)
    return total


def _analysis(client: Any, module: Any) -> Cost:
    from jax._src.lib import _jax  # noqa: PLC0415 - the analysis behind Compiled.cost_analysis, on any client

    found = _jax.hlo_module_cost_analysis(client, module)
    return Cost(found.get("flops", 0), found.get("transcendentals", 0), found.get("bytes accessed", 0))


# --- the compiled module instruction by instruction ---------------------------------------------------------

KERNEL_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'  # a pallas_call in a module compiled for the GPU
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id"}
_DROPPED = ("control-predecessors", "output_to_operand_aliasing")  # refer to what a one-instruction module lacks


class Branch(NamedTuple):
    """One branch of a conditional: its instructions' costs and how many Pallas kernels it launches."""

    costs: list[tuple[str, Cost]]
    kernels: int

    @property
    def cost(self) -> Cost:
        return sum((cost for _, cost in self.costs), Cost())


BranchPolicy = Callable[[Sequence[Branch]], int]  # the index of the branch to count


def cheapest(branches: Sequence[Branch]) -> int:
    """The branch with the fewest bytes (then FLOPs): the steady state of a decode step."""
    return min(range(len(branches)), key=lambda i: (branches[i].cost.bytes_accessed, branches[i].cost.flops))


def most_kernels(branches: Sequence[Branch]) -> int:
    """The branch launching the most Pallas kernels, else the cheapest: a prefill step's mixers take their
    prefill path, and everything else (MoE fallbacks, sampling modes) its steady state."""
    most = max(b.kernels for b in branches)
    if most == 0:
        return cheapest(branches)
    return next(i for i, b in enumerate(branches) if b.kernels == most)


class _Computations(NamedTuple):
    lines: dict[str, list[str]]  # computation name -> its text, header and closing brace included
    entry: str


def _computations(text: str) -> _Computations:
    lines: dict[str, list[str]] = {}
    entry, name, current = "", None, []
    for line in text.splitlines():
        if name is None:
            found = re.match(r"^(ENTRY )?%([\w.\-]+) ", line)
            if found and line.rstrip().endswith("{"):
                name, current, entry = found.group(2), [line], found.group(2) if found.group(1) else entry
            continue
        current.append(line)
        if line.startswith("}"):
            lines[name], name = current, None
    return _Computations(lines, entry)


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if depth == 0:
            return i
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


class _Instruction(NamedTuple):
    name: str
    shape: str
    opcode: str
    operands: str  # the text between the opcode's parentheses
    attributes: str  # the text after them


def _instruction(line: str) -> _Instruction:
    name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        shape, rest = rest.split(" ", 1)
    start = rest.index("(")
    end = _closing(rest, start)
    return _Instruction(name.lstrip("%"), shape, rest[:start], rest[start + 1:end], rest[end + 1:])


def _drop(attributes: str, key: str) -> str:
    at = attributes.find(f", {key}={{")
    if at < 0:
        return attributes
    return attributes[:at] + attributes[_closing(attributes, attributes.index("{", at)) + 1:]


def _called(text: str, computations: _Computations, exclude: str = "") -> list[str]:
    return [c for c in re.findall(r"%([\w.\-]+)", text) if c in computations.lines and c != exclude]


def _closure(names: list[str], computations: _Computations) -> set[str]:
    seen, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack += _called("\n".join(computations.lines[name][1:]), computations, name)
    return seen


def _op_name(line: str) -> str:
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def _module_text(computations: _Computations, needed: set[str], entry: list[str]) -> str:
    body = [line for name, lines in computations.lines.items() if name in needed for line in lines]
    return "\n".join(["HloModule piece", "", *body, "", *entry])


def _branch_names(attributes: str) -> list[str]:
    listed = re.search(r"branch_computations=\{([^}]*)\}", attributes)
    if listed:
        return [b.strip().lstrip("%") for b in listed.group(1).split(",")]
    return [re.search(rf"{side}_computation=%([\w.\-]+)", attributes).group(1) for side in ("true", "false")]


def _costs(computations: _Computations, name: str, branch: BranchPolicy, cost: Callable[[str], Cost]
           ) -> list[tuple[str, Cost]]:
    """(op_name, cost) of each instruction of computation `name`, conditionals resolved by `branch`."""
    shapes: dict[str, str] = {}
    found: list[tuple[str, Cost]] = []
    for line in computations.lines[name][1:-1]:
        ins = _instruction(line)
        shapes[ins.name] = ins.shape
        if ins.opcode in _FREE:
            continue
        if ins.opcode == "conditional":
            options = []
            for b in _branch_names(ins.attributes):
                kernels = sum("\n".join(computations.lines[c]).count(KERNEL_CALL)
                              for c in _closure([b], computations))
                options.append(Branch(_costs(computations, b, branch, cost), kernels))
            found += options[branch(options)].costs
            continue
        attributes = ins.attributes
        for key in _DROPPED:
            attributes = _drop(attributes, key)
        operands = {o: i for i, o in enumerate(dict.fromkeys(re.findall(r"%([\w.\-]+)", ins.operands)))}
        args = re.sub(r"%([\w.\-]+)", lambda m, index=operands: f"%arg.{index[m.group(1)]}", ins.operands)
        entry = ["ENTRY %piece {", *(f"  %arg.{i} = {shapes[o]} parameter({i})" for i, o in enumerate(operands)),
                 f"  ROOT %{ins.name} = {ins.shape} {ins.opcode}({args}){attributes}", "}"]
        text = _module_text(computations, _closure(_called(attributes, computations), computations), entry)
        piece = cost(text)
        if ins.opcode == "fusion":
            piece = piece._replace(bytes_accessed=max(0.0, piece.bytes_accessed - _unread(attributes, computations)))
        found.append((_op_name(line), piece))
    return found


_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape as printed (`bf16[512,2048,128]{2,1,0}`, tuples summed); 8-bit floats count 1."""
    total = 0
    for dtype, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape):
        total += math.prod(int(d) for d in dims.split(",") if d) * _ITEM_BYTES.get(dtype, 1)
    return total


def _unread(attributes: str, computations: _Computations) -> float:
    """Bytes HloCostAnalysis charges a fusion for operands it only gathers from: a fused parameter read by
    gathers alone costs it the whole operand (the embedding table, a MoE layer's expert stack gathered by tile),
    where a gather reads its slices, as much as it outputs (XLA's own count for an unfused gather)."""
    called = re.search(r"calls=%([\w.\-]+)", attributes)
    if not called or called.group(1) not in computations.lines:
        return 0.0
    body = [_instruction(line) for line in computations.lines[called.group(1)][1:-1]]
    refers = lambda ins, name: re.search(rf"%{re.escape(name)}(?![\w.\-])", ins.operands)
    unread = 0.0
    for param in (ins for ins in body if ins.opcode == "parameter"):
        views, gathered, others = [param.name], 0, False  # a bitcast of the operand (a stacked layer's entry) is it
        while views and not others:
            name = views.pop()
            for user in (ins for ins in body if refers(ins, name)):
                if user.opcode == "bitcast":
                    views.append(user.name)
                elif user.opcode == "gather" and re.match(rf"\s*%{re.escape(name)}(?![\w.\-])", user.operands):
                    gathered += shape_bytes(user.shape)
                else:
                    others = True
        if gathered and not others:
            whole = shape_bytes(param.shape)
            unread += whole - min(whole, gathered)
    return unread


def hlo_costs(text: str, branch: BranchPolicy) -> list[tuple[str, Cost]]:
    """(op_name, cost) of each instruction of an HLO module's entry computation (its text, as
    `HloModule.to_string()` prints it), each costed by HloCostAnalysis as a module of its own, conditionals
    resolved to the branch `branch` picks (recursively; a while loop's body counts once, as XLA counts it)."""
    from jax._src.lib import xla_client  # noqa: PLC0415 - HLO text to a module, on any client

    client = jax.devices("cpu")[0].client
    computations = _computations(re.sub(r" stack_frame_id=\d+", "", text))
    return _costs(computations, computations.entry, branch,
                  lambda piece: _analysis(client, xla_client.hlo.hlo_module_from_text(piece)))


def xla_costs(compiled: jax.stages.Compiled, branch: BranchPolicy) -> list[tuple[str, Cost]]:
    """`hlo_costs` of each of a compiled program's optimised modules (one device's)."""
    return [found for module in compiled.runtime_executable().hlo_modules()
            for found in hlo_costs(module.to_string(), branch)]

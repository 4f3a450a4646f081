"""The deviceless compile check without the CUDA plugin: reading ptxas and XLA's dumps into per-kernel records,
and the pass/fail rule. The fixtures are real output of `pallas_kernels.aot` compiling the f32 GDN prefill
for an H200 (state_block_v 16, output_block_v 16, 8 warps, 1 stage), with the serialized Triton IR left out
of the HLO lines. Compiling itself needs the CUDA venv: `benchmarks/aot_kernels.py --quick` (docs/kernels.md)."""

import importlib
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from pallas_kernels import aot, tuning
from pallas_kernels.gdn import pallas as gdn_pallas

FIXTURES = Path(__file__).parents[1] / "fixtures" / "aot"
INTRA, STATE, OUTPUT = ("gdn_prefill_intra_chunk_chunk_size_64", "gdn_prefill_state_pass_block_v_16_chunk_size_64",
                        "gdn_prefill_output_block_v_16_chunk_size_64")


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_ptxas_output_gives_registers_spills_and_stack_per_kernel():
    info = aot.parse_ptxas(_read("ptxas_v.txt"))
    assert info[STATE] == dict(stack=296, spill_stores=340, spill_loads=372, registers=255)
    assert info[INTRA] == dict(stack=7544, spill_stores=17076, spill_loads=22620, registers=32)
    assert info["wrapped_iota"] == dict(stack=0, spill_stores=0, spill_loads=0, registers=8)


def test_thunk_sequence_gives_each_launch_its_grid_threads_and_shared_memory():
    launches = aot.parse_thunks(_read("thunk_sequence.txt"))
    assert launches[INTRA] == dict(grid=(129, 32, 1), threads=256, shared_memory=43008)
    assert launches[STATE] == dict(grid=(1, 32, 8), threads=256, shared_memory=36864)
    assert launches["loop_compare_fusion"] == dict(grid=(1, 1, 1), threads=1, shared_memory=0)  # inside a while


def test_only_pallas_calls_are_checked_not_xla_triton_fusions():
    hlo = _read("after_optimizations_excerpt.txt")
    assert "triton_softmax" in hlo  # XLA's own Triton fusion is in the excerpt...
    assert aot.pallas_kernels(hlo) == [INTRA, STATE, OUTPUT]  # ...and is not ours


def test_records_join_ptxas_and_launch_and_fail_on_spills():
    names = aot.pallas_kernels(_read("after_optimizations_excerpt.txt"))
    found = aot.records(names, aot.parse_ptxas(_read("ptxas_v.txt")), aot.parse_thunks(_read("thunk_sequence.txt")))
    state = next(r for r in found if r.name == STATE)
    assert state == aot.KernelRecord(STATE, registers=255, spill_stores=340, spill_loads=372, stack=296,
                                     shared_memory=36864, threads=256, grid=(1, 32, 8))
    assert state.problems() == ["spills 340 B stores / 372 B loads"]
    assert all(r.problems() for r in found)


CLEAN = aot.KernelRecord("k", registers=255, spill_stores=0, spill_loads=0, stack=0, shared_memory=232_448,
                         threads=256, grid=(1, 1, 1))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (dict(spill_stores=4), "spills 4 B stores"),
        (dict(spill_loads=4), "spills 0 B stores / 4 B loads"),
        (dict(registers=256), "256 registers > 255"),
        (dict(threads=512), "255 registers x 512 threads > 65536"),
        (dict(shared_memory=232_449), "shared memory 232449 B > 232448"),
    ],
)
def test_a_kernel_fails_on_spills_too_many_registers_or_too_much_shared_memory(change, problem):
    assert CLEAN.problems() == []  # at every limit, not over it
    assert any(p.startswith(problem) for p in CLEAN._replace(**change).problems())


def test_the_sweep_drops_candidates_failing_the_compile_check_before_timing_them(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    tune_kernels = importlib.import_module("tune_kernels")
    defaults = tuning.defaults(gdn_pallas.gdn_decode, "block_v", "num_warps", "num_stages")

    def block_v() -> int:  # the candidate being tried
        return tuning.launch("gdn_decode", "K128.V128", defaults)["block_v"]

    # as if block_v 64 spilled on this GPU
    monkeypatch.setattr(aot, "compile_kernels", lambda fn, specs, target: [CLEAN._replace(
        spill_stores=4 * (block_v() == 64))])
    timed = []
    case = SimpleNamespace(call=lambda backend: lambda: timed.append(block_v()) or jnp.zeros(()))
    best, _, dropped = tune_kernels.sweep(case, "gdn_decode", "pallas", 1, SimpleNamespace(fn=None, specs=()))
    assert dropped == 6  # block_v 64 x 3 warp counts x 2 stage counts
    assert set(timed) == {16, 32} and best["block_v"] in (16, 32)

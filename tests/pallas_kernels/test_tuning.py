"""Launch parameters: an op's defaults, the sweep's recorded choice for its shape class, a sweep's override."""

import functools

import jax.numpy as jnp
import pytest
import yaml

from pallas_kernels import tuning
from pallas_kernels.mamba2 import pallas_prefill, ssd_prefill
from pallas_kernels.tiles import check_dot_sides, dividing_tile

DEFAULTS = dict(block_v=64, num_warps=4)


def test_device_file_names_the_device_kind():
    assert tuning.device_file("NVIDIA H200") == "nvidia_h200.yaml"


def test_a_device_without_a_recorded_sweep_gets_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXHYBRID_KERNEL_CONFIGS", str(tmp_path))
    assert tuning.recorded("NVIDIA H100") == {}
    assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == DEFAULTS  # CPU: nothing recorded


def test_the_recorded_choice_applies_to_its_shape_class_only(tmp_path, monkeypatch):
    (tmp_path / "nvidia_h200.yaml").write_text(yaml.safe_dump({"gdn_decode": {"K128.V128": {"block_v": 32}}}))
    monkeypatch.setenv("JAXHYBRID_KERNEL_CONFIGS", str(tmp_path))
    monkeypatch.setattr(tuning, "_device_kind", lambda: "NVIDIA H200")
    assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == dict(block_v=32, num_warps=4)
    assert tuning.launch("gdn_decode", "K64.V64", DEFAULTS) == DEFAULTS
    assert tuning.asked["gdn_decode"] == "K64.V64"


def test_a_prefill_records_its_choice_per_activation_dtype(tmp_path, monkeypatch):
    """The prefills' tiles depend on the dtype (f32's 3xTF32 dots need shorter tiles): a bf16 sweep's choice must
    not reach f32."""
    recorded = {"ssd_prefill": {"P64.N128.bfloat16": {"block_t": 32}}}
    (tmp_path / "nvidia_h200.yaml").write_text(yaml.safe_dump(recorded))
    monkeypatch.setenv("JAXHYBRID_KERNEL_CONFIGS", str(tmp_path))
    chosen = {}

    @functools.wraps(pallas_prefill.ssd_prefill)  # the launcher's signature holds the defaults
    def launcher(*args, **launch):
        chosen.update(launch)

    monkeypatch.setattr(pallas_prefill, "ssd_prefill", launcher)
    pool = jnp.zeros((2, 1, 64, 128), jnp.float32)
    with tuning.compiling_for("NVIDIA H200"):
        for dtype in (jnp.bfloat16, jnp.float32):
            tokens = jnp.zeros((4, 1, 64), dtype), jnp.zeros((4, 1, 128), dtype)
            ssd_prefill(tokens[0], jnp.zeros((4, 1)), jnp.zeros(1), tokens[1], tokens[1], jnp.zeros(1),
                        jnp.array([0, 4]), pool, jnp.array([1]), jnp.array([False]), backend="pallas")
            assert (tuning.asked["ssd_prefill"], chosen["block_t"]) == (
                f"P64.N128.{jnp.dtype(dtype)}", 32 if dtype == jnp.bfloat16 else None)


def test_compiling_for_a_gpu_reads_its_table_on_a_host_without_one(tmp_path, monkeypatch):
    """A deviceless compile for an H200 must build what the H200 would run: its recorded choice."""
    (tmp_path / "nvidia_h200.yaml").write_text(yaml.safe_dump({"gdn_decode": {"K128.V128": {"block_v": 32}}}))
    monkeypatch.setenv("JAXHYBRID_KERNEL_CONFIGS", str(tmp_path))
    assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == DEFAULTS  # this CPU host
    with tuning.compiling_for("NVIDIA H200"):
        assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == dict(block_v=32, num_warps=4)
    assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == DEFAULTS


def test_override_wins_inside_its_block_and_is_undone():
    with tuning.override("gdn_decode", num_warps=8):
        assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == dict(block_v=64, num_warps=8)
    assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == DEFAULTS


def test_an_unknown_parameter_is_an_error_naming_it():
    with tuning.override("gdn_decode", block_k=16), pytest.raises(ValueError, match="block_k"):
        tuning.launch("gdn_decode", "K128.V128", DEFAULTS)


def test_a_stale_recorded_parameter_is_ignored_not_fatal(tmp_path, monkeypatch, caplog):
    table = {"gdn_decode": {"K128.V128": {"block_v": 16, "block_k": 32}}}  # block_k: from an older kernel
    (tmp_path / "nvidia_h200.yaml").write_text(yaml.safe_dump(table))
    monkeypatch.setenv("JAXHYBRID_KERNEL_CONFIGS", str(tmp_path))
    monkeypatch.setattr(tuning, "_device_kind", lambda: "NVIDIA H200")
    assert tuning.launch("gdn_decode", "K128.V128", DEFAULTS) == dict(block_v=16, num_warps=4)
    assert "block_k" in caplog.text


def test_tiles_shrink_to_a_power_of_two_dividing_the_size():
    assert dividing_tile(96, 64, "block_v") == 32
    assert dividing_tile(192, 128, "block_d") == 64
    assert dividing_tile(128, 32, "block_v") == 32
    with pytest.raises(ValueError, match="block_v=48"):
        dividing_tile(96, 48, "block_v")


def test_dots_below_sixteen_fail_before_triton_does():
    check_dot_sides(True, block_size=8)  # interpret mode runs any size
    with pytest.raises(ValueError, match="block_size"):
        check_dot_sides(False, block_size=8, head_dim=128)

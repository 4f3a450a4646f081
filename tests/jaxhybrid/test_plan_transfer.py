"""A BatchPlan reaches the device in one transfer and comes back as the plan's own fields, per bucket."""

import functools

import jax
import numpy as np
import pytest

from jaxhybrid.models.plan_transfer import DevicePlan, pack_plan, unpack_plan
from scheduler import SequenceSpec, StopParams
from tests.scheduler.helpers import Driver, make_config


@pytest.mark.parametrize("row_data_bytes, k", [(32, 2), (3, 0), (0, 1)])
def test_every_device_field_survives_one_packed_transfer(row_data_bytes, k):
    driver = Driver(make_config(num_spec_tokens=k, row_data_bytes=row_data_bytes, max_num_batched_tokens=64))
    rng = np.random.default_rng(0)
    for i in range(3):
        data = rng.integers(0, 256, row_data_bytes, dtype=np.uint8).tobytes()
        driver.add(SequenceSpec(f"r{i}", tuple(range(1 + i, 40 + 7 * i)), StopParams(max_tokens=5), row_data=data))
    unpack = jax.jit(functools.partial(unpack_plan, row_data_bytes=row_data_bytes), static_argnums=1)
    layouts = set()
    for _ in range(6):
        plan = driver.step(accepted=k)
        buffer, layout = pack_plan(plan)
        layouts.add(layout)
        device = unpack(jax.device_put(buffer), layout)
        for name in DevicePlan._fields:
            want = np.asarray(getattr(plan, name))
            got = np.asarray(getattr(device, name))
            assert got.dtype == want.dtype or name.startswith("num_"), name
            np.testing.assert_array_equal(got, want, err_msg=name)
    assert unpack._cache_size() == len(layouts) < 6  # one compilation per bucket, not per plan

"""What the CPU FFI kernel tests share: the library must build (a failure under CI, where g++ is; a skip where
no compiler is), and the ReplaySSM materialize the kernels lack (the reference's)."""

import os

import pytest

from pallas_kernels import cpu_ffi


@pytest.fixture(scope="module")
def kernels():
    if not cpu_ffi.available():
        message = f"the CPU FFI kernels cannot be built here: {cpu_ffi.unavailable_reason()}"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)

"""Beyond one device: tensor parallelism over a JAX mesh (`tensor_parallel`), across hosts (`multihost`)."""

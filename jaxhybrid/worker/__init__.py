"""The runner: pools on device, one jitted step per bucket, the plan's transfer to every host."""

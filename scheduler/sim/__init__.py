"""Test support, not the runtime: a fake device, the scheduler's invariants, a randomized simulator and its CLI
(`python -m scheduler.sim.simulate`)."""

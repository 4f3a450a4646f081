"""The model: config, weights in and out, the Flax layers on pools, and their tensor-parallel layout."""

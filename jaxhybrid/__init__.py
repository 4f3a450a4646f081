"""jaxhybrid: a PyTorch-free JAX inference engine for hybrid GDN / Mamba2 / attention language models."""

from jaxhybrid.config import ConfigError, ModelConfig, load_config, parse_hf_config
from jaxhybrid.model import Model, init_params
from jaxhybrid.weights import CheckpointError, load_model, restore_params, save_params

__all__ = [
    "CheckpointError", "ConfigError", "Model", "ModelConfig", "init_params", "load_config", "load_model",
    "parse_hf_config", "restore_params", "save_params",
]

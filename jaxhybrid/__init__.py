"""jaxhybrid: a PyTorch-free JAX inference engine for hybrid GDN / Mamba2 / attention language models."""

from jaxhybrid.api import LLM
from jaxhybrid.config import ConfigError, ModelConfig, load_config, parse_hf_config
from jaxhybrid.model import Model, init_params
from jaxhybrid.outputs import CompletionOutput, RequestOutput
from jaxhybrid.sampling_params import SamplingParams
from jaxhybrid.weights import CheckpointError, load_model, restore_params, save_params

__all__ = [
    "LLM", "CheckpointError", "CompletionOutput", "ConfigError", "Model", "ModelConfig", "RequestOutput",
    "SamplingParams", "init_params", "load_config", "load_model", "parse_hf_config", "restore_params", "save_params",
]

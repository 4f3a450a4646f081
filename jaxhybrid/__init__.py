"""jaxhybrid: a PyTorch-free JAX inference engine for hybrid GDN / Mamba2 / attention language models."""

from jaxhybrid.engine.outputs import CompletionOutput, RequestOutput
from jaxhybrid.llm import LLM
from jaxhybrid.models.config import ConfigError, ModelConfig
from jaxhybrid.models.hf_config import load_config, parse_hf_config
from jaxhybrid.models.model import Model, init_params
from jaxhybrid.models.weights import CheckpointError, load_model, restore_params, save_params
from jaxhybrid.sample.params import SamplingParams

__all__ = [
    "LLM", "CheckpointError", "CompletionOutput", "ConfigError", "Model", "ModelConfig", "RequestOutput",
    "SamplingParams", "init_params", "load_config", "load_model", "parse_hf_config", "restore_params", "save_params",
]

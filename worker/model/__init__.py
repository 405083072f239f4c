"""Llama-family model for the worker: config, torch implementation, checkpoint loader, built-in tiny."""

from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.loader import LoadedModel, load_model

__all__ = ["LlamaForCausalLM", "LoadedModel", "ModelConfig", "load_model"]

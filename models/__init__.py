"""Flax NNX Transformers with logical axis names, their train step, and presets."""

from models.config import PRESETS, ModelConfig, preset
from models.train import (
    TrainProgram,
    TrainSettings,
    build_train_program,
    loss_fn,
    make_model,
    make_optimizer,
    make_train_step,
    per_device_bytes,
)
from models.transformer import REMAT_POLICIES, Transformer, logical_axes

__all__ = [
    "PRESETS",
    "REMAT_POLICIES",
    "ModelConfig",
    "TrainProgram",
    "TrainSettings",
    "Transformer",
    "build_train_program",
    "logical_axes",
    "loss_fn",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "per_device_bytes",
    "preset",
]

"""trainer: a lean layer-streaming trainer for Hugging Face causal LMs on top of tierstore."""

from trainer.api import Trainer, TrainerState, TrainOutput, init, load_model
from trainer.args import TrainingArguments
from trainer.model import UnsupportedModelError, decompose

__all__ = [
    "Trainer",
    "TrainerState",
    "TrainOutput",
    "TrainingArguments",
    "UnsupportedModelError",
    "decompose",
    "init",
    "load_model",
]

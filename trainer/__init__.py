"""trainer: a lean layer-streaming trainer for Hugging Face causal LMs on top of tierstore."""

from trainer.api import Trainer, TrainOutput
from trainer.args import TrainingArguments
from trainer.callbacks import TrainerCallback, TrainerControl, TrainerState
from trainer.generate import generate
from trainer.model import UnsupportedModelError, decompose
from trainer.session import init, load_model

__all__ = [
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainOutput",
    "TrainingArguments",
    "UnsupportedModelError",
    "decompose",
    "generate",
    "init",
    "load_model",
]

"""8-bit block-wise optimizers."""
from .adagrad import Adagrad8bitBlock
from .adam import Adam8bitBlock, AdamW8bitBlock
from .base import Optimizer8bitBlock
from .lamb import LAMB8bitBlock
from .lars import LARS8bitBlock
from .lion import Lion8bitBlock
from .momentum import Momentum8bitBlock
from .rmsprop import RMSprop8bitBlock

__all__ = [
    "Optimizer8bitBlock",
    "Adam8bitBlock",
    "AdamW8bitBlock",
    "Momentum8bitBlock",
    "RMSprop8bitBlock",
    "Adagrad8bitBlock",
    "LAMB8bitBlock",
    "LARS8bitBlock",
    "Lion8bitBlock",
]

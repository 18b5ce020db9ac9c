"""8-bit block-wise optimizers."""
from .adam import Adam8bitBlock, AdamW8bitBlock
from .base import Optimizer8bitBlock
from .momentum import Momentum8bitBlock

__all__ = ["Optimizer8bitBlock", "Adam8bitBlock", "AdamW8bitBlock", "Momentum8bitBlock"]

"""ds_q8: 8-bit optimizers via block-wise quantization, as a DeepSpeed extension."""
from . import functional
from .functional import create_dynamic_map, dequantize_blockwise, quantize_blockwise
from .groups import param_groups
from .nn import StableEmbedding
from .optim import (Adagrad8bitBlock, Adam8bitBlock, AdamW8bitBlock, LAMB8bitBlock, LARS8bitBlock, Lion8bitBlock,
                    Momentum8bitBlock, Optimizer8bitBlock, RMSprop8bitBlock)
from .registry import OPTIMIZERS, register_with_deepspeed

__version__ = "0.1.0"

register_with_deepspeed()

__all__ = [
    "functional",
    "create_dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    "StableEmbedding",
    "param_groups",
    "Optimizer8bitBlock",
    "Adam8bitBlock",
    "AdamW8bitBlock",
    "Momentum8bitBlock",
    "RMSprop8bitBlock",
    "Adagrad8bitBlock",
    "LAMB8bitBlock",
    "LARS8bitBlock",
    "Lion8bitBlock",
    "OPTIMIZERS",
    "register_with_deepspeed",
]

"""ds_q8: 8-bit optimizers via block-wise quantization, as a DeepSpeed extension."""
from . import functional
from .functional import create_dynamic_map
# the compiled kernels where they load, the reference (ds_q8.functional) otherwise
from .ops import dequantize_blockwise, quantize_blockwise
from .groups import param_groups
from . import embeddings
from .nn import StableEmbedding
from . import optim
from .optim import *  # noqa: F401,F403  (every optimizer class, listed in optim.__all__)
from .integration.contract import DeepSpeedContractError
from . import registry
from .registry import OPTIMIZERS, register_with_deepspeed

__version__ = "0.4.0"

registry.connect()  # no DeepSpeed import: see ds_q8.integration.entry
embeddings.install_hook()  # embedding parameters, of models alive now or built later, are marked: 32-bit state by default
# before any process group exists: torch's collectives must not capture the world group (see the module)
from .integration.process_groups import bind_collective_defaults_early as _bind_early

_bind_early()
del _bind_early

__all__ = [
    "functional",
    "create_dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    "StableEmbedding",
    "param_groups",
    "OPTIMIZERS",
    "register_with_deepspeed",
    "DeepSpeedContractError",
] + list(optim.__all__)

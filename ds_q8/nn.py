"""StableEmbedding: an embedding that keeps language-model training with 8-bit state stable."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .optim.base import OPTIM_BITS_ATTR


class StableEmbedding(nn.Embedding):
    """Drop-in for ``nn.Embedding``: Xavier-uniform init, LayerNorm on the output, 32-bit state.

    Its weight and LayerNorm parameters carry ``ds_q8_optim_bits = 32`` so ds_q8 optimizers keep
    fp32 state for them, at every ZeRO stage (``ds_q8.param_groups`` also puts them in a group
    with ``optim_bits=32``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, max_norm=None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight=None, device=None, dtype=None):
        if sparse:
            raise ValueError("StableEmbedding does not support sparse=True: 8-bit optimizers need dense gradients")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight, device=device, dtype=dtype)
        self.norm = nn.LayerNorm(embedding_dim, device=device, dtype=dtype)
        for p in (self.weight, self.norm.weight, self.norm.bias):
            setattr(p, OPTIM_BITS_ATTR, 32)

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return self.norm(emb)

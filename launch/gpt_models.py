"""GPT-2 models by size name, always built from a config (never downloaded)."""
from __future__ import annotations

from typing import Optional

import torch

#: name -> (n_layer, n_head, n_embd); the four GPT-2 sizes plus one a 2-core CPU trains in minutes
SIZES = {
    "tiny": (4, 4, 128),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
GPT2_VOCAB_SIZE = 50257
GPT2_CONTEXT = 1024


def gpt2_config(model: str, vocab_size: int, context: int, n_layer: Optional[int] = None,
                dropout: float = 0.0):
    if model not in SIZES:
        raise ValueError(f"--model must be one of {sorted(SIZES)}, got {model!r}")
    layers, heads, width = SIZES[model]
    if n_layer is not None:
        if n_layer < 1:
            raise ValueError(f"--n_layer must be >= 1, got {n_layer}")
        layers = n_layer
    return gpt2_config_of(layers, heads, width, vocab_size, context, dropout)


def gpt2_config_of(n_layer: int, n_head: int, n_embd: int, vocab_size: int, context: int, dropout: float = 0.0):
    """A GPT-2 config of any shape, tied input and output embeddings, token 0 as BOS/EOS."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)


def build_model(config, stable_embedding: bool = False, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """GPT2LMHeadModel with fresh weights; optionally a StableEmbedding for the tokens.

    ``dtype`` (e.g. bf16 for a bf16 DeepSpeed config) creates the weights in that dtype directly: a
    1.5B model then never holds an fp32 copy (6 GB) on its way to bf16 (3 GB).
    The LM head stays tied to the token embedding, so with a StableEmbedding the head reads the
    same Xavier-initialised weight the embedding uses.
    """
    from transformers import AutoModelForCausalLM
    import ds_q8

    model = AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype is not None else \
        AutoModelForCausalLM.from_config(config)
    if stable_embedding:
        old = model.transformer.wte
        model.transformer.wte = ds_q8.StableEmbedding(old.num_embeddings, old.embedding_dim, dtype=dtype)
        model.tie_weights()
        if model.lm_head.weight is not model.transformer.wte.weight:
            raise RuntimeError("LM head did not tie to the StableEmbedding weight")
    return model


def count_params_on_meta(config) -> int:
    """Parameter count of the model ``config`` describes, without allocating its weights."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return sum(p.numel() for p in model.parameters())

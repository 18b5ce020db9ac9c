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


#: what compute_in_fp32 passes through uncast: writes into a tensor (a cast copy would take the write),
#: attribute reads (``.dtype``, ``.shape``: nothing to compute, and a cast would copy the weight to read them),
#: data movement and views
_NOT_CAST = frozenset({"__setitem__", "__delitem__", "__set__", "__get__", "__iadd__", "__isub__", "__imul__",
                       "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__",
                       "__ixor__", "__ilshift__", "__irshift__",
                       # data movement and views compute nothing: their result stays bf16 and is cast where it is
                       # computed with. ZeRO-3 makes a parameter's weight available by such reads of its bf16
                       # partition (``param.data = ds_tensor.data.to(device).view(shape)``) inside the forward;
                       # cast there, the parameter itself would turn fp32 until its next gather
                       "to", "view", "view_as", "reshape", "reshape_as", "narrow", "as_strided", "flatten",
                       "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "permute", "transpose", "t",
                       "contiguous", "detach", "clone", "split", "chunk", "unbind", "select", "cpu", "cuda",
                       "pin_memory"})


def compute_in_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model``'s forward (and so its backward) in fp32 while its weights stay bf16.

    For bf16 training on a CPU without native bf16 matrix products, where torch takes a generic path many
    times slower than fp32 (launch/cpu_probe.py measures it). Every bf16 tensor an operation inside the
    forward reads is cast to fp32 first, so activations and products are fp32; autograd casts each weight's
    gradient back to the weight's dtype, so DeepSpeed still receives bf16 gradients and keeps bf16 masters,
    and the optimizer steps them as after a bf16 forward. Each gradient is the fp32 gradient rounded to bf16
    once. Writes (in-place operations, ``out=``), attribute reads, data movement and views pass through
    uncast (:data:`_NOT_CAST`).
    Returns ``model``, changed in place.
    """
    import functools

    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    class ReadAsFp32(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            # one fp32 copy of each bf16 tensor a forward reads: a weight read twice (the tied embedding and
            # LM head) then gets one gradient, summed in fp32 and rounded to bf16 once, as every other weight
            self.copies = {}

        def upcast(self, x):
            if not (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16):
                return x
            hit = self.copies.get(id(x))  # the tensor is held: its id is not reused while the forward runs
            if hit is None or hit[0] is not x or hit[1] != x._version:
                hit = self.copies[id(x)] = (x, x._version, x.float())
            return hit[2]

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            writes = name.endswith("_") and not name.endswith("__")
            if not writes and name not in _NOT_CAST and "out" not in kwargs:
                args, kwargs = tree_map(self.upcast, args), tree_map(self.upcast, kwargs)
            return func(*args, **kwargs)

    forward = model.forward

    @functools.wraps(forward)
    def fp32_forward(*args, **kwargs):
        with ReadAsFp32():
            return forward(*args, **kwargs)

    model.forward = fp32_forward
    return model


def native_bf16(device: str = "cpu") -> Optional[bool]:
    """Whether bf16 matrix products run natively on ``device``: on a CPU, whether torch sends them to oneDNN
    (AVX-512 with bf16 support, or AMX; not AVX2, where they take a generic path many times slower than fp32);
    on CUDA, whether the GPU has bf16. None when torch does not say (the CPU check is an internal op of torch's)."""
    if device != "cpu":
        return bool(torch.cuda.is_bf16_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def bf16_compute(choice: str, device: str = "cpu") -> str:
    """What a bf16 run's forward and backward compute in for ``--compute choice``: ``bf16`` or ``fp32``
    (:func:`compute_in_fp32`); ``auto`` is fp32 where :func:`native_bf16` says no, else bf16."""
    if choice not in ("auto", "bf16", "fp32"):
        raise ValueError(f"--compute must be auto, bf16 or fp32, got {choice!r}")
    if choice != "auto":
        return choice
    return "fp32" if native_bf16(device) is False else "bf16"

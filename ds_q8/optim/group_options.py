"""The options every ds_q8 group has, in one place: their defaults (:data:`OPTIONS`, and a class's own
through ``option_defaults``: :func:`class_options`), their checks (:func:`check_common_group`) and how the
step reads them: which code steps a group (``impl``), how its
16-bit parameters are written (stochastic rounding or a correction byte), how its states are
requantized, and its states' maps."""
from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from .. import functional as F
from .state_keys import CORRECTION_KEY
from .checks import check_range
from .rules import Rule

if TYPE_CHECKING:  # pieces.py imports nothing of this module; the name is for the annotation
    from .pieces import TensorStep

#: the options every ds_q8 optimizer takes, with their defaults (``nonfinite`` is the optimizer's,
#: the others are each group's)
OPTIONS = dict(block_size=F.DEFAULT_BLOCK_SIZE, min_8bit_size=F.DEFAULT_MIN_8BIT_SIZE, optim_bits=8,
               quantization="minifloat", stochastic_rounding=None, sr_seed=0, state_rounding="guided",
               correction_byte=False, impl="auto", embeddings_32bit=True, nonfinite="skip")
QUANTIZATIONS = ("dynamic", "dynamic6", "minifloat", "linear")
#: how the states are requantized after each step: every state guided (stochastically while the value
#: stays next to its old code, where nearest could stall it, else to nearest), every state stochastically, only the unsigned
#: ones (second moments, Adagrad's sum; first moments to nearest), or every state to nearest
STATE_ROUNDINGS = ("guided", "stochastic", "stochastic_unsigned", "nearest")
#: how one state is requantized, as the kernels take it (``Q8_ROUND_*`` in csrc/includes/q8_common.h; 2,
#: guidance by the update, was a study's and is no longer taken)
ROUND_NEAREST, ROUND_STOCHASTIC, ROUND_BY_OLD_CODE = 0, 1, 3
IMPLS = ("auto", "kernel", "reference")  # optim/path_kernel.py decides by it


def class_options(cls) -> dict:
    """The options of optimizer class ``cls`` with its defaults: :data:`OPTIONS`, updated by the class's
    ``option_defaults`` (those of its bases first)."""
    options = dict(OPTIONS)
    for base in reversed(cls.__mro__):
        options.update(base.__dict__.get("option_defaults", {}))
    return options


def with_options(cls) -> None:
    """Check a class's ``option_defaults`` and spell its constructor's ``**options`` out as keyword options
    with the class's defaults, so that ``inspect.signature``, help() and the check of DeepSpeed's JSON keys
    see every option and its default."""
    unknown = sorted(set(cls.__dict__.get("option_defaults", {})) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{cls.__name__}.option_defaults names unknown option(s) {unknown}; "
                        f"valid: {', '.join(OPTIONS)}")
    init = cls.__dict__.get("__init__")
    if init is None:
        return
    sig = inspect.signature(init)
    own = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    if len(own) == len(sig.parameters):  # no **options
        return
    names = {p.name for p in own}
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in class_options(cls).items()
             if k not in names]
    init.__signature__ = sig.replace(parameters=own + extra)


def check_common_group(group: dict) -> None:
    """The settings every ds_q8 group has: lr, block_size, min_8bit_size, optim_bits, quantization,
    stochastic rounding of parameters and of states, impl and embeddings_32bit (which tensors keep fp32
    state is decided in ``tensor_states.uses_8bit``)."""
    check_range("lr", group["lr"], 0.0, math.inf)
    if group["block_size"] is not None:
        try:
            F.check_block_size(group["block_size"])
        except ValueError:
            raise ValueError(
                f"block_size must be a power of two in [{F.MIN_BLOCK_SIZE}, {F.MAX_BLOCK_SIZE}] "
                f"or None (one block per tensor), got {group['block_size']!r}"
            ) from None
    mbs = group["min_8bit_size"]
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 0:
        raise ValueError(f"min_8bit_size must be an integer >= 0, got {mbs!r}")
    if group["optim_bits"] not in (4, 8, 32) or isinstance(group["optim_bits"], bool):
        raise ValueError(f"optim_bits must be 4, 8 or 32, got {group['optim_bits']!r}")
    if group["quantization"] not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {group['quantization']!r}")
    if not (group["stochastic_rounding"] is None or isinstance(group["stochastic_rounding"], bool)):
        raise ValueError("stochastic_rounding must be true, false or null (on for bf16/fp16 parameters), "
                         f"got {group['stochastic_rounding']!r}")
    correction = group.get("correction_byte", False)
    if not isinstance(correction, bool):
        raise ValueError(f"correction_byte must be true or false (an int8 of each bf16 parameter's rounding residue: "
                         f"24-bit masters), got {correction!r}")
    if correction and group["stochastic_rounding"] is True:
        raise ValueError("correction_byte=true keeps what rounding to bf16 drops and writes bf16 parameters to "
                         "nearest; it cannot be combined with stochastic_rounding=true (leave stochastic_rounding "
                         "null or false)")
    if group.get("state_rounding", OPTIONS["state_rounding"]) not in STATE_ROUNDINGS:
        raise ValueError(f"state_rounding must be one of {STATE_ROUNDINGS} (how the states are requantized: guided, "
                         f"to the nearer code except next to the old one, where that could stall a state; every state right on average; only "
                         f"the second moments; or every state to the nearest code), "
                         f"got {group.get('state_rounding')!r}")
    impl = group.get("impl", "auto")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (kernels with the reference as fallback, kernels or an error, "
                         f"the reference only), got {impl!r}")
    seed = group["sr_seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"sr_seed must be an integer in [0, 4294967295], got {seed!r}")
    embeddings = group.get("embeddings_32bit", False)
    if not isinstance(embeddings, bool):
        raise ValueError("embeddings_32bit must be true or false (true: the parameters of nn.Embedding modules keep "
                         f"32-bit state; false: the group's optim_bits), got {embeddings!r}")


#: the rules whose states ``optim_bits=4`` can hold: Adam's first and second moment (``format4.py``)
FOUR_BIT_RULES = ("adam", "adamw")


def check_four_bit(group: dict, rule: Rule, owner: str) -> None:
    """What ``optim_bits=4`` asks of a group: a rule with Adam's two moments and its own maps."""
    if group["optim_bits"] != 4:
        return
    if rule.name not in FOUR_BIT_RULES:
        raise ValueError(f"optim_bits=4 stores Adam's two moments; {owner} runs the {rule.name!r} rule for this group: "
                         "use optim_bits 8 or 32 (4 bits is for Adam8bitBlock and AdamW8bitBlock)")
    if group["quantization"] not in ("minifloat", "dynamic6", "dynamic"):
        raise ValueError(f"optim_bits=4 has maps of its own (format4.py); quantization must stay 'minifloat' (the "
                         f"default), 'dynamic6' or 'dynamic', got {group['quantization']!r}")


def group_impl(group: dict) -> str:
    """A group's ``impl`` (groups saved before the option existed are ``"auto"``)."""
    return group.get("impl", "auto")


def corrected(group: dict, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` keeps a correction byte (``correction_byte=True``, bf16 only):
    then it is written to nearest as a 24-bit value (``rounding.split_bf16``), never stochastically."""
    return dtype == torch.bfloat16 and bool(group.get("correction_byte", False))


def correction_of(t: "TensorStep") -> Optional[torch.Tensor]:
    """The flat correction bytes of a tensor step, or None."""
    if not corrected(t.group, t.param.dtype):
        return None
    c = t.state.entry.get(CORRECTION_KEY)
    if c is None:
        raise RuntimeError("correction_byte=True but the tensor's state has no correction bytes")
    return c.view(-1)


def stochastic_params(group: dict, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` is written with stochastic rounding (on by default for 16-bit,
    off where a correction byte keeps what rounding drops)."""
    if dtype not in (torch.bfloat16, torch.float16) or corrected(group, dtype):
        return False
    choice = group.get("stochastic_rounding")
    return True if choice is None else bool(choice)


def rounding_modes(group: dict, signed: Sequence[bool]) -> tuple:
    """How each state is requantized (:data:`ROUND_NEAREST`, :data:`ROUND_STOCHASTIC` or
    :data:`ROUND_BY_OLD_CODE`; true where random bits are drawn): every state stochastically
    (``state_rounding="stochastic"``), every state guided by its old code (``"guided"``), the unsigned
    ones only stochastically (second moments, Adagrad's sum: ``"stochastic_unsigned"``), or none
    (``"nearest"``).

    Rounded to nearest, an exponential average that moves by less than half a code per step loses
    those moves. A second moment (beta2 = 0.999 moves it by 0.1% a step) then lags its fp32 value, by
    half on a GPT-2 attention matrix after 300 steps, and the steps grow by as much as 1.6x. A first
    moment (beta1 = 0.9) lags a gradient that grows by less than about a third of itself a step, as
    the weights that leave a plateau see theirs do, so they leave it later. Rounded stochastically,
    each is right on average, at the price of noise on every element at every step; guided rounding
    draws only while the value is next to its old code, where nearest could stall it."""
    choice = group.get("state_rounding", OPTIONS["state_rounding"])
    if choice == "stochastic":
        return (ROUND_STOCHASTIC,) * len(signed)
    if choice == "guided":
        return (ROUND_BY_OLD_CODE,) * len(signed)
    if choice == "stochastic_unsigned":
        return tuple(ROUND_NEAREST if s else ROUND_STOCHASTIC for s in signed)
    return (ROUND_NEAREST,) * len(signed)


def maps_of(rule: Rule, group: dict, device) -> List[torch.Tensor]:
    return [F.state_map(group["quantization"], s, device) for s in rule.state_signed]

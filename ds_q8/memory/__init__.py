"""Memory of training with ds_q8, predicted and measured: the ``predict*`` modules compute from parameter
sizes what a rank holds (``predict_state``: the optimizer state, ``predict``: the whole model states of
each rung of the ladder and the command, ``predict_offload``: host and device under ZeRO-Offload); the
``measure*`` modules count it on a live DeepSpeed engine (``measure``: model and optimizer states,
``measure_offload``: the host side of ZeRO-Offload), to check the predictions.

``python -m ds_q8.memory`` prints the predictions (``predict.main``). The predictions' names are
importable from here; the measurements, which need a live engine, from their modules.
"""
from .predict import (LADDER, LADDER_BITS, MODEL_STATE_PARTS, PER_GROUP_SPLITS, gpt2_muon_groups,  # noqa: F401
                      gpt2_param_groups, ladder_table, main, predict_model_states, report)
from .predict_state import (estimate_state_bytes, rank_layout, rank_segments, state_tensor_sizes,  # noqa: F401
                            tensor_state_bytes)

"""ds_q8 reaches into DeepSpeed where DeepSpeed has no public API for what it needs. Those places
were read in DeepSpeed 0.19.8; this test fails on another release so that they are read again
(and this list updated) before the integration is trusted there:

* ``OpBuilder._loaded_ops``: the cache of loaded ops that ``PrebuiltFirstMixin.load`` shares;
* ``CUDAOpBuilder.jit_load``: replaced, because DeepSpeed's compiles a CPU-only module without a GPU;
* ``_hp_mapping`` of each parameter and the ZeRO 1/2 (``bit16_groups``, ``single_partition_of_fp32_groups``,
  ``real_dp_process_group``), bf16 (``bf16_groups``, ``fp32_groups_flat_partition``) and stage 3
  (``fp16_groups``, ``fp32_partitioned_groups_flat``, ``sub_group_to_group_id``,
  ``sub_group_process_groups``) bookkeeping that ``integration/zero_layout.py`` reads;
* ``mixed_precision_linkage.get_full_hp_param``/``set_full_hp_param`` and stage 3's methods of the
  same names, which ``integration/patches.py`` replaces for ``safe_get/set_full_optimizer_state``;
* ``ZeROOptimizer._configure_master_weights``, wrapped by a row of ``integration/patches.py``;
* ``DeepSpeedEngine._configure_zero_optimizer``, ``_configure_bf16_optimizer``, ``_load_zero_checkpoint``
  and ``load_checkpoint``, which rows of ``integration/patches.py`` wrap;
* ``grads_in_partition`` and ``averaged_gradients``, which ``ds_q8.memory.measure_model_states`` reads;
* ZeRO 1/2's ``copy_grads_in_partition`` (replaced), ``_get_preflattened_grad_partition`` (the
  ``flat_partition`` it reads), ``_link_all_hp_params``, ``_use_compact_grad_partition_buffer``,
  ``get_gradient_for_reduction``, ``get_param_id``, ``state_dict`` and the bookkeeping
  ``parallel_partitioned_bit16_groups``, ``params_in_partition``, ``partition_size``, ``first_offset``,
  ``round_robin_bit16_padding``, which ``integration/shared_masters.py`` uses to step bf16 masters in place.
"""
import deepspeed

READ_IN = "0.19.8"


def test_deepspeed_is_the_release_the_integration_was_read_in():
    assert deepspeed.__version__ == READ_IN, (
        f"DeepSpeed {deepspeed.__version__}: re-read the places this file lists in that release, then "
        f"update READ_IN (now {READ_IN})")


def test_the_private_places_exist():
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils import mixed_precision_linkage

    assert isinstance(OpBuilder._loaded_ops, dict) and hasattr(CUDAOpBuilder, "jit_load")
    assert hasattr(ZeROOptimizer, "_configure_master_weights")
    for name in ("_configure_zero_optimizer", "_configure_bf16_optimizer", "_load_zero_checkpoint", "load_checkpoint"):
        assert hasattr(DeepSpeedEngine, name), name
    for name in ("get_full_hp_param", "set_full_hp_param"):
        assert hasattr(mixed_precision_linkage, name) and hasattr(DeepSpeedZeroOptimizer_Stage3, name), name


def test_the_places_shared_masters_uses_exist():
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for name in ("copy_grads_in_partition", "_get_preflattened_grad_partition", "_link_all_hp_params",
                 "_use_compact_grad_partition_buffer", "get_gradient_for_reduction", "get_param_id", "state_dict"):
        assert callable(getattr(DeepSpeedZeroOptimizer, name, None)), name
    assert "flat_partition" in inspect.getsource(DeepSpeedZeroOptimizer._get_preflattened_grad_partition)
    init = inspect.getsource(DeepSpeedZeroOptimizer.__init__) + inspect.getsource(DeepSpeedZeroOptimizer)
    for name in ("parallel_partitioned_bit16_groups", "params_in_partition", "partition_size", "first_offset",
                 "round_robin_bit16_padding", "grads_in_partition"):
        assert f"self.{name}" in init, name

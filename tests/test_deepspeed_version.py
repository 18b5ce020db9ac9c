"""ds_q8 reaches into DeepSpeed where DeepSpeed has no public API for what it needs. It supports the
DeepSpeed releases its tests ran on (``ds_q8/integration/supported.py``: ``TESTED``, the range setup.py
declares); this file fails on any other release, so that these places are read again there (and the
copies of DeepSpeed logic that ``docs/deepspeed.md`` lists under "Review at each DeepSpeed release"
compared again) before the release is added to ``TESTED``.

Every target of the patch table (``ds_q8/integration/patches.py``) is checked row by row from the
table itself. The places ds_q8 reads without patching them are listed here by hand:

* ``OpBuilder._loaded_ops``: the cache of loaded ops that ``PrebuiltFirstMixin.load`` shares;
* ``CUDAOpBuilder.jit_load``: replaced, because DeepSpeed's compiles a CPU-only module without a GPU;
* ``_hp_mapping`` of each parameter and the ZeRO 1/2 (``bit16_groups``, ``single_partition_of_fp32_groups``,
  ``real_dp_process_group``), bf16 (``bf16_groups``, ``fp32_groups_flat_partition``) and stage 3
  (``fp16_groups``, ``fp32_partitioned_groups_flat``, ``sub_group_to_group_id``,
  ``sub_group_process_groups``) bookkeeping that ``integration/zero_layout.py`` reads;
* ``grads_in_partition`` and ``averaged_gradients``, which ``ds_q8.memory.measure.measure_model_states`` reads;
* ZeRO 1/2's ``_get_preflattened_grad_partition`` (the ``flat_partition`` it reads),
  ``_link_all_hp_params``, ``_use_compact_grad_partition_buffer``, ``get_gradient_for_reduction``,
  ``get_param_id`` and the bookkeeping ``parallel_partitioned_bit16_groups``, ``params_in_partition``,
  ``partition_size``, ``first_offset``, ``round_robin_bit16_padding``, which
  ``integration/shared_masters.py`` uses to step bf16 masters in place;
* ``deepspeed.runtime.utils.clip_grad_norm_`` and the engine methods ``integration/grad_norm.py`` calls.
"""
import re
from pathlib import Path

import pytest

deepspeed = pytest.importorskip("deepspeed")

from ds_q8.integration import patches, supported  # noqa: E402
from ds_q8.integration.patches import APPEND, SET  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_deepspeed_is_a_release_the_tests_ran_on():
    assert deepspeed.__version__ in supported.TESTED, (
        f"DeepSpeed {deepspeed.__version__}: re-read the places this file lists and the copies docs/deepspeed.md "
        f"lists for review in that release, then add it to TESTED in ds_q8/integration/supported.py "
        f"(now {supported.TESTED})")
    assert supported.supports(deepspeed.__version__)


def test_the_pinned_release_is_a_tested_one():
    pins = re.findall(r"^deepspeed==(\S+)$", (REPO / "requirements-dev.txt").read_text(), re.M)
    assert len(pins) == 1 and pins[0] in supported.TESTED


def test_the_range_is_the_tested_releases():
    assert supported.RANGE == ">=0.19.8,<0.19.9" and supported.REQUIREMENT == "deepspeed" + supported.RANGE
    assert all(supported.supports(v) for v in supported.TESTED)
    for version in ("0.16.0", "0.19.7", "0.19.9", "0.20.0", "1.0.0"):
        assert not supported.supports(version), version
    assert supported.supports("0.19.8+abc123")  # a source build of a tested release


@pytest.mark.parametrize("row", patches.PATCHES, ids=lambda row: f"{row.how}:{row.dotted}")
def test_every_target_of_the_table_exists(row):
    if row.how in (SET, APPEND):
        patches.resolve(row.target)
    else:
        owner, attr = patches.owner_of(row.target)
        assert callable(getattr(owner, attr)), row.dotted


def test_the_private_places_outside_the_table_exist():
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
    from deepspeed.runtime import utils
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert isinstance(OpBuilder._loaded_ops, dict) and hasattr(CUDAOpBuilder, "jit_load")
    assert callable(utils.clip_grad_norm_)
    for name in ("gradient_clipping", "fp16_enabled", "bfloat16_enabled", "zero_optimization", "_take_model_step"):
        assert callable(getattr(DeepSpeedEngine, name, None)), name


def test_the_places_shared_masters_uses_exist():
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for name in ("_get_preflattened_grad_partition", "_link_all_hp_params", "_use_compact_grad_partition_buffer",
                 "get_gradient_for_reduction", "get_param_id"):
        assert callable(getattr(DeepSpeedZeroOptimizer, name, None)), name
    assert "flat_partition" in inspect.getsource(DeepSpeedZeroOptimizer._get_preflattened_grad_partition)
    init = inspect.getsource(DeepSpeedZeroOptimizer.__init__) + inspect.getsource(DeepSpeedZeroOptimizer)
    for name in ("parallel_partitioned_bit16_groups", "params_in_partition", "partition_size", "first_offset",
                 "round_robin_bit16_padding", "grads_in_partition"):
        assert f"self.{name}" in init, name


#: lines naming ``use_muon`` per file of DeepSpeed 0.19.8, outside its own Muon (runtime/zero/muon/). ZeRO-1/2's
#: three checks of the tag are patched for ds_q8 (integration/muon_tags.py); every other reader acts only for
#: DeepSpeed's MuonWithAuxAdam or for "type": "Muon" (docs/deepspeed.md, "Review at each DeepSpeed release").
USE_MUON_READERS = {"__init__.py": 3, "module_inject/auto_tp.py": 1, "runtime/bf16_optimizer.py": 3,
                    "runtime/engine.py": 6, "runtime/zero/stage3.py": 13, "runtime/zero/stage_1_and_2.py": 5}


def test_deepspeed_reads_use_muon_where_it_was_read():
    root = Path(deepspeed.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        count = sum("use_muon" in line for line in path.read_text(errors="replace").splitlines())
        if count and not rel.startswith("runtime/zero/muon/"):
            found[rel] = count
    assert found == USE_MUON_READERS

"""The table of DeepSpeed patches (``ds_q8.integration.patches``): every row is applied, once, however
often ``install`` runs; a missing package leaves its rows out cleanly, and missing targets raise one
``DeepSpeedContractError`` naming every one of them. When the table is installed (at the first
``deepspeed.initialize`` that meets a ds_q8 optimizer): ``tests/test_deepspeed_contract.py``."""
import sys
import types

import pytest
import torch

import ds_q8
from ds_q8.integration import engine_hooks, grad_norm, patches, supported
from ds_q8.integration.contract import DeepSpeedContractError
from ds_q8.integration.patches import AFTER, APPEND, BEFORE, PER_ENGINE, REPLACE, SET, Patch


def _hooked_rows():
    return [row for row in patches.PATCHES if row.how in (BEFORE, AFTER, REPLACE)]


def _ds_q8_layers(value) -> int:
    # wrappers made by engine_hooks between the attribute and DeepSpeed's own function
    n = 0
    while engine_hooks.installed(value):
        n += 1
        value = value.__wrapped__
    return n


def _snapshot():
    out = {}
    for row in patches.PATCHES:
        if row.how in (BEFORE, AFTER, REPLACE):
            owner, attr = patches.owner_of(row.target)
            out[row.target] = getattr(owner, attr)
        elif row.how == APPEND:
            target = patches.resolve(row.target)
            out[row.target] = (target, list(target))
        elif row.how == SET:
            out[row.target] = {name: getattr(torch.optim, name) for name in ds_q8.OPTIMIZERS}
    return out


def test_every_row_is_applied_once_installed():
    pytest.importorskip("deepspeed")
    assert ds_q8.register_with_deepspeed()
    for row in _hooked_rows():
        owner, attr = patches.owner_of(row.target)
        value = getattr(owner, attr)
        assert row.name in engine_hooks.installed(value), row.dotted
        # one wrapper per row on this attribute, so each hook runs once per call
        assert _ds_q8_layers(value) == sum(r.target == row.target for r in _hooked_rows()), row.dotted
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    for name, cls in ds_q8.OPTIMIZERS.items():
        assert getattr(torch.optim, name) is cls and ZERO_SUPPORTED_OPTIMIZERS.count(cls) == 1


def test_a_second_install_changes_nothing():
    pytest.importorskip("deepspeed")
    assert ds_q8.register_with_deepspeed()
    before = _snapshot()
    assert patches.install() and ds_q8.register_with_deepspeed()
    after = _snapshot()
    assert after.keys() == before.keys()
    for target, value in before.items():
        if isinstance(value, tuple):  # the list: the same object with the same items
            assert after[target][0] is value[0] and after[target][1] == value[1], target
        elif isinstance(value, dict):
            assert all(after[target][n] is v for n, v in value.items()), target
        else:
            assert after[target] is value, target


def test_per_engine_rows_are_the_ones_grad_norm_applies():
    pytest.importorskip("deepspeed")
    rows = [row for row in patches.PATCHES if row.how == PER_ENGINE]
    wrappers = {patches.owner_of(row.target)[0] for row in rows if row.function is grad_norm._from_wrapper}
    assert wrappers == set(grad_norm._wrappers())
    assert {row.function for row in rows} == {grad_norm._from_wrapper, grad_norm._from_fp32_clip}
    for row in rows:
        patches.owner_of(row.target)  # the attribute exists in this DeepSpeed


def test_every_row_says_why():
    for row in patches.PATCHES:
        assert row.why and row.how in (BEFORE, AFTER, REPLACE, SET, APPEND, PER_ENGINE) and callable(row.function)
    assert len(patches.describe()) == len(patches.PATCHES)
    with pytest.raises(ValueError, match="unknown kind"):
        Patch("torch:optim", "around", len, "no such kind")


# ---------------------------------------------------------------------------- on a target of our own
@pytest.fixture
def target(monkeypatch):
    mod = types.ModuleType("ds_q8_fake_target")
    calls = []

    class Engine:
        def work(self, x):
            calls.append(("work", x))
            return x + 1

    def helper(x):
        calls.append(("helper", x))
        return 2 * x

    mod.Engine, mod.helper, mod.names, mod.calls = Engine, helper, [], calls
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def _table(mod):
    def check(self, x):
        mod.calls.append(("before", x))

    def seen(self, result, x):
        mod.calls.append(("after", result))

    def doubled(original):
        def helper(x):
            mod.calls.append(("replaced", x))
            return original(x)
        return helper

    return (Patch("ds_q8_fake_target:Engine.work", BEFORE, check, "test"),
            Patch("ds_q8_fake_target:Engine.work", AFTER, seen, "test"),
            Patch("ds_q8_fake_target:helper", REPLACE, doubled, "test"),
            Patch("ds_q8_fake_target", SET, lambda: {"Extra": int}, "test"),
            Patch("ds_q8_fake_target:names", APPEND, lambda: ["a", "b"], "test"),
            Patch("ds_q8_fake_target:Engine.work", PER_ENGINE, check, "never applied by install"))


def test_hooks_run_once_per_call_however_often_installed(target):
    table = _table(target)
    for _ in range(3):
        assert patches.install(table)
    work, helper = target.Engine.work, target.helper
    assert patches.install(table) and target.Engine.work is work and target.helper is helper
    assert target.Engine().work(1) == 2 and target.helper(5) == 10
    assert target.calls == [("before", 1), ("work", 1), ("after", 2), ("replaced", 5), ("helper", 5)]
    assert target.Extra is int and target.names == ["a", "b"]
    assert target.Engine.work.__name__ == "work" and _ds_q8_layers(target.Engine.work) == 2


def test_a_missing_package_leaves_its_rows_out(target):
    table = (Patch("ds_q8_fake_target:names", APPEND, lambda: ["a"], "test"),
             Patch("ds_q8_no_such_package.engine:Engine.step", BEFORE, print, "test"))
    assert patches.install(table) is False
    assert target.names == ["a"]


def test_missing_targets_fail_together_before_anything_is_patched(target):
    table = (Patch("ds_q8_fake_target:names", APPEND, lambda: ["a"], "test"),
             Patch("ds_q8_fake_target:Engine.renamed", BEFORE, print, "test"),
             Patch("ds_q8_fake_target:Gone.step", PER_ENGINE, print, "test"),
             Patch("ds_q8_fake_target.removed:helper", REPLACE, print, "test"))
    with pytest.raises(DeepSpeedContractError) as e:
        patches.install(table)
    assert target.names == []
    text = str(e.value)
    assert [t for t, _ in e.value.missing] == ["ds_q8_fake_target.Engine.renamed", "ds_q8_fake_target.Gone.step",
                                               "ds_q8_fake_target.removed.helper"]
    assert e.value.supported == supported.RANGE and f"supports DeepSpeed {supported.RANGE}" in text
    assert "'Engine' has no 'renamed'" in text and supported.REQUIREMENT in text


def test_import_applies_torch_rows_and_the_entry_row_only():
    assert {row.package for row in patches.import_rows()} == {"torch"}
    assert [row.target for row in patches.entry_rows()] == [patches.ENTRY] == ["deepspeed:initialize"]
    # a callable that makes the optimizer runs inside _configure_optimizer: only rows after it can run late
    assert not [row for row in patches.PATCHES if row.target.endswith("._configure_optimizer") and row.how != AFTER]

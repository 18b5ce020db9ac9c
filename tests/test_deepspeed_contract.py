"""ds_q8's contract with DeepSpeed (``ds_q8/integration/entry.py``, ``contract.py``, ``supported.py``).

* ``import ds_q8`` imports no DeepSpeed; once DeepSpeed is imported, only its public ``initialize`` is
  wrapped, and the patch table is installed by the first ``deepspeed.initialize`` that meets a ds_q8
  optimizer (a config's type, an instance, a callable making one), not by one for another optimizer;
* with a DeepSpeed that lacks private places, ``import ds_q8`` and the plain optimizers work, DeepSpeed
  works with its own optimizers, and meeting a ds_q8 optimizer fails with one error naming the
  supported range and every missing place;
* setup.py declares the range the tests ran on.

Each case runs in a fresh interpreter: the table is installed once per process. The optimizers take the
reference step there: these tests are about the integration, not the kernels.
"""
import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ds_q8.integration import contract, patches, supported  # noqa: E402

from helpers.ds_launch import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch

def installed():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    from ds_q8.integration import engine_hooks
    import ds_q8
    return bool(engine_hooks.installed(getattr(DeepSpeedEngine, '_configure_zero_optimizer', None))) or \
        ds_q8.Adam8bitBlock in ZERO_SUPPORTED_OPTIMIZERS

def trained(steps=5):
    import ds_q8
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = ds_q8.Adam8bitBlock(model.parameters(), lr=1e-2, min_8bit_size=1024, impl="reference")
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert any(s["state1"].dtype == torch.uint8 for s in opt.state.values())
    return losses

def initialize(kind):
    import deepspeed, ds_q8
    model = torch.nn.Linear(8, 8)
    cfg, kw = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}, {}
    if kind == "config":
        cfg["optimizer"] = {"type": "Adam8bitBlock", "params": {"lr": 1e-3, "impl": "reference"}}
    elif kind == "instance":
        kw["optimizer"] = ds_q8.Adam8bitBlock(model.parameters(), impl="reference")
    elif kind == "callable":
        kw["optimizer"] = lambda params: ds_q8.Adam8bitBlock(params, impl="reference")
    else:
        kw["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
    return engine
"""


def run(code: str, timeout: int = 300, prelude: str = PRELUDE) -> str:
    """The case in a fresh interpreter that ends as a user's script does (no process group destroyed)."""
    out = subprocess.run([sys.executable, "-c", prelude + code, str(free_port())], capture_output=True,
                         text=True, cwd=REPO, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


CAPTURED = r"""
def captured():
    import torch.distributed.nn.functional as f
    from torch.distributed import ProcessGroup
    return sorted(n for n, fn in vars(f).items()
                  if any(isinstance(d, ProcessGroup) for d in getattr(fn, "__defaults__", None) or ()))
"""


def test_the_world_group_is_not_captured_by_torchs_collectives():
    """A group that torch.distributed.nn's defaults hold lives as long as the interpreter, with its Gloo
    threads (the exit abort of ds_q8.integration.process_groups): after ``import ds_q8`` a config-built
    engine leaves none there; without it, torch's lazy import during the optimizer's construction binds it."""
    out = run(CAPTURED + r"""
engine = initialize("config")
print("captured with ds_q8", captured())
""")
    assert "captured with ds_q8 []" in out
    bare = PRELUDE.replace("import torch\n", "import torch, deepspeed\n", 1)
    out = run(CAPTURED + r"""
deepspeed.init_distributed(dist_backend="gloo")
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
print("captured without ds_q8", len(captured()) > 0)
""", prelude=bare)
    assert "captured without ds_q8 True" in out


def test_import_imports_no_deepspeed_and_then_wraps_initialize_only():
    out = run(r"""
import ds_q8
print("deepspeed imported", "deepspeed" in sys.modules)
losses = trained()
print("plain optimizer trains", losses[-1] < losses[0])
import deepspeed
from ds_q8.integration import engine_hooks
print("initialize wrapped", bool(engine_hooks.installed(deepspeed.initialize)))
print("table installed", installed())
""")
    assert "deepspeed imported False" in out and "plain optimizer trains True" in out
    assert "initialize wrapped True" in out and "table installed False" in out


@pytest.mark.parametrize("kind", ["config", "instance", "callable"])
def test_initialize_installs_the_table_when_it_meets_ds_q8(kind):
    out = run(f"""
import deepspeed, ds_q8
print("before", installed())
engine = initialize("torch")
print("after another optimizer", installed())
engine = initialize({kind!r})
print("after ds_q8", installed())
# the row after _configure_optimizer ran for this engine too (late, for a callable)
print("norm kept", "clip_fp32_gradients" in vars(engine))
""")
    assert "before False" in out and "after another optimizer False" in out
    assert "after ds_q8 True" in out and "norm kept True" in out


RENAMED = r"""
import deepspeed
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import mixed_precision_linkage
# a release that renamed one private method and dropped one function
DeepSpeedEngine._configure_zero_optimizer_v2 = DeepSpeedEngine._configure_zero_optimizer
del DeepSpeedEngine._configure_zero_optimizer
del mixed_precision_linkage.get_full_hp_param
import ds_q8
losses = trained()
print("plain optimizer trains", losses[-1] < losses[0])
initialize("torch")
print("deepspeed with its own optimizers works")
for how in ("initialize", "register"):
    try:
        initialize("config") if how == "initialize" else ds_q8.register_with_deepspeed()
    except ds_q8.DeepSpeedContractError as e:
        print(how, "refused:", [t for t, _ in e.missing], e.supported)
        print(str(e))
print("table installed", installed())
"""


def test_renamed_internals_break_only_the_meeting_with_ds_q8():
    out = run(RENAMED)
    assert "plain optimizer trains True" in out and "deepspeed with its own optimizers works" in out
    targets = ["deepspeed.runtime.engine.DeepSpeedEngine._configure_zero_optimizer",
               "deepspeed.utils.mixed_precision_linkage.get_full_hp_param"]
    for how in ("initialize", "register"):
        assert f"{how} refused: {targets} {supported.RANGE}" in out, out
    assert f"ds_q8 supports DeepSpeed {supported.RANGE}" in out and "table installed False" in out


def test_a_deepspeed_without_initialize_still_imports_ds_q8():
    out = run(r"""
import warnings
import deepspeed
del deepspeed.initialize
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import ds_q8
print("warned", any("register_with_deepspeed" in str(w.message) for w in caught))
print("plain optimizer trains", trained()[-1] < trained()[0])
""")
    assert "warned True" in out and "plain optimizer trains True" in out


def test_a_release_outside_the_range_is_patched_with_one_warning(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.99.1")
    with pytest.warns(UserWarning, match=r"tested with DeepSpeed >=0\.19\.8,<0\.19\.9, not 0\.99\.1"):
        assert patches.install()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patches.install()  # once per version
    error = contract.DeepSpeedContractError("0.99.1", [("deepspeed.x.y", "gone")])
    assert "DeepSpeed 0.99.1 lacks 1 place(s)" in str(error) and "  - deepspeed.x.y: gone" in str(error)


def test_setup_declares_the_tested_range(monkeypatch):
    import setuptools

    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    monkeypatch.setattr(sys, "argv", ["setup.py"])
    for name in ("DS_BUILD_OPS", "DS_BUILD_Q8_CPU", "DS_BUILD_Q8_CUDA"):
        monkeypatch.delenv(name, raising=False)
    runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    assert got["extras_require"]["deepspeed"] == [supported.REQUIREMENT]
    assert supported.REQUIREMENT in got["extras_require"]["train"]
    assert not any(r.startswith("deepspeed") for r in got["install_requires"])


def test_every_form_of_config_that_names_ds_q8_is_recognised(tmp_path):
    import base64
    import json
    from types import SimpleNamespace

    import torch

    import ds_q8
    from ds_q8.integration import entry

    def meets(**arguments):
        return entry.names_ds_q8(arguments, patches._is_ds_q8, ds_q8.OPTIMIZERS)

    cfg = {"optimizer": {"type": "Lion8bitBlock", "params": {}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    assert meets(config=cfg) and meets(config=str(path)) and meets(config=path) and meets(config=encoded)
    assert meets(config_params=cfg) and meets(args=SimpleNamespace(deepspeed_config=str(path)))
    assert meets(config={"optimizer": {"type": "lion8bitblock"}})
    assert meets(optimizer=ds_q8.Adam8bitBlock([torch.nn.Parameter(torch.zeros(4))]))
    assert not meets(config={"optimizer": {"type": "AdamW"}}) and not meets(config={}) and not meets()
    assert not meets(config=str(tmp_path / "missing.json")) and not meets(config={"optimizer": None})

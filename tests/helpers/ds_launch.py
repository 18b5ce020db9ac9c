"""Start the scripts of tests/ds_scripts (train.py and the others) under the deepspeed launcher and return
their results; ``load_script`` imports one of them into a test without putting that folder on sys.path."""
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "ds_scripts"


def extensions_root() -> str:
    """Torch's root of JIT builds for this process (TORCH_EXTENSIONS_DIR or its default). A launch script run
    under it (the GPU machine's scripts build into the checkout's .ext_cache/ otherwise) finds the builds that
    the suite's other tests made, instead of compiling them again."""
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.normpath(_get_build_directory("", verbose=False))


def free_port() -> int:
    """A port no one listens on: any the system offers, or one of ``DS_Q8_TEST_PORTS`` ("31000-31999") where
    set, for a machine whose other jobs own the rest."""
    span = os.environ.get("DS_Q8_TEST_PORTS")
    low, high = (int(x) for x in span.split("-")) if span else (0, 0)
    first = random.randint(low, high)
    for port in [*range(first, high + 1), *range(low, first)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in DS_Q8_TEST_PORTS={span}")


def load_script(name: str):
    """The module tests/ds_scripts/<name>.py, imported under its own name (its code runs once per call)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e["OMP_NUM_THREADS"] = "1"
    return e


def run_checked(cmd, log: Path, timeout: int, cwd=None, result: Path = None, attempts: int = 2):
    """Run ``cmd``; on failure try once more (a port taken by another job between choosing and
    binding it fails the start). When ``result`` exists, rank 0 wrote it after every rank finished
    all jobs, so a non-zero exit can only come from process teardown and the result stands."""
    tails = []
    for attempt in range(attempts):
        if "--master_port" in cmd:
            cmd[cmd.index("--master_port") + 1] = str(free_port())
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), cwd=cwd, timeout=timeout)
        if proc.returncode == 0 or (result is not None and result.exists()):
            return
        tails.append(f"attempt {attempt + 1} exited with {proc.returncode}; log tail:\n{log.read_text()[-3000:]}")
    raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n" + "\n".join(tails))


def launch(plan, workdir: Path, name: str, ranks: int = 2, timeout: int = 300) -> dict:
    """Run ``plan`` (a list of jobs, see train.py) on ``ranks`` ranks; returns {job name: record}."""
    plan_file, out_file = workdir / f"{name}.plan.json", workdir / f"{name}.out.json"
    plan_file.write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
           str(free_port()), str(SCRIPTS / "train.py"), "--plan", str(plan_file), "--out", str(out_file)]
    out_file.unlink(missing_ok=True)
    run_checked(cmd, workdir / f"{name}.log", timeout, cwd=workdir, result=out_file)
    return json.loads(out_file.read_text())


def config(stage: int, optimizer: str = "Adam8bitBlock", lr: float = 0.01, **extra) -> dict:
    """A DeepSpeed config for the tiny model: 2 micro-batches per step, clipping at 1.0."""
    params = {"lr": lr}
    if optimizer.endswith("8bitBlock"):
        params.update(block_size=256, min_8bit_size=1024)
    if optimizer == "Adam":
        params["torch_adam"] = True  # torch's fp32 Adam: no op to JIT-build
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
         "optimizer": {"type": optimizer, "params": params}, "zero_optimization": {"stage": stage}}
    for k, v in extra.items():
        if k == "zero":
            c["zero_optimization"].update(v)
        elif k == "opt_params":
            c["optimizer"]["params"].update(v)
        else:
            c[k] = v
    return c

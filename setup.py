"""Install ds_q8. Kernels are JIT-compiled on first use unless asked for at install time.

Prebuilding follows DeepSpeed's DS_BUILD_<OP>=1 convention:
  DS_BUILD_Q8_CPU=1    the C++ CPU op (ds_q8._q8_cpu)
  DS_BUILD_Q8_CUDA=1   the CUDA op (ds_q8._q8_cuda); needs CUDA_HOME, and TORCH_CUDA_ARCH_LIST
                       when no GPU is visible
  DS_BUILD_OPS=1       both
"""
import importlib.util
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, *parts: str):
    """A module of ds_q8 loaded by path: importing the ds_q8 package would need it installed already."""
    path = os.path.join(HERE, "ds_q8", *parts)
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=(
        [os.path.dirname(path)] if parts[-1] == "__init__.py" else None))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip() == "1"


def _prebuilt_extensions():
    wanted = [kind for kind, var in (("cpu", "DS_BUILD_Q8_CPU"), ("cuda", "DS_BUILD_Q8_CUDA"))
              if _flag(var) or _flag("DS_BUILD_OPS")]
    if not wanted:
        return [], {}
    builders = _load("ds_q8_op_builder", "op_builder", "__init__.py")
    from torch.utils.cpp_extension import BuildExtension

    extensions = []
    for kind in wanted:
        builder = builders.ALL_BUILDERS[kind]()
        if not builder.is_compatible(verbose=True):
            raise RuntimeError(f"cannot prebuild the {kind} op: {builder.error_log}")
        extensions.append(builder.builder())
    return extensions, {"build_ext": BuildExtension}


ext_modules, cmdclass = _prebuilt_extensions()
# the DeepSpeed releases the tests ran on, nothing wider: ds_q8 patches private parts of DeepSpeed
DEEPSPEED = _load("ds_q8_supported", "integration", "supported.py").REQUIREMENT

setup(
    name="ds_q8",
    version="0.4.0",
    description="8-bit block-wise quantized optimizers for DeepSpeed",
    packages=find_packages(include=["ds_q8", "ds_q8.*"]),
    package_data={"ds_q8": ["csrc/**/*", "csrc/*"]},
    include_package_data=True,
    python_requires=">=3.9",
    # the optimizers need torch, and ninja to compile their kernels (through DeepSpeed's op
    # builder: without DeepSpeed they take the pure-PyTorch reference step, same results)
    install_requires=[
        "torch>=2.4",
        "ninja",
    ],
    extras_require={
        "deepspeed": [DEEPSPEED],
        # launch/ (training, the main job's report, launchers) and the studies/ and gpu_check/ scripts
        "train": [DEEPSPEED, "transformers>=4.40", "tqdm", "matplotlib", "mpi4py"],
        "test": ["pytest", "pytest-timeout==2.4.0", "pytest-xdist==3.8.0", "hypothesis", "accelerate"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

"""Install ds_q8. Kernels are JIT-compiled on first use unless asked for at install time."""
from setuptools import find_packages, setup

setup(
    name="ds_q8",
    version="0.1.0",
    description="8-bit block-wise quantized optimizers for DeepSpeed",
    packages=find_packages(include=["ds_q8", "ds_q8.*"]),
    package_data={"ds_q8": ["csrc/**/*", "csrc/*"]},
    include_package_data=True,
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.16",
        "ninja",
        "transformers>=4.40",
        "mpi4py",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "accelerate"],
    },
)

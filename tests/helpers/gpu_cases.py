"""The shapes of the GPU kernel checks (tests/test_gpu_kernels.py): block sizes, dtype pairs, sizes around
each block size, and one tensor with more than 2^31 elements."""
import torch

BLOCK_SIZES = [64, 128, 256, 512, 1024, 2048, 4096]
DTYPE_PAIRS = [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float16", "float32"),
               ("bfloat16", "float32")]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HUGE = 2 ** 31 + 4099


def sizes_for(block_size: int):
    return [1, 7, block_size - 1, block_size + 1, 3 * block_size + 7]

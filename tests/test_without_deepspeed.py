"""ds_q8 needs torch, not DeepSpeed: without DeepSpeed it imports, and its optimizers step (on the
reference, with one warning saying why) unless a prebuilt kernel is installed."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CODE = r"""
import sys
sys.modules["deepspeed"] = None  # importing it now fails, as if it were not installed
import warnings
import torch
import ds_q8
p = torch.nn.Parameter(torch.randn(5000))
opt = ds_q8.AdamW8bitBlock([p], lr=1e-3)
p.grad = torch.randn(5000)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
print("dtype", opt.state[p]["state1"].dtype)
print("registered", ds_q8.register_with_deepspeed())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
adam = ds_q8.Adam8bitBlock(model.parameters(), lr=1e-2, min_8bit_size=1024)
x, y = torch.randn(32, 64), torch.randn(32, 1)
losses = []
for _ in range(5):
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    adam.step()
    adam.zero_grad()
    losses.append(loss.item())
print("trains", losses[-1] < losses[0])
for w in caught:
    print("warning", w.message)
"""


def test_import_and_step_with_torch_alone():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dtype torch.uint8" in out.stdout and "registered False" in out.stdout and "trains True" in out.stdout
    assert "DeepSpeed, whose op builder compiles them, cannot be imported" in out.stdout

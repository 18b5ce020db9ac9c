"""One process, world size 1: build optimizers from DeepSpeed JSON configs and take one step each.

Prints one line per case: ``<type> stage=<n> STEPPED`` or ``<type> stage=<n> REFUSED <message>``.
Run by tests/test_optim_family.py in a subprocess (DeepSpeed initializes torch.distributed).
"""
import os
import sys

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])

import deepspeed  # noqa: E402
import torch  # noqa: E402

import ds_q8  # noqa: E402,F401  (registers the JSON type names)

torch.set_num_threads(1)
for opt_type, stage in [("LAMB8bitBlock", 2), ("LARS8bitBlock", 1), ("LAMB8bitBlock", 0), ("Lion8bitBlock", 2)]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    cfg = {"train_batch_size": 4, "optimizer": {"type": opt_type, "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
    try:
        engine.step()
        print(f"{opt_type} stage={stage} STEPPED", flush=True)
    except RuntimeError as e:
        print(f"{opt_type} stage={stage} REFUSED {e}", flush=True)
torch.distributed.destroy_process_group()

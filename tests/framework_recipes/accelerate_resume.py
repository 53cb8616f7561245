"""The Accelerate recipe of docs/recipes.md with a real Accelerator (CPU); run it with
python (one process) or ``torchrun --nproc-per-node 2``.

    python accelerate_resume.py ref|crash|resume OUT

Logs ``step digest loss`` per step and rank to ``OUT/MODE.rank<r>.log``; ``crash`` dies
after step 10 (checkpoints every 4 steps), ``resume`` continues from step 8.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from accelerate import Accelerator
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes_ns import recipe_namespace

ns = recipe_namespace("def accelerate_save")
MODE, OUT = sys.argv[1], Path(sys.argv[2])

accelerator = Accelerator(cpu=True)
model, opt = ns["make_model"]()
model, opt = accelerator.prepare(model, opt)   # not the loader
loader = ns["make_loader"]()
step = 0
if MODE == "resume":
    ns["accelerate_load"](accelerator, loader, OUT / "ckpt" / "step-8")
    step = 8
with open(OUT / f"{MODE}.rank{accelerator.process_index}.log", "a") as log:
    while step < 20:
        for x, y in loader:
            step += 1
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            digest = hashlib.blake2b(x.numpy().tobytes() + y.numpy().tobytes(), digest_size=8).hexdigest()
            log.write(f"{step} {digest} {loss.item().hex()}\n")
            log.flush()
            if MODE == "crash" and step % 4 == 0:
                ns["accelerate_save"](accelerator, loader, OUT / "ckpt" / f"step-{step}")
            if MODE == "crash" and step == 10:
                os._exit(1)
            if step >= 20:
                break

"""Hugging Face Accelerate with SavableDataLoader (CPU); python for one process,
``torchrun --nproc-per-node 2`` for two.

    python accelerate_loop.py OUT RUN HOW [HOW ...]

``prepare``: the loader goes through ``accelerator.prepare`` with the model and the
optimizer; a resume calls ``accelerator.load_state`` and, mid-epoch,
``accelerator.skip_first_batches`` (Accelerate's documented way).
``register``: the loader is not prepared; ``accelerator.register_for_checkpointing(loader)``
makes ``save_state`` / ``load_state`` carry it.
``every-rank``: a savable pipeline, registered as
``accelerator.register_for_checkpointing(EveryRankState(loader))`` (on 2 processes every
process's state goes in the main process's checkpoint).
RUN is ``ref`` (saves at steps 6 and 9) or ``resume-<S>``. The HOWs run one after the
other in this process (they share its start-up), each writing to ``OUT/<how>/``; an
exception ends the process.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
from accelerate import Accelerator
from accelerate.utils import set_seed

import savable_loader as sl
from savable_loader.integrations import EveryRankState

EPOCHS = 3


class Progress:
    """The loop's counters, checkpointed with the rest."""

    def __init__(self) -> None:
        self.step = self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.epoch = sd["step"], sd["epoch"]


def main(out: Path, run: str, how: str) -> None:
    if how not in ("prepare", "register", "every-rank"):
        raise ValueError(f"HOW must be 'prepare', 'register' or 'every-rank', got {how!r}")
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model, opt = c.make_model()
    if how == "every-rank":
        from _pipeline import pipeline_loader

        loader = pipeline_loader(accelerator.num_processes)
    else:
        loader = sl.SavableDataLoader(
            c.Augmented(c.dataset_len(accelerator.num_processes)),
            batch_size=c.BATCH,
            shuffle=True,
            num_workers=c.WORKERS,
        )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if how == "prepare":
        model, opt, loader = accelerator.prepare(model, opt, loader)
    else:
        model, opt = accelerator.prepare(model, opt)
        accelerator.register_for_checkpointing(EveryRankState(loader) if how == "every-rank" else loader)
    skip = 0
    if run.startswith("resume-"):
        accelerator.load_state(out / "ckpt" / f"step-{run.split('-')[1]}")
        skip = progress.step - progress.epoch * c.STEPS_PER_EPOCH if how == "prepare" else 0

    for epoch in range(progress.epoch, EPOCHS):
        progress.epoch = epoch
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            progress.step += 1
            loss = c.loss_of(model, batch)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            c.log_step(out, run, accelerator.process_index, progress.step, epoch, batch, loss)
            if run == "ref" and progress.step in c.SAVE_STEPS:
                accelerator.save_state(out / "ckpt" / f"step-{progress.step}")
            if progress.step == c.TOTAL_STEPS:
                return


if __name__ == "__main__":
    OUT, RUN = Path(sys.argv[1]), sys.argv[2]
    for how in sys.argv[3:]:
        (OUT / how).mkdir(exist_ok=True)
        main(OUT / how, RUN, how)

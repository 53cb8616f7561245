"""The Hugging Face Trainer (CPU); python for one process, ``torchrun --nproc-per-node 2``
for two.

    python hf_trainer.py OUT RUN HOW [HOW ...]

``savable``: ``SavableTrainer`` in place of ``Trainer``, nothing else changed.
``override``: a ``Trainer`` whose ``get_train_dataloader`` returns a SavableDataLoader.
The data is a ``datasets.Dataset`` with a column the model does not take (the Trainer
removes it) and an augmentation transform drawing from torch's, Python's and NumPy's
RNGs in 2 loader workers. RUN is ``ref`` (``save_steps=3``) or ``resume-<S>``
(``train(resume_from_checkpoint=<ref's checkpoint-S>)``). The HOWs run one after the
other in this process (they share its start-up: Python, transformers, datasets), each
writing to ``OUT/<how>/``; an exception ends the process.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
import datasets
import numpy as np
import torch
import transformers
from torch import nn

import savable_loader as sl

datasets.disable_progress_bars()
transformers.logging.set_verbosity_error()


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, _ = c.make_model()

    def forward(self, x, labels, idx=None):
        return {"loss": nn.functional.mse_loss(self.lin(x), labels)}


def augment(batch):
    xs = []
    for row in batch["x"]:
        x = torch.tensor(row) + 0.05 * torch.randn(len(row))
        if random.random() < 0.3:
            x[0] = 0.0
        xs.append((x * float(np.random.uniform(0.9, 1.1))).tolist())
    batch["x"] = xs
    return batch


class EpochCounter(transformers.TrainerCallback):
    epoch = 0

    def on_epoch_begin(self, args, state, control, **kwargs):
        EpochCounter.epoch = int(state.epoch)


def logged(base, out: Path, run: str):
    class Logged(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            c.log_step(
                out,
                run,
                self.args.process_index,
                self.state.global_step + 1,
                EpochCounter.epoch,
                inputs,
                loss,
                index=inputs["idx"],
            )
            return loss

    return Logged


class OverrideTrainer(transformers.Trainer):
    def get_train_dataloader(self):
        return sl.SavableDataLoader(
            self.train_dataset,
            batch_size=self.args.per_device_train_batch_size,
            shuffle=True,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
        )


def main(out: Path, run: str, how: str) -> None:
    EpochCounter.epoch = 0
    args = transformers.TrainingArguments(
        output_dir=str(out / f"hf_{run}"),
        per_device_train_batch_size=c.BATCH,
        max_steps=c.TOTAL_STEPS,
        save_strategy="steps",
        save_steps=3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=c.WORKERS,
        seed=0,
        learning_rate=0.05,
        disable_tqdm=True,
    )
    base = c.Augmented(c.dataset_len(args.world_size))
    train = datasets.Dataset.from_dict(
        {
            "x": base.x.tolist(),
            "labels": base.y.tolist(),
            "idx": list(range(len(base))),
            "note": [f"sample {i}" for i in range(len(base))],
        }
    ).with_transform(augment)
    if how == "savable":
        from savable_loader.integrations.transformers import SavableTrainer

        cls = logged(SavableTrainer, out, run)
    elif how == "override":
        cls = logged(OverrideTrainer, out, run)
    else:
        raise ValueError(f"HOW must be 'savable' or 'override', got {how!r}")
    trainer = cls(model=Regression(), args=args, train_dataset=train, callbacks=[EpochCounter()])
    resume = str(out / "hf_ref" / f"checkpoint-{run.split('-')[1]}") if run.startswith("resume-") else None
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    OUT, RUN = Path(sys.argv[1]), sys.argv[2]
    for how in sys.argv[3:]:
        (OUT / how).mkdir(exist_ok=True)
        main(OUT / how, RUN, how)

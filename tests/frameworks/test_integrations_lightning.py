"""savable_loader.integrations.lightning: SavableLoaderCallback, in this process (CPU, one
device, no loader workers): a savable pipeline (no ``len()``, so Lightning's loop fetches a
batch ahead) resumes exactly with the callback, and without it the first checkpoint is a
clear error, never a resume that silently skips the batch held ahead.
tests/frameworks/test_frameworks.py runs the callback with workers on 1 and 2 processes."""

from __future__ import annotations

from pathlib import Path

import pytest

L = pytest.importorskip("lightning")

import torch

import savable_loader as sl
from savable_loader.integrations.lightning import SavableLoaderCallback
from savable_loader.wrappers import BatchDataset
from tests.common import RangeSource

pytestmark = pytest.mark.timeout(300)
MAX_STEPS = 12  # 8 batches per epoch: the run crosses an epoch
SAVES = (3, 8)


def _pipeline() -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    return sl.SavableDataLoader(BatchDataset(RangeSource(16, wc), 2), batch_size=None, worker_config=wc)


def _fit(out: Path, callbacks: list, ckpt: Path | None = None) -> list[list[float]]:
    """Run to ``MAX_STEPS``, checkpointing every step into ``out``; the batches trained on."""
    seen: list[list[float]] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            seen.append(batch.tolist())
            return self.lin(batch[:, :1].float()).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return _pipeline()

    every = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[every, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
    )
    trainer.fit(Model(), ckpt_path=None if ckpt is None else str(ckpt))
    return seen


def test_with_the_callback_a_pipeline_resumes_exactly(tmp_path):
    reference = _fit(tmp_path / "ref", [SavableLoaderCallback()])
    assert len(reference) == MAX_STEPS
    for step in SAVES:
        resumed = _fit(tmp_path / f"resume{step}", [SavableLoaderCallback()], tmp_path / "ref" / f"step={step}.ckpt")
        assert resumed == reference[step:], f"resumed from step {step}"


def test_without_the_callback_a_pipeline_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(sl.LoaderUsageError, match="SavableLoaderCallback"):
        _fit(tmp_path / "ref", [])

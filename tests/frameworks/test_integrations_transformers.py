"""savable_loader.integrations.transformers: SavableTrainer, in this process (CPU, no
loader workers). tests/frameworks/test_frameworks.py runs it with workers on 1 and 2 processes."""

from __future__ import annotations

import random
import warnings

import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import torch
import transformers
from torch import nn

import savable_loader as sl
from savable_loader.integrations import transformers as integration
from savable_loader.integrations.transformers import SavableTrainer, loader_state_path
from tests.common import assert_same

pytestmark = pytest.mark.timeout(300)
transformers.logging.set_verbosity_error()
datasets.disable_progress_bars()


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, labels, idx=None):
        return {"loss": nn.functional.mse_loss(self.lin(x), labels)}


class Points(torch.utils.data.Dataset):
    """Dicts with a key the model does not take (``note``) and augmentation."""

    def __init__(self, n: int = 28) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {
            "x": torch.full((4,), float(i)) + torch.randn(4),
            "labels": torch.tensor([i % 3 + random.random()]),
            "idx": i,
            "note": "unused",
        }


def _args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "max_steps": 12,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "learning_rate": 0.05,
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
    }
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Recording(SavableTrainer):
    """Records (global step, batch, loss) of every training step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, dict, float]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.seen.append((self.state.global_step, {k: v.clone() for k, v in inputs.items()}, loss.item()))
        return loss


def _train(tmp_path, resume=None, dataset=None, **kw) -> Recording:
    trainer = Recording(model=Regression(), args=_args(tmp_path, **kw), train_dataset=dataset or Points())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_loader_takes_the_trainer_arguments(tmp_path):
    args = _args(
        tmp_path,
        per_device_train_batch_size=3,
        dataloader_drop_last=True,
        dataloader_num_workers=2,
        dataloader_persistent_workers=True,
        dataloader_prefetch_factor=3,
        data_seed=11,
        seed=5,
        dataloader_multiprocessing_context="spawn",
    )
    trainer = SavableTrainer(model=Regression(), args=args, train_dataset=Points())
    loader = trainer.get_train_dataloader()
    assert isinstance(loader, sl.SavableDataLoader)
    assert (loader.batch_size, loader.drop_last, loader.num_workers, loader.seed) == (3, True, 2, 11)
    assert loader.persistent_workers and loader.prefetch_factor == 3
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert len(loader) == 28 // 3


def test_unused_columns_are_removed_as_the_trainer_removes_them(tmp_path):
    points = Points(8)
    rows = [points[i] for i in range(8)]
    table = datasets.Dataset.from_dict(
        {k: [r[k].tolist() if torch.is_tensor(r[k]) else r[k] for r in rows] for k in rows[0]}
    )
    for data in (points, table):
        args = _args(tmp_path, train_sampling_strategy="sequential")
        trainer = SavableTrainer(model=Regression(), args=args, train_dataset=data)
        ours = next(iter(trainer.get_train_dataloader()))
        theirs = next(iter(transformers.Trainer.get_train_dataloader(trainer)))
        assert sorted(ours) == sorted(theirs) == ["idx", "labels", "x"], type(data).__name__
        if data is table:  # no augmentation here: the same batch
            assert_same(dict(ours), dict(theirs))


def test_sampling_strategies(tmp_path):
    trainer = SavableTrainer(
        model=Regression(), args=_args(tmp_path, train_sampling_strategy="sequential"), train_dataset=Points()
    )
    assert next(iter(trainer.get_train_dataloader()))["idx"].tolist() == [0, 1, 2, 3]
    trainer = SavableTrainer(model=Regression(), args=_args(tmp_path), train_dataset=Points())
    assert next(iter(trainer.get_train_dataloader()))["idx"].tolist() != [0, 1, 2, 3]
    trainer = SavableTrainer(
        model=Regression(), args=_args(tmp_path, train_sampling_strategy="group_by_length"), train_dataset=Points()
    )
    with pytest.raises(sl.LoaderUsageError, match="train_sampling_strategy.*'group_by_length'"):
        trainer.get_train_dataloader()


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("checkpoint", [2, 3, 4, 6])
def test_resume_continues_the_uninterrupted_run(tmp_path, accumulation, checkpoint):
    """7 batches per epoch: with accumulation 2, 4 updates per epoch, the last of one batch.
    Checkpoints mid-epoch and at an epoch's end (update 4 with accumulation 2)."""
    reference = _train(tmp_path / "ref", gradient_accumulation_steps=accumulation, save_steps=1)
    folder = tmp_path / "ref" / "out" / f"checkpoint-{checkpoint}"
    assert loader_state_path(folder, 0).is_file()
    resumed = _train(tmp_path / "resumed", resume=str(folder), gradient_accumulation_steps=accumulation, save_steps=1)
    want = [s for s in reference.seen if s[0] >= checkpoint]
    assert len(resumed.seen) == len(want) > 0
    for (step, batch, loss), (ref_step, ref_batch, ref_loss) in zip(resumed.seen, want):
        assert step == ref_step
        assert_same(batch, ref_batch, f"step {step}")
        assert loss == ref_loss, f"step {step}"


def test_resume_true_takes_the_last_checkpoint(tmp_path):
    import shutil

    reference = _train(tmp_path, max_steps=8)
    for step in (6, 8):  # as if the run had died after step 5
        shutil.rmtree(tmp_path / "out" / f"checkpoint-{step}")
    continued = _train(tmp_path, resume=True, max_steps=8)
    assert [s[0] for s in continued.seen] == [4, 5, 6, 7]  # from checkpoint-4
    for (_, batch, loss), (_, ref_batch, ref_loss) in zip(continued.seen, reference.seen[4:]):
        assert_same(batch, ref_batch)
        assert loss == ref_loss


def test_a_checkpoint_without_loader_state_is_a_clear_error(tmp_path):
    _train(tmp_path, max_steps=2)
    folder = tmp_path / "out" / "checkpoint-2"
    loader_state_path(folder, 0).unlink()
    with pytest.raises(sl.StateError, match="savable_loader_rank0.state does not exist.*ignore_data_skip"):
        _train(tmp_path, resume=str(folder), max_steps=4)


def test_ignore_data_skip_starts_the_epoch_over(tmp_path):
    reference = _train(tmp_path, max_steps=3)
    continued = _train(
        tmp_path / "again", resume=str(tmp_path / "out" / "checkpoint-2"), max_steps=4, ignore_data_skip=True
    )
    assert_same(continued.seen[0][1]["idx"], reference.seen[0][1]["idx"])  # epoch 0's first batch again


def test_a_trainer_position_that_differs_from_the_loader_state_is_an_error(tmp_path):
    """The checkpoint's trainer_state says 2 updates of 2 batches; the loader consumed 2."""
    _train(tmp_path, max_steps=2)
    with pytest.raises(
        sl.StateError,
        match=r"loader state .* epoch 0, batch 2 .* Trainer's state resumes at epoch 0, "
        r"batch 4",
    ):
        _train(tmp_path, resume=str(tmp_path / "out" / "checkpoint-2"), gradient_accumulation_steps=2, max_steps=4)


def test_other_loaders_are_skipped_by_accelerate(tmp_path):
    SavableTrainer(model=Regression(), args=_args(tmp_path), train_dataset=Points())  # installs the hook
    skip = transformers.trainer.skip_first_batches
    assert skip.__savable_loader_hook__ and skip.__wrapped__ is not skip
    plain = torch.utils.data.DataLoader(list(range(10)), batch_size=2)
    assert [b.tolist() for b in skip(plain, 3)] == [[6, 7], [8, 9]]
    ours = sl.SavableDataLoader(list(range(10)), batch_size=2)
    assert integration._CONTINUING.get(ours) is None
    assert skip(ours, 0) is not ours  # not restored by a SavableTrainer: Accelerate's function decides

"""savable_loader.integrations.every_rank (EveryRankState) and .fabric (FabricLoaderState),
in this process: with the hook a savable pipeline resumes exactly through Fabric's
save/load; without it the checkpoint is a clear error, never other data. Their gather over
two ranks runs in tests/frameworks/test_frameworks.py (Fabric and Accelerate on 2 processes)."""

from __future__ import annotations

import pytest
import torch

import savable_loader as sl
from savable_loader.integrations import EveryRankState
from savable_loader.integrations.fabric import FabricLoaderState
from savable_loader.wrappers import BatchDataset
from tests.common import RangeSource, assert_streams

pytestmark = pytest.mark.timeout(300)


def _pipeline(rank: int = 0, world: int = 1) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=0, seed=3)
    return sl.SavableDataLoader(BatchDataset(RangeSource(16, wc), 2), batch_size=None, worker_config=wc)


def _fabric_run(tmp_path, hook: bool, resume: bool) -> list[torch.Tensor]:
    """Three epochs through ``fabric.setup_dataloaders``; the reference saves after 3
    batches of epoch 1, a resumed run loads that checkpoint. The batches after the save."""
    L = pytest.importorskip("lightning")
    fabric = L.Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(_pipeline(), move_to_device=False)
    state = {"loader": FabricLoaderState(loader) if hook else loader, "step": 0, "epoch": 0}
    if resume:
        fabric.load(tmp_path / "fabric.ckpt", state)
    after: list[torch.Tensor] = []
    for epoch in range(state["epoch"], 3):
        state["epoch"] = epoch
        for batch in loader:
            state["step"] += 1
            if resume or state["step"] > 11:
                after.append(batch)
            if state["step"] == 11 and not resume:
                fabric.save(tmp_path / "fabric.ckpt", state)
    return after


def test_fabric_with_the_hook_resumes_a_pipeline_exactly(tmp_path):
    want = _fabric_run(tmp_path, hook=True, resume=False)
    assert len(want) == 13
    assert_streams(_fabric_run(tmp_path, hook=True, resume=True), want, "resumed through FabricLoaderState")


def test_fabric_without_the_hook_refuses_a_pipeline_checkpoint(tmp_path):
    """Fabric's process imports Lightning's Trainer (``import lightning``): the loader
    cannot tell Fabric from the Trainer, whose loop holds a batch fetched ahead."""
    with pytest.raises(sl.LoaderUsageError, match="FabricLoaderState"):
        _fabric_run(tmp_path, hook=False, resume=False)


def test_rank_0s_entry_without_the_hook_is_a_clear_error_on_another_rank():
    """What Accelerate and Fabric hand rank 1 of a pipeline when no hook gathered."""
    loader = _pipeline(0, 2)
    it = iter(loader)
    next(it)
    entries = loader.state_dict()
    assert list(entries) == ["dp_rank_0"]
    with pytest.raises(sl.StateError, match="EveryRankState") as raised:
        _pipeline(1, 2).load_state_dict(entries)
    assert "SavableLoaderCallback" in str(raised.value) and "FabricLoaderState" in str(raised.value)


def test_on_one_process_the_hook_holds_the_loaders_own_entry():
    loader = _pipeline()
    hook = EveryRankState(loader)
    it = iter(loader)
    next(it)
    assert hook.state_dict() == loader.state_dict()


def test_the_hooks_take_only_savable_loaders():
    with pytest.raises(sl.errors.UsageTypeError, match="SavableDataLoader"):
        EveryRankState(torch.utils.data.DataLoader(range(4)))
    with pytest.raises(sl.LoaderUsageError, match="setup_dataloaders"):
        FabricLoaderState(torch.utils.data.DataLoader(range(4)))

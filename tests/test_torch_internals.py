"""The private torch internals savable_loader uses exist in the installed torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from savable_loader._torch_internals import replace_worker_info, torch_worker_id


class _Info(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list:
        info = get_worker_info()
        return [info.id, info.dataset, torch_worker_id()]


def _init(worker_id: int) -> None:
    replace_worker_info(id=worker_id + 10, dataset="user")


def test_replace_worker_info_changes_what_get_worker_info_returns():
    loader = DataLoader(_Info(), batch_size=None, num_workers=2, worker_init_fn=_init, multiprocessing_context="fork")
    assert sorted(item[0] for item in loader) == [10, 11]
    assert {item[1] for item in loader} == {"user"}
    assert sorted((item[0], item[2]) for item in loader) == [(10, 0), (11, 1)]  # torch's ids survive


def test_replace_worker_info_outside_a_worker_is_an_error():
    with pytest.raises(RuntimeError, match="outside a DataLoader worker"):
        replace_worker_info(id=1)
    assert torch_worker_id() is None
    assert torch.__version__

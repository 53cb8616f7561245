"""SavableDataLoader takes torch's DataLoader arguments exactly: the same signature,
positional or keyword, torch's defaults accepted when passed, and every combination torch
refuses refused with torch's message (as a LoaderUsageError, a ValueError)."""

from __future__ import annotations

import inspect
import re
import typing
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import savable_loader as sl
from savable_loader.errors import LoaderUsageError
from savable_loader.loader import arguments as _arguments
from tests.common import RandomMapDataset

pytestmark = pytest.mark.timeout(60)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_signature_is_torchs_plus_keyword_only_extras():
    ours = list(inspect.signature(sl.SavableDataLoader.__init__).parameters.values())
    theirs = list(inspect.signature(DataLoader.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]
    extras = ours[len(theirs) :]
    # a torch without in_order (before 2.6): ours takes it, keyword-only, as torch 2.6 does
    later = [name for name in ("in_order",) if name not in {p.name for p in theirs}]
    assert [p.name for p in extras] == [
        *later,
        "seed",
        "worker_config",
        "snapshot_every_n_steps",
        "save_timeout",
        "reseed",
        "global_rngs",
        "record_stats",
        "stats_log",
        "stats_log_every",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras)


def test_positional_arguments_and_explicit_defaults():
    ds = RandomMapDataset(10)
    loader = sl.SavableDataLoader(ds, 4, True, None, None, 0, None, False, True, 0, None, None, None)
    assert (loader.batch_size, loader.drop_last, len(loader)) == (4, True, 2)
    sl.SavableDataLoader(
        ds,
        batch_size=1,
        shuffle=None,
        sampler=None,
        batch_sampler=None,
        num_workers=0,
        collate_fn=None,
        pin_memory=False,
        drop_last=False,
        timeout=0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        prefetch_factor=None,
        persistent_workers=False,
        pin_memory_device="",
        in_order=True,
        snapshot_every_n_steps=1,
    )


def test_generic_like_torch():
    assert sl.SavableDataLoader[int] is not None
    assert typing.get_origin(sl.SavableDataLoader[int]) is sl.SavableDataLoader

    def make() -> sl.SavableDataLoader[list[torch.Tensor]]:
        return sl.SavableDataLoader(RandomMapDataset(2))

    assert isinstance(make(), DataLoader)


_DS = RandomMapDataset(12)
_SAMPLER = SequentialSampler(_DS)
_BATCHES = BatchSampler(_SAMPLER, 3, False)

REFUSED = [
    (_DS, {"num_workers": -1}),
    (_DS, {"timeout": -1}),
    (_DS, {"batch_size": None, "drop_last": True}),
    (_DS, {"num_workers": 0, "multiprocessing_context": "fork"}),
    (_DS, {"num_workers": 1, "multiprocessing_context": "bad"}),
    (_DS, {"num_workers": 1, "multiprocessing_context": object()}),
    (_DS, {"prefetch_factor": 2}),
    (_DS, {"num_workers": 1, "prefetch_factor": -1}),
    (_DS, {"persistent_workers": True}),
    (_DS, {"batch_size": 11, "sampler": _SAMPLER, "shuffle": True}),
    (_DS, {"batch_sampler": _BATCHES, "sampler": _SAMPLER, "shuffle": 3}),
    (_DS, {"batch_size": 11, "batch_sampler": _BATCHES}),
    (_DS, {"shuffle": True, "batch_sampler": _BATCHES}),
    (_DS, {"drop_last": 3, "batch_sampler": _BATCHES}),
    (_DS, {"batch_size": 0}),
    (_DS, {"batch_size": 2, "drop_last": "yes"}),
    (Stream(), {"shuffle": True}),
    (Stream(), {"sampler": 3}),
    (Stream(), {"batch_sampler": 3}),
    (RandomMapDataset(0), {"shuffle": True, "generator": torch.Generator()}),
    (RandomMapDataset(0), {"shuffle": True, "batch_size": 4}),  # issue 31: an empty dataset was accepted
]


@pytest.mark.parametrize(("dataset", "kwargs"), REFUSED, ids=[str(sorted(k)) for _, k in REFUSED])
def test_every_combination_torch_refuses_is_refused_with_torchs_message(dataset, kwargs):
    with pytest.raises(Exception) as torch_error:
        DataLoader(dataset, **kwargs)
    with pytest.raises(Exception) as ours:
        sl.SavableDataLoader(dataset, **kwargs)
    if isinstance(torch_error.value, TypeError):
        assert isinstance(ours.value, TypeError)
    else:
        assert isinstance(torch_error.value, ValueError)
        assert isinstance(ours.value, LoaderUsageError) and isinstance(ours.value, ValueError)
    assert str(torch_error.value) in str(ours.value)


def test_save_timeout_is_accepted_with_a_deprecation_warning():
    # a save never waits on a worker: the argument has no effect, but users' code keeps working
    with pytest.warns(DeprecationWarning, match="save_timeout has no effect") as record:
        loader = sl.SavableDataLoader(_DS, save_timeout=10)
    assert record[0].filename == __file__  # the warning points at the caller
    assert loader.save_timeout == 10
    loader.save_state_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sl.SavableDataLoader(_DS).save_timeout is None


def test_our_own_arguments_are_checked():
    with pytest.raises(LoaderUsageError, match="snapshot_every_n_steps"):
        sl.SavableDataLoader(_DS, snapshot_every_n_steps=0)
    with pytest.raises(LoaderUsageError, match="seed must be an int"):
        sl.SavableDataLoader(_DS, seed="1")
    with pytest.raises(LoaderUsageError, match="save_timeout"):
        sl.SavableDataLoader(_DS, save_timeout=0)
    with pytest.raises(LoaderUsageError, match="seed=1 differs"):
        sl.SavableDataLoader(_DS, seed=1, worker_config=sl.WorkerConfig(seed=2))
    wc = sl.WorkerConfig(num_workers=2, seed=4)
    loader = sl.SavableDataLoader(_DS, worker_config=wc, multiprocessing_context="fork")
    assert (loader.num_workers, loader.seed) == (2, 4)


def test_a_pipeline_takes_its_worker_config():
    wc = sl.WorkerConfig(num_workers=0, seed=9)
    from tests.common import RangeSource

    loader = sl.SavableDataLoader(RangeSource(4, wc), batch_size=None)
    assert loader.seed == 9 and loader.worker_config is wc
    with pytest.raises(LoaderUsageError, match="batch_size=None"):
        sl.SavableDataLoader(RangeSource(4, wc))
    with pytest.raises(LoaderUsageError, match="expected unspecified shuffle"):
        sl.SavableDataLoader(RangeSource(4, wc), batch_size=None, shuffle=True)


@pytest.mark.parametrize("dataset", [RandomMapDataset(8), Stream()], ids=["map", "iterable"])
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_count_warning_where_torch_gives_it(dataset, persistent):
    """torch warns about too many workers at construction and at ``iter()`` (a new pool
    only), never inside ``next()``: a loop that checks ``next()`` for warnings passes."""
    import os
    import warnings

    workers = len(os.sched_getaffinity(0)) + 1

    def counted(action: typing.Callable[[], typing.Any]) -> tuple[typing.Any, int]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = action()
        return result, sum("worker processes in total" in str(w.message) for w in caught)

    for cls in (DataLoader, sl.SavableDataLoader):
        kw = {"num_workers": workers, "persistent_workers": persistent, "multiprocessing_context": "fork"}
        loader, at_init = counted(lambda: cls(dataset, batch_size=2, **kw))
        counts = [at_init]
        for _ in range(2):
            it, at_iter = counted(lambda: iter(loader))
            _, at_next = counted(lambda: next(it))
            rest, at_rest = counted(lambda: list(it))
            counts += [at_iter, at_next + at_rest]
        del it, loader
        assert counts == [1, 1, 0, 0 if persistent else 1, 0], (cls.__name__, counts)


# -- arguments a supported torch may lack, and the forms it cannot take ---------------------

_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


def test_in_order_is_passed_to_torch_exactly_where_torch_has_it():
    loader = sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, in_order=True)
    assert loader.in_order is True  # on every torch (torch sets it where it has the argument)
    assert list(_arguments.torch_keyword_arguments(in_order=True)) == (["in_order"] if _HAS_IN_ORDER else [])
    if _HAS_IN_ORDER:  # torch 2.6 and later: in_order=False in the main process is torch's, harmless
        assert sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, in_order=False).in_order is False


@pytest.mark.parametrize("has_in_order", [True, False], ids=["torch>=2.6", "torch<2.6"])
def test_a_torch_without_in_order_refuses_only_what_it_cannot_do(monkeypatch, has_in_order):
    # both shapes on every torch: the signature the loader reads is made to lack in_order
    params = set(inspect.signature(DataLoader.__init__).parameters) - ({"in_order"} if not has_in_order else set())
    params |= {"in_order"} if has_in_order else set()
    monkeypatch.setattr(_arguments, "_torch_parameters", lambda: frozenset(params))
    assert _arguments.torch_keyword_arguments(in_order=True, timeout=3) == (
        {"in_order": True, "timeout": 3} if has_in_order else {"timeout": 3}
    )
    if has_in_order:
        assert _arguments.torch_keyword_arguments(in_order=False) == {"in_order": False}
        return
    message = (
        f"in_order=False: torch {torch.__version__}'s DataLoader has no in_order argument (torch 2.6 added it); "
        "pass in_order=True (what this torch does) or install torch>=2.6"
    )
    with pytest.raises(LoaderUsageError, match=re.escape(message)):
        sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, in_order=False)
    # with workers our own reason comes first: no state records a completion order
    with pytest.raises(LoaderUsageError, match="needs in_order=True with num_workers > 0"):
        sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, num_workers=2, in_order=False)


def test_pin_memory_device_that_torch_cannot_take_is_refused_naming_torch():
    # torch 2.4 to 2.8 at least take len() of pin_memory_device at iter() (a device name, a
    # str); 2.11 and later deprecate it and accept None. Found by asking the installed torch.
    try:
        iter(DataLoader([0], pin_memory_device=None))
        fails = False
    except TypeError:
        fails = True
    assert _arguments._device_must_be_a_name() is fails
    if fails:
        with pytest.raises(LoaderUsageError, match=re.escape(f"pin_memory_device=None: torch {torch.__version__}'s")):
            sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, pin_memory_device=None)
    else:
        loader = sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, pin_memory_device=None, seed=0)
        assert len(list(loader)) == 3
    assert len(list(sl.SavableDataLoader(RandomMapDataset(6), batch_size=2, pin_memory_device=""))) == 3


@pytest.mark.parametrize("takes_names_only", [True, False])
def test_each_pin_memory_device_shape(monkeypatch, takes_names_only):
    monkeypatch.setattr(_arguments, "_device_must_be_a_name", lambda: takes_names_only)
    assert _arguments.torch_keyword_arguments(pin_memory_device="cuda") == {"pin_memory_device": "cuda"}
    if takes_names_only:
        with pytest.raises(LoaderUsageError, match="takes a device name .* not a device"):
            _arguments.torch_keyword_arguments(pin_memory_device=torch.device("cpu"))
    else:
        assert _arguments.torch_keyword_arguments(pin_memory_device=None) == {"pin_memory_device": None}

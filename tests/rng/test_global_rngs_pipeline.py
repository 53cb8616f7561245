"""``SavableDataLoader(global_rngs=...)`` on savable pipelines and plain torch
IterableDatasets: only the generators listed are re-seeded (in ``mark_sample`` and before
every item), the others held in a fixed state and checked per item.

A pipeline that keeps to its declaration gets the default's data and resumes exactly at
every step and between epochs, with 0 and 2 workers; a state or restore key of one
setting is refused under another (code that reads a left-out generator without drawing,
``torch.initial_seed()`` or ``fork_rng``, sees its fixed state: other data without a
draw to see), and such code is exact within one setting; a draw from a generator left out (in one sample
only, in BatchDataset's collate function, a Gaussian taken from a cache primed before
the item, in the loader's collate function) raises ``UndeclaredRngError`` naming the
generator and the fix, in the main process too when it happened in a worker; in the
main process the caller's streams are left as they are and its draws between batches
are its own."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

import savable_loader as sl
from savable_loader.errors import RestoreKeyError, UndeclaredRngError
from savable_loader.rng import GLOBAL_RNG_NAMES, capture_global
from savable_loader.rng.global_rngs import global_rngs_setting
from savable_loader.state import RestoreKey
from savable_loader.wrappers import BatchDataset, MapDataset
from tests.common import (
    RangeSource,
    assert_same,
    assert_streams,
    check_resume_everywhere,
    empty_numpy_gaussian_cache,
    epochs_of,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::savable_loader.sources.ReplayWarning")]

N = 14
SEED = 3
#: The fix the message names for a draw from NumPy's under ("torch",) or ().
NUMPY_FIX = "Pass global_rngs=('numpy', 'torch')"


class Quiet(RangeSource):
    """RangeSource's integers (worker w of W takes w, w+W, ..., each marked with
    ``mark_sample``) as float tensors, without its draws: from no global RNG."""

    @staticmethod
    def _build(value: int) -> torch.Tensor:
        return torch.tensor([float(value)])


# -- the maps (module level: cloudpickled into workers) ----------------------------------


def torch_noise(x: torch.Tensor) -> torch.Tensor:
    """Draws from torch's global RNG only (as torchvision's transforms do)."""
    return torch.cat([x, torch.rand(1), torch.randn(1)])


def no_draw(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x / 7])


CULPRIT = 9


def numpy_once(x: torch.Tensor) -> torch.Tensor:
    """Hostile: draws from NumPy's global RNG for sample ``CULPRIT`` only."""
    extra = float(np.random.rand()) if int(x[0]) == CULPRIT else 0.0
    return torch.cat([torch_noise(x), torch.tensor([extra])])


def numpy_gauss_first(x: torch.Tensor) -> torch.Tensor:
    """Hostile: sample 0 takes one Gaussian from NumPy's global RNG (the cached one, if
    the cache was primed before the item: the Mersenne Twister words do not move)."""
    return torch.cat([x, torch.tensor([float(np.random.randn()) if int(x[0]) == 0 else 0.0])])


def python_gauss_first(x: torch.Tensor) -> torch.Tensor:
    """Hostile: sample 0 takes one Gaussian from Python's random (``gauss_next``)."""
    return torch.cat([x, torch.tensor([random.gauss(0.0, 1.0) if int(x[0]) == 0 else 0.0])])


def collate_with_random(samples: list[torch.Tensor]) -> torch.Tensor:
    """BatchDataset's collate function drawing from Python's random for odd batches."""
    batch = torch.stack(samples)
    return batch * (1 + random.random()) if int(batch[0, 0]) % 2 else batch


def pipeline(
    num_workers: int = 0,
    global_rngs: Any = ("torch",),
    fn: Callable[[torch.Tensor], torch.Tensor] = torch_noise,
    batch_collate: Callable[[list[Any]], Any] | None = None,
    n: int = N,
    **kw: Any,
) -> sl.SavableDataLoader:
    """Quiet source -> MapDataset(fn) -> BatchDataset(3), under ``global_rngs``."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=SEED)
    ds = BatchDataset(MapDataset(Quiet(n, wc), fn), batch_size=3, collate_fn=batch_collate)
    return sl.SavableDataLoader(
        ds,
        batch_size=None,
        worker_config=wc,
        global_rngs=global_rngs,
        multiprocessing_context="fork" if num_workers else None,
        **kw,
    )


def drain(loader: Any) -> tuple[list[Any], BaseException | None]:
    """The items of one epoch up to the first error, and the error (None: none)."""
    got: list[Any] = []
    it = iter(loader)
    try:
        while True:
            got.append(next(it))
    except StopIteration:
        return got, None
    except Exception as e:  # the error under test, checked by the caller
        return got, e


# -- exact, and the default's data -------------------------------------------------------


@pytest.mark.parametrize(("fn", "global_rngs"), [(torch_noise, ("torch",)), (no_draw, ())])
def test_a_pipeline_that_keeps_to_its_declaration_gets_the_default_data(fn: Any, global_rngs: Any) -> None:
    for workers in (0, 2):
        default = epochs_of(pipeline(workers, None, fn), 2)
        assert len(default[0]) == (5 if workers == 0 else 6)  # a short last batch per worker
        assert default[0][0].shape == ((3, 3) if fn is torch_noise else (3, 2))
        got = epochs_of(pipeline(workers, global_rngs, fn), 2)
        for e in (0, 1):
            assert_streams(got[e], default[e], f"{global_rngs} with {workers} workers, epoch {e}")


@pytest.mark.parametrize(
    ("num_workers", "fn", "global_rngs"),
    [(0, torch_noise, ("torch",)), (2, torch_noise, ("torch",)), (0, no_draw, ()), (2, no_draw, ())],
)
def test_resume_at_every_step(num_workers: int, fn: Any, global_rngs: Any) -> None:
    steps = None if num_workers == 0 else [0, 1, 2, 4, 5, 6, 8]
    made = check_resume_everywhere(lambda: pipeline(num_workers, global_rngs, fn), 2, steps=steps)
    assert made >= 7


@pytest.mark.parametrize(
    ("saved_under", "restored_under"),
    [(None, ()), ((), None), (("torch",), None), (None, ("torch",)), ((), ("torch",))],
)
def test_a_state_of_another_setting_is_refused(saved_under: Any, restored_under: Any) -> None:
    loader = pipeline(0, saved_under, no_draw)
    it = iter(loader)
    next(it)
    state = sl.state.decode(sl.state.encode(loader.save_state_rank()))
    fresh = pipeline(0, restored_under, no_draw)
    with pytest.raises(sl.ConfigMismatchError) as info:
        fresh.restore_state_rank(state)
    saved = global_rngs_setting(saved_under)
    assert (info.value.field, info.value.saved) == ("global_rngs", saved)
    assert f"global_rngs={saved!r}" in str(info.value)
    assert_streams(list(fresh), list(pipeline(0, restored_under, no_draw)), "after the refused restore")


def _forked_draw() -> int:
    with torch.random.fork_rng(devices=[]):
        return int(torch.randint(0, 10**6, ()))


class PeekTorch(RangeSource):
    """Hostile: reads torch's RNG without moving it (``fork_rng``, ``initial_seed``)."""

    @staticmethod
    def _build(value: int) -> torch.Tensor:
        return torch.tensor([value, _forked_draw(), torch.initial_seed() % 1000])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_code_that_peeks_at_a_generator_left_out_resumes_exactly(num_workers: int) -> None:
    # () leaves torch out: fork_rng and initial_seed see its fixed state, the same in
    # every worker and after every restore (the caller draws between batches)
    def make() -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=SEED)
        return sl.SavableDataLoader(
            BatchDataset(PeekTorch(N, wc), 3), batch_size=None, worker_config=wc, global_rngs=()
        )

    torch.manual_seed(0)
    reference = []
    for batch in make():
        reference.append(batch)
        torch.rand(2)  # the training loop draws
    assert len({int(v) for b in reference for v in b[:, 1]}) == 1  # the fixed state: one peek value
    steps = None if num_workers == 0 else [0, 1, 3]
    assert check_resume_everywhere(make, 2, steps=steps) >= 3


class DrawsAtTheEnd(Quiet):
    """Hostile: draws from NumPy's RNG after its last sample (in the next() that ends)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from super().__iter__()
        self.tail = float(np.random.rand())


def test_a_draw_as_the_epoch_ends_raises() -> None:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=SEED)
    loader = sl.SavableDataLoader(
        BatchDataset(MapDataset(DrawsAtTheEnd(12, wc), no_draw), 3),
        batch_size=None,
        worker_config=wc,
        global_rngs=("torch",),
    )
    got, error = drain(loader)
    assert len(got) == 4 and isinstance(error, UndeclaredRngError)
    assert "the end of worker 0's epoch 0" in str(error)


def test_the_state_file_keeps_the_setting() -> None:
    for global_rngs, recorded, fn in ((("torch",), ["torch"], torch_noise), ((), [], no_draw), (None, None, no_draw)):
        loader = pipeline(0, global_rngs, fn)
        it = iter(loader)
        first = next(it)
        state = sl.state.decode(sl.state.encode(loader.save_state_rank()))
        assert state.config.global_rngs == (list(GLOBAL_RNG_NAMES) if recorded is None else recorded)
        fresh = pipeline(0, global_rngs, fn)
        fresh.restore_state_rank(state)
        reference = list(pipeline(0, global_rngs, fn))
        assert_same(first, reference[0])
        assert_streams(list(fresh), reference[1:], f"restored under {global_rngs}")


@pytest.mark.parametrize("value", [["np"], ["torch", "torch"], ["random"], ["torch", "numpy"], "torch", 5])
def test_a_malformed_recorded_setting_is_refused(value: Any) -> None:
    loader = pipeline(0, ("torch",))
    it = iter(loader)
    next(it)
    key = loader.restore_key
    state = loader.save_state_rank()
    bad = msgspec.structs.replace(state, config=msgspec.structs.replace(state.config, global_rngs=value))
    fresh = pipeline(0, ("torch",))
    with pytest.raises(sl.ConfigMismatchError, match="global_rngs"):
        fresh.restore_state_rank(bad)
    assert_streams(list(fresh), list(pipeline(0, ("torch",))), "after the refused restore")
    with pytest.raises(RestoreKeyError, match="key.global_rngs"):
        pipeline(0, ("torch",)).restore_sample(msgspec.structs.replace(key, global_rngs=value))
    edited = json.loads(str(key))
    edited["global_rngs"] = value
    with pytest.raises(RestoreKeyError):
        pipeline(0, None).restore_sample(json.dumps(edited))


# -- never silently inexact --------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("global_rngs", [("torch",), ("random", "torch")])
def test_a_draw_from_numpy_on_one_sample_raises(num_workers: int, global_rngs: Any) -> None:
    reference = list(pipeline(num_workers, GLOBAL_RNG_NAMES, numpy_once))
    got, error = drain(pipeline(num_workers, global_rngs, numpy_once))
    assert isinstance(error, UndeclaredRngError), error  # the type, in the main process too
    message = str(error)
    assert "drew from NumPy's global RNG (np.random) (in the pipeline)" in message
    assert f"global_rngs={global_rngs!r} does not list 'numpy'" in message
    assert f"Pass global_rngs={tuple(sorted({*global_rngs, 'numpy'}))!r}" in message
    worker = CULPRIT % num_workers if num_workers else 0
    item = list(range(worker, N, max(num_workers, 1))).index(CULPRIT) // 3  # BatchDataset(3) in its worker
    assert f"item {item} of worker {worker} in epoch 0" in message
    if num_workers == 0:
        assert len(got) == item  # every item before the culprit's came
    # what came before the error is the default's data (the culprit's column aside)
    assert_streams([b[:, :3] for b in got], [b[:, :3] for b in reference[: len(got)]], "before the error")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_draw_from_torch_under_empty_raises(num_workers: int) -> None:
    got, error = drain(pipeline(num_workers, (), torch_noise))
    assert got == [] and isinstance(error, UndeclaredRngError), error
    message = str(error)
    assert "drew from torch's CPU RNG" in message and "global_rngs=() does not list 'torch'" in message
    assert "Pass global_rngs=('torch',)" in message


@pytest.mark.parametrize("global_rngs", [("torch",), ()])
def test_a_gaussian_taken_from_a_cache_primed_before_the_item_is_seen(global_rngs: Any) -> None:
    # In the main process nothing left out is re-seeded: the caller's cached Gaussians are
    # there at item start, and the item's single Gaussian takes one without moving the
    # Mersenne Twister words. It must still raise.
    for draws, name in ((numpy_gauss_first, "NumPy's"), (python_gauss_first, "Python's")):
        loader = pipeline(0, global_rngs, draws)
        np.random.seed(1)
        random.seed(1)
        if draws is numpy_gauss_first:
            np.random.randn()
            assert np.random.get_state(legacy=False)["has_gauss"] == 1
        else:
            random.gauss(0.0, 1.0)
            assert random.getstate()[2] is not None  # gauss_next cached
        got, error = drain(loader)
        assert got == [] and isinstance(error, UndeclaredRngError), (name, error)
        assert name in str(error) and "item 0 of worker 0 in epoch 0" in str(error)


def test_a_gaussian_taken_from_a_cache_primed_in_a_worker_init_fn_is_seen() -> None:
    def prime(worker_id: int) -> None:
        np.random.seed(worker_id)
        np.random.randn()  # a cached Gaussian in the worker

    got, error = drain(pipeline(2, ("torch",), numpy_gauss_first, worker_init_fn=prime))
    assert isinstance(error, UndeclaredRngError), error
    assert "NumPy's global RNG" in str(error) and "item 0 of worker 0 in epoch 0" in str(error)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_draw_in_batch_datasets_collate_function_raises(num_workers: int) -> None:
    got, error = drain(pipeline(num_workers, ("torch",), no_draw, collate_with_random))
    assert isinstance(error, UndeclaredRngError), error
    assert "Python's random module" in str(error) and "Pass global_rngs=('random', 'torch')" in str(error)
    # declared, it is exact and the default's data
    declared = epochs_of(pipeline(num_workers, ("random",), no_draw, collate_with_random), 2)
    default = epochs_of(pipeline(num_workers, None, no_draw, collate_with_random), 2)
    for e in (0, 1):
        assert_streams(declared[e], default[e], f"declared, epoch {e}")


def loader_collate_with_numpy(item: torch.Tensor) -> torch.Tensor:
    """The loader's collate function (applied to every pipeline item) drawing from NumPy."""
    return item + float(np.random.rand())


@pytest.mark.parametrize(
    ("num_workers", "global_rngs"),
    [(2, ("torch",)), (2, ()), (0, ("torch",)), (0, None)],
    ids=["2-torch", "2-empty", "0-torch", "0-default"],
)
def test_a_draw_in_the_loaders_collate_function_is_exact_or_raises(num_workers: int, global_rngs: Any) -> None:
    # The loader's collate_fn runs on each item after the pipeline made it (outside the
    # item's seeding and check). A draw there must raise, or resume exactly; never other
    # data. (With 2 workers the default is exact: the item re-seeded NumPy's just before.)
    def make() -> sl.SavableDataLoader:
        return pipeline(num_workers, global_rngs, no_draw, collate_fn=loader_collate_with_numpy)

    try:
        reference = epochs_of(make(), 2)
    except UndeclaredRngError as e:
        assert "NumPy's global RNG" in str(e)
        return
    check_resume_everywhere(make, 2, steps=[0, 1, 2, 5, 7], reference=reference)


# -- the caller's streams in the main process --------------------------------------------


def _draw_all() -> tuple[float, float, float, float, float]:
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        float(torch.rand(())),
    )


@pytest.mark.parametrize(("global_rngs", "fn"), [((), no_draw), (("torch",), torch_noise)])
def test_the_callers_streams_are_left_as_they_are(global_rngs: Any, fn: Any) -> None:
    def seed_all() -> None:
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)

    seed_all()
    expected = []  # the caller's draws without any loader, NumPy's cached Gaussian dropped at each next()
    for _ in range(7):
        expected.append(_draw_all())
        empty_numpy_gaussian_cache()
    reference = list(pipeline(0, global_rngs, fn))
    loader = pipeline(0, global_rngs, fn)
    seed_all()
    drawn = [_draw_all()]  # leaves cached Gaussians in Python's and NumPy's
    got = []
    for batch in loader:  # the caller draws between batches: its own stream, no error
        got.append(batch)
        drawn.append(_draw_all())
    assert len(drawn) == 6
    drawn.append(_draw_all())
    assert drawn == expected
    assert_streams(got, reference, "with the caller's draws between batches")
    seed_all()
    for _ in range(3):
        _draw_all()
    before = capture_global()
    list(pipeline(0, global_rngs, fn))  # a whole epoch between two looks: nothing moved
    after = capture_global()
    assert before.python == after.python and torch.equal(before.torch, after.torch)
    assert all(np.array_equal(a, b) for a, b in zip(before.numpy[:3], after.numpy[:3]))
    assert after.numpy[3] == 0  # but NumPy's cached Gaussian


def test_the_caller_taking_its_cached_gaussian_between_batches_is_not_an_error() -> None:
    # The caller's np.random.randn() between batches takes its cached Gaussian (the words do
    # not move, the cache empties): a draw outside any item, not the data's.
    np.random.seed(0)
    np.random.randn()  # a cached Gaussian
    loader = pipeline(0, ("torch",), no_draw)
    got = []
    for batch in loader:
        got.append(batch)
        np.random.randn()  # alternately takes the cache and fills it
    assert_streams(got, list(pipeline(0, None, no_draw)), "with the caller's Gaussians between batches")


def test_an_item_taking_a_gaussian_the_caller_put_back_raises() -> None:
    # The caller puts back a NumPy state holding a cached Gaussian between batches (the same
    # Mersenne Twister words as at the previous item): an item that takes it drew from
    # NumPy's stream, which would not resume exactly; it must raise.
    def takes_at_three(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.tensor([float(np.random.randn()) if int(x[0]) == 3 else 0.0])])

    np.random.seed(0)
    np.random.randn()
    cached = np.random.get_state()
    np.random.randn()  # the cache taken: the words as in `cached`, no Gaussian cached
    loader = pipeline(0, ("torch",), takes_at_three)
    it = iter(loader)
    next(it)  # item 0: samples 0..2
    np.random.set_state(cached)
    with pytest.raises(UndeclaredRngError, match="NumPy's global RNG"):
        next(it)  # item 1: sample 3 takes the cached Gaussian


# -- restore keys ------------------------------------------------------------------------


def keyed(loader: sl.SavableDataLoader, epochs: int = 2) -> list[tuple[RestoreKey, Any]]:
    return [(loader.restore_key, item) for _ in range(epochs) for item in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restore_keys_carry_the_setting_and_rebuild_under_it_only(num_workers: int) -> None:
    run = keyed(pipeline(num_workers, ("torch",)))
    default_run = keyed(pipeline(num_workers, None))
    assert_streams([b for _, b in run], [b for _, b in default_run], "the default's data")
    key = run[3][0]
    assert key.global_rngs == ("torch",) and '"global_rngs":["torch"]' in str(key)
    assert all("global_rngs" not in str(k) for k, _ in default_run)  # the default is left out
    assert all(k.global_rngs == GLOBAL_RNG_NAMES for k, _ in default_run)
    same, default = pipeline(0, ("torch",)), pipeline(0, None)
    for (k, item), (dk, ditem) in zip(run, default_run):
        assert_same(same.restore_sample(k), item, f"{k} under ('torch',)")
        assert_same(same.restore_sample(str(k)), item, f"str({k}) under ('torch',)")
        assert_same(default.restore_sample(dk), ditem, f"{dk} under the default")
    with pytest.raises(RestoreKeyError, match="key.global_rngs"):
        default.restore_sample(key)
    with pytest.raises(RestoreKeyError, match="key.global_rngs"):
        same.restore_sample(default_run[0][0])
    quiet = keyed(pipeline(num_workers, (), no_draw), 1)
    assert quiet[0][0].global_rngs == () and '"global_rngs":[]' in str(quiet[0][0])
    for k, item in quiet:
        assert_same(pipeline(0, (), no_draw).restore_sample(str(k)), item, f"{k} under ()")


def test_restore_sample_raises_for_a_draw_left_out_and_leaves_the_callers_streams() -> None:
    # keys of the default run, as ("torch",) would have made them (its own run raises at the culprit)
    run = [(msgspec.structs.replace(k, global_rngs=("torch",)), b) for k, b in keyed(pipeline(0, None, numpy_once), 1)]
    culprit = next(k for k, b in run if CULPRIT in b[:, 0].tolist())
    loader = pipeline(0, ("torch",), numpy_once)
    others = [(k, b) for k, b in run if k is not culprit]
    np.random.seed(2)
    random.seed(2)
    torch.manual_seed(2)
    before = capture_global()
    for k, b in others:  # the items without the numpy draw: exact
        assert_same(loader.restore_sample(k), b)
    with pytest.raises(UndeclaredRngError, match="NumPy's global RNG .*restore_sample"):
        loader.restore_sample(culprit)
    after = capture_global()
    assert before.python == after.python and torch.equal(before.torch, after.torch)
    assert all(np.array_equal(a, b) for a, b in zip(before.numpy, after.numpy))


# -- plain torch IterableDatasets --------------------------------------------------------


class TorchStream(IterableDataset):
    """Integers below ``n`` split across workers, each with a draw from torch's RNG
    (and from NumPy's at ``numpy_at``, if set)."""

    def __init__(self, n: int = 13, numpy_at: int | None = None) -> None:
        self.n, self.numpy_at = n, numpy_at

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            extra = float(np.random.rand()) if i == self.numpy_at else 0.0
            yield torch.tensor([float(i), float(torch.rand(())), extra])


def stream(num_workers: int = 0, global_rngs: Any = ("torch",), numpy_at: int | None = None) -> sl.SavableDataLoader:
    return sl.SavableDataLoader(
        TorchStream(numpy_at=numpy_at),
        batch_size=2,
        num_workers=num_workers,
        seed=SEED,
        global_rngs=global_rngs,
        multiprocessing_context="fork" if num_workers else None,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_that_keeps_to_its_declaration(num_workers: int) -> None:
    default = epochs_of(stream(num_workers, None), 2)
    got = epochs_of(stream(num_workers, ("torch",)), 2)
    for e in (0, 1):
        assert_streams(got[e], default[e], f"epoch {e}")
    steps = None if num_workers == 0 else [0, 1, 3, 4, 7]
    assert check_resume_everywhere(lambda: stream(num_workers, ("torch",)), 2, steps=steps) >= 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_drawing_from_numpy_raises(num_workers: int) -> None:
    got, error = drain(stream(num_workers, ("torch",), numpy_at=6))
    assert isinstance(error, UndeclaredRngError), error
    assert "NumPy's global RNG" in str(error) and NUMPY_FIX in str(error)
    assert all(6 not in b[:, 0].tolist() for b in got)


def batch_with_numpy(samples: list[torch.Tensor]) -> torch.Tensor:
    """A batching collate function with a draw from NumPy (mixup-like)."""
    return default_collate(samples) + float(np.random.rand())


@pytest.mark.parametrize(
    ("num_workers", "global_rngs"),
    [(2, ("torch",)), (0, ("torch",)), (0, None)],
    ids=["2-torch", "0-torch", "0-default"],
)
def test_a_draw_in_an_iterable_datasets_collate_function_is_exact_or_raises(num_workers: int, global_rngs: Any) -> None:
    # batch_size=2: the loader's collate_fn batches the stream's items, after they were
    # made (outside their seeding and check). Exact, or an error; never other data.
    def make() -> sl.SavableDataLoader:
        return sl.SavableDataLoader(
            TorchStream(),
            batch_size=2,
            num_workers=num_workers,
            seed=SEED,
            global_rngs=global_rngs,
            collate_fn=batch_with_numpy,
            multiprocessing_context="fork" if num_workers else None,
        )

    try:
        reference = epochs_of(make(), 2)
    except UndeclaredRngError as e:
        assert "NumPy's global RNG" in str(e)
        return
    check_resume_everywhere(make, 2, steps=[0, 1, 2, 5], reference=reference)

"""``SavableDataLoader(global_rngs=...)``: only the declared global RNGs re-seeded per
sample on the drop-in path, the others guarded per batch. Exact resume at every step
with 0 and 2 workers; the same data as the default for a dataset that keeps to its
declaration; a clear UndeclaredRngError (never silently other data) for a batch that
draws from a generator left out, in a sample (some samples only), in the collate
function; none for draws in a worker_init_fn or between batches; the setting in states
and restore keys, another one refused; ``global_rngs=()`` re-seeds none and checks all
three; pipelines and IterableDatasets take the setting (tests/rng/test_global_rngs_pipeline.py);
the parts (setting, seeder, guard)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, default_collate

import savable_loader as sl
from savable_loader.errors import RestoreKeyError, UndeclaredRngError
from savable_loader.rng import GLOBAL_RNG_NAMES, capture_global, global_seeder, seed_global
from savable_loader.rng.global_rngs import GlobalRngs, global_rngs_setting
from tests.common import RangeSource, assert_streams, check_resume_everywhere

pytestmark = pytest.mark.timeout(300)

N = 23


class TorchOnly:
    """Draws from torch's global RNG only (as torchvision's transforms do)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(())), float(torch.randn(()))])


class NumpyAndTorch(TorchOnly):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(np.random.rand()), float(np.random.randn()), float(torch.rand(()))])


class NoDraws(TorchOnly):
    """Draws from no global RNG (a reader, a tokenizer): fine under ``global_rngs=()``."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(i) / 7])


class SometimesNumpy(TorchOnly):
    """Hostile: draws from NumPy's global RNG for one sample only (index ``culprit``)."""

    culprit = 11

    def __getitem__(self, i: int) -> torch.Tensor:
        x = float(np.random.rand()) if i == self.culprit else 0.0
        return torch.tensor([float(i), float(torch.rand(())), x])


class SometimesGauss(TorchOnly):
    """Hostile: one sample calls ``random.gauss`` (Python's cached ``gauss_next``)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        x = random.gauss(0.0, 1.0) if i == 5 else 0.0
        return torch.tensor([float(i), float(torch.rand(())), x])


class SeedsNumpyByIndex(TorchOnly):
    """A common idiom: np.random.seed(index) in __getitem__, then a NumPy draw."""

    def __getitem__(self, i: int) -> torch.Tensor:
        np.random.seed(i)
        return torch.tensor([float(i), float(torch.rand(())), float(np.random.rand())])


class PeeksAndPutsBack(TorchOnly):
    """Draws from NumPy's global RNG and puts its state back (a library that "does not
    disturb" the global stream): not detectable, exact because the generators left out
    are in a fixed state of (seed, epoch) before every batch, in every process."""

    def __getitem__(self, i: int) -> torch.Tensor:
        state = np.random.get_state()
        x = float(np.random.rand())
        np.random.set_state(state)
        return torch.tensor([float(i), float(torch.rand(())), x])


@pytest.fixture(autouse=True)
def _keep_numpys_bit_generator() -> Any:
    """The guard tests below put NumPy's global RandomState on the fixed state's PCG64."""
    bit = np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(bit)


def make(
    dataset: Any = None, num_workers: int = 0, global_rngs: Any = ("torch",), batch_size: int | None = 4, **kw: Any
) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=3)
    return sl.SavableDataLoader(
        TorchOnly() if dataset is None else dataset,
        batch_size=batch_size,
        shuffle=True,
        worker_config=wc,
        global_rngs=global_rngs,
        multiprocessing_context="fork" if num_workers else None,
        **kw,
    )


# -- exact, and the default's data ------------------------------------------------------


@pytest.mark.parametrize(
    ("num_workers", "dataset", "global_rngs", "reseed"),
    [
        (0, TorchOnly, ("torch",), "sample"),
        (0, NumpyAndTorch, ("numpy",), "sample"),
        (0, TorchOnly, ("torch",), "batch"),
        (0, PeeksAndPutsBack, ("torch",), "sample"),
        (2, TorchOnly, ("torch",), "sample"),
        (2, NumpyAndTorch, ("numpy", "torch"), "batch"),
    ],
)
def test_resume_at_every_step(num_workers: int, dataset: type, global_rngs: Any, reseed: str) -> None:
    steps = None if num_workers == 0 else [0, 1, 3, 5, 6, 8, 11]
    made = check_resume_everywhere(lambda: make(dataset(), num_workers, global_rngs, reseed=reseed), 2, steps=steps)
    assert made >= 7


@pytest.mark.parametrize(("dataset", "global_rngs"), [(TorchOnly, ("torch",)), (NumpyAndTorch, ("numpy", "torch"))])
def test_a_dataset_that_keeps_to_its_declaration_gets_the_default_data(dataset: type, global_rngs: Any) -> None:
    # the declared generators get the default's seeds: the setting changes the cost, not the data
    default = [list(make(dataset(), 0, None)) for _ in range(1)][0]
    for workers in (0, 2):
        assert_streams(list(make(dataset(), workers, global_rngs)), default, f"{workers} workers")
    unbatched = list(make(dataset(), 0, global_rngs, batch_size=None))
    assert_streams(unbatched, list(make(dataset(), 0, None, batch_size=None)), "unbatched")


def test_draws_put_back_are_the_same_in_every_process_and_epoch_order() -> None:
    in_process = list(make(PeeksAndPutsBack(), 0))
    assert_streams(list(make(PeeksAndPutsBack(), 2)), in_process, "2 workers")
    peeks = {float(b[k, 2]) for b in in_process for k in range(len(b))}
    assert len(peeks) == 1  # the fixed state of (seed, epoch): one value in every batch


def test_the_callers_streams_are_left_alone_in_the_main_process() -> None:
    loader = make(NumpyAndTorch(), 0, ("numpy",))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    random.gauss(0, 1)  # a cached gauss_next in the caller's stream
    np.random.randn()  # and a cached Gaussian in NumPy's
    before = capture_global()
    list(loader)
    after = capture_global()
    assert before.python == after.python and torch.equal(before.torch, after.torch)
    assert all(np.array_equal(a, b) for a, b in zip(before.numpy[:3], after.numpy[:3]))  # words and position
    assert before.numpy[3] == 1 and after.numpy[3] == 0  # NumPy's cached Gaussian dropped (documented)


def test_a_worker_init_fn_may_draw_and_reseed_the_generators_left_out() -> None:
    def init(worker_id: int) -> None:  # the classic recipe, plus draws
        np.random.seed(torch.initial_seed() % 2**32)
        np.random.rand(3)
        random.random()
        random.gauss(0, 1)

    reference = list(make(TorchOnly(), 0))
    assert_streams(list(make(TorchOnly(), 2, worker_init_fn=init)), reference, "worker_init_fn")


# -- never silently inexact -------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_draw_from_a_generator_left_out_on_some_samples_raises(num_workers: int) -> None:
    loader = make(SometimesNumpy(), num_workers)
    order = [int(i) for b in make(TorchOnly(), 0) for i in b[:, 0]]
    culprit_batch = order.index(SometimesNumpy.culprit) // 4
    got = []
    it = iter(loader)
    with pytest.raises(UndeclaredRngError) as info:
        while True:  # StopIteration (no error) fails the test
            got.append(next(it))
    assert len(got) == culprit_batch  # every batch before the culprit's came, none after
    message = str(info.value)
    assert "NumPy's global RNG (np.random)" in message
    assert "global_rngs=('torch',) does not list 'numpy'" in message
    assert "Pass global_rngs=('numpy', 'torch')" in message
    assert f"from position {culprit_batch * 4} of epoch 0" in message


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seeding_numpy_in_the_dataset_while_it_is_left_out_raises_what_to_declare(num_workers: int) -> None:
    with pytest.raises(UndeclaredRngError, match=r"(NumPy|np.random.seed).*Pass global_rngs=\(.numpy., .torch.\)"):
        list(make(SeedsNumpyByIndex(), num_workers))
    declared = list(make(SeedsNumpyByIndex(), num_workers, ("numpy",)))
    assert_streams(declared, list(make(SeedsNumpyByIndex(), 0, None)), "declared: the default's data")


def test_a_gauss_draw_from_pythons_random_raises() -> None:
    with pytest.raises(UndeclaredRngError, match="Python's random module.*Pass global_rngs=\\('random', 'torch'\\)"):
        list(make(SometimesGauss(), 0))
    with pytest.raises(UndeclaredRngError, match="Python's random module"):
        list(make(SometimesGauss(), 0, reseed="batch"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_draw_in_the_collate_function_raises(num_workers: int) -> None:
    def collate(samples: list[Any]) -> Any:
        batch = default_collate(samples)
        return batch * (1 + random.random()) if int(batch[0, 0]) % 2 else batch

    with pytest.raises(UndeclaredRngError, match="Python's random module"):
        list(make(TorchOnly(), num_workers, collate_fn=collate))
    assert len(list(make(TorchOnly(), num_workers, ("random",), collate_fn=collate))) == 6  # declared: fine


def test_the_batches_after_a_refused_one_come_as_in_a_run_without_it() -> None:
    # the guard puts the generators left out back in their fixed state before the next batch
    loader = make(SometimesNumpy(), 0)
    got: list[Any] = []
    it = iter(loader)
    errors = 0
    while True:
        try:
            got.append(next(it))
        except UndeclaredRngError:
            errors += 1
        except StopIteration:
            break
    reference = [b for b in make(TorchOnly(), 0) if SometimesNumpy.culprit not in b[:, 0].tolist()]
    assert errors == 1
    assert_streams([b[:, :2] for b in got], [b[:, :2] for b in reference], "after the refused batch")


# -- the setting: arguments, states, restore keys ---------------------------------------


def test_the_setting_is_normalised_and_checked() -> None:
    assert global_rngs_setting(None) == GLOBAL_RNG_NAMES
    assert global_rngs_setting("torch") == ("torch",)
    assert global_rngs_setting(["random"]) == ("random", "torch")
    assert global_rngs_setting({"numpy", "torch", "random"}) == GLOBAL_RNG_NAMES
    for empty in ((), [], set(), frozenset()):  # any empty collection: re-seed none, check all three
        assert global_rngs_setting(empty) == ()
        assert make(NoDraws(), global_rngs=empty).save_state_rank().config.global_rngs == []
    with pytest.raises(sl.LoaderUsageError, match="global_rngs names \\['np'\\]"):
        make(global_rngs=("np",))
    with pytest.raises(sl.LoaderUsageError, match="must be a tuple of names"):
        make(global_rngs=5)
    with pytest.raises(sl.LoaderUsageError, match="must be a tuple of names"):
        make(global_rngs=[torch.default_generator])
    # pipelines and plain IterableDatasets take the setting too (tests/rng/test_global_rngs_pipeline.py)
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    pipeline = sl.SavableDataLoader(RangeSource(5, wc), batch_size=None, worker_config=wc, global_rngs=("numpy",))
    assert pipeline.save_state_rank().config.global_rngs == ["numpy", "torch"]

    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(3))

    stream = sl.SavableDataLoader(Stream(), global_rngs=())
    assert [int(x) for x in stream] == [0, 1, 2]
    assert stream.save_state_rank().config.global_rngs == []


def test_global_rngs_empty_reseeds_none_and_checks_all_three() -> None:
    # the drop-in path under (): a dataset that draws nothing gets the default's data
    assert_streams(list(make(NoDraws(), 0, ())), list(make(NoDraws(), 0, None)), "()")
    assert_streams(list(make(NoDraws(), 2, ())), list(make(NoDraws(), 0, None)), "() with 2 workers")
    with pytest.raises(UndeclaredRngError) as info:  # a draw from torch is not re-seeded either
        list(make(TorchOnly(), 0, ()))
    assert "torch's CPU RNG" in str(info.value) and "Pass global_rngs=('torch',)" in str(info.value)

    class GaussOnce(NoDraws):
        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([float(i), random.gauss(0.0, 1.0) if i == 5 else 0.0])

    with pytest.raises(UndeclaredRngError, match="Python's random module.*Pass global_rngs=\\('random', 'torch'\\)"):
        list(make(GaussOnce(), 2, ()))


def test_states_record_the_setting_and_another_one_is_refused() -> None:
    loader = make()
    it = iter(loader)
    next(it)
    state = sl.state.decode(sl.state.encode(loader.save_state_rank()))
    assert state.config.global_rngs == ["torch"]
    with pytest.raises(sl.ConfigMismatchError) as info:
        make(global_rngs=None).restore_state_rank(state)
    assert (info.value.field, info.value.saved, info.value.current) == ("global_rngs", ("torch",), GLOBAL_RNG_NAMES)
    assert "global_rngs=('torch',)" in str(info.value)
    default_state = make(global_rngs=None).save_state_rank()
    assert default_state.config.global_rngs == list(GLOBAL_RNG_NAMES)
    with pytest.raises(sl.ConfigMismatchError, match="global_rngs"):
        make(global_rngs=("random",)).restore_state_rank(default_state)
    fresh = make(num_workers=2)  # num_workers may change
    fresh.restore_state_rank(state)
    assert_streams(list(fresh), list(make())[1:], "restored")


def test_restore_keys_carry_the_setting() -> None:
    loader = make()
    batches = [(loader.restore_key, b) for b in loader]
    key, batch = batches[2]
    assert key.global_rngs == ("torch",) and '"global_rngs":["torch"]' in str(key)
    assert torch.equal(make().restore_sample(str(key)), batch)
    with pytest.raises(RestoreKeyError, match="global_rngs"):
        make(global_rngs=None).restore_sample(key)
    plain = make(global_rngs=None)
    plain_key = [plain.restore_key for _ in plain][0]
    assert "global_rngs" not in str(plain_key)  # the default is left out, as earlier versions wrote keys
    with pytest.raises(RestoreKeyError, match="global_rngs"):
        make().restore_sample(plain_key)


def test_a_sampler_of_the_users_records_and_checks_the_setting_too() -> None:
    def with_sampler(global_rngs: Any) -> sl.SavableDataLoader:
        ds = TorchOnly()
        return sl.SavableDataLoader(ds, batch_size=4, sampler=list(range(N))[::-1], seed=3, global_rngs=global_rngs)

    loader = with_sampler(("torch",))
    it = iter(loader)
    next(it)
    assert loader.save_state_rank().config.global_rngs == ["torch"]
    key = loader.restore_key
    with pytest.raises(RestoreKeyError, match="global_rngs"):
        with_sampler(None).restore_sample(key)
    with pytest.raises(sl.ConfigMismatchError, match="global_rngs"):
        with_sampler(None).restore_state_rank(loader.save_state_rank())


# -- the parts --------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("torch",), ("numpy", "torch"), ("random", "torch"), ("numpy",), GLOBAL_RNG_NAMES])
def test_the_seeder_seeds_each_declared_generator_as_seed_global(names: tuple[str, ...]) -> None:
    seed = 2**64 - 12345
    seed_global(seed)
    reference = capture_global()
    seed_global(7)
    untouched = capture_global()
    global_seeder(names)(seed)
    got = capture_global()
    for name, ref, old, now in zip(
        ("random", "numpy", "torch"),
        (reference.python, reference.numpy, reference.torch),
        (untouched.python, untouched.numpy, untouched.torch),
        (got.python, got.numpy, got.torch),
    ):
        expected = ref if name in names else old
        if name == "torch":
            assert torch.equal(now, expected), name
        elif name == "numpy":
            assert all(np.array_equal(a, b) for a, b in zip(now, expected)), name
        else:
            assert now == expected, name


def test_the_guard_sees_every_kind_of_draw() -> None:
    guard = GlobalRngs(("torch",))
    draws = [
        lambda: random.random(),
        lambda: random.gauss(0, 1),
        lambda: random.seed(1),
        lambda: np.random.rand(),
        lambda: np.random.randn(),
        lambda: np.random.seed(1),
        lambda: np.random.randint(0, 2**62, size=700),  # a whole Mersenne Twister block and more
    ]
    for draw in draws:
        guard.begin(seed=0, epoch=1)
        guard.check("nothing")
        try:
            draw()
        except TypeError as e:  # np.random.seed() on the fixed state's PCG64: explained
            with pytest.raises(
                UndeclaredRngError, match=r"called np.random.seed\(\).*Pass global_rngs=\('numpy', 'torch'\)"
            ):
                guard.explain(e, "this batch")
            continue
        with pytest.raises(UndeclaredRngError):
            guard.check("this batch")
    guard.begin(seed=0, epoch=1)
    torch.rand(3)
    guard.check("a torch draw")  # torch is always re-seeded: not guarded


def test_draws_from_a_swapped_in_numpy_generator_are_seen() -> None:
    # np.random.set_bit_generator() after the guard was made: draws from the new
    # generator must still raise (the guard compares the generator the RandomState has now)
    old = np.random.get_bit_generator()
    guard = GlobalRngs(("torch",))
    guard.begin(seed=0, epoch=0)
    guard.check("batch 0")
    try:
        np.random.set_bit_generator(np.random.MT19937(5))
        with pytest.raises(UndeclaredRngError):  # the swap itself changed what NumPy draws from
            guard.check("the batch that swapped it")
        for _ in range(3):
            try:
                guard.begin(seed=0, epoch=0)
            except (TypeError, ValueError):  # a bit generator without legacy seeding
                break
            guard.check("a batch without draws")
            np.random.rand()
            with pytest.raises(UndeclaredRngError):
                guard.check("a batch that drew from the swapped-in generator")
    finally:
        np.random.set_bit_generator(old)


def test_numpys_refusal_to_reseed_the_fixed_state_is_explained() -> None:
    # NumPy < 2 refuses np.random.seed() on a bit generator other than MT19937 (the fixed
    # state's PCG64): the loader turns that TypeError into what to declare
    refusal = TypeError("can only re-seed a MT19937 BitGenerator")
    with pytest.raises(UndeclaredRngError, match=r"item 3 called np.random.seed\(\)") as info:
        GlobalRngs(("torch",)).explain(refusal, "item 3")
    assert info.value.__cause__ is refusal
    GlobalRngs(("numpy", "torch")).explain(refusal, "item 3")  # declared: not the loader's doing
    GlobalRngs(("torch",)).explain(TypeError("another"), "item 3")  # another error: left alone

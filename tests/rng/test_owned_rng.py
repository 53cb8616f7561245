"""Generators a map-style dataset owns (savable_loader/rng/owned.py): found, re-seeded
in place per sample, and so resumed exactly at every step.

The datasets draw their "augmentations" from their own ``np.random.Generator``,
``np.random.RandomState``, ``torch.Generator`` and ``random.Random``, held directly, in a
transform object, in a list and in a dict. Before the re-seeding, a resume drew other
numbers (each worker's copy continued its own stream, a fresh loader started from
``__init__``'s state), and two workers drew the same numbers.
"""

from __future__ import annotations

import functools
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import get_worker_info

import savable_loader as sl
from savable_loader.errors import LoaderUsageError
from savable_loader.rng.owned import MAX_DEPTH, MAX_ITEMS, OwnedRngs, find_generators
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of

pytestmark = pytest.mark.timeout(300)


def draw(gen: Any) -> int:
    """One draw in [0, 2**30) from any of the four kinds."""
    if isinstance(gen, np.random.Generator):
        return int(gen.integers(0, 2**30))
    if isinstance(gen, np.random.RandomState):
        return int(gen.randint(0, 2**30))
    if isinstance(gen, torch.Generator):
        return int(torch.randint(0, 2**30, (), generator=gen))
    return gen.randrange(2**30)


class Jitter:
    """A transform object with its own generator (the usual augmentation code)."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def __call__(self, x: int) -> int:
        return draw(self.gen)


def _numpy() -> np.random.Generator:
    return np.random.default_rng(0)


def _legacy() -> np.random.RandomState:
    return np.random.RandomState(0)


def _torch() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _python() -> random.Random:
    return random.Random(0)


MAKERS = {"numpy": _numpy, "randomstate": _legacy, "torch": _torch, "python": _python}


class OwnedRngDataset:
    """Sample i: i and draws from generators held directly, in a transform, in a list of
    transforms and in a dict of transforms."""

    def __init__(self, n: int = 11) -> None:
        self.n = n
        self.rng = np.random.default_rng(0)
        self.transform = Jitter(torch.Generator().manual_seed(0))
        self.transforms = [Jitter(random.Random(0)), Jitter(np.random.RandomState(0))]
        self.by_name = {"flip": Jitter(np.random.default_rng(0))}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [
                i,
                int(self.rng.integers(0, 2**30)),
                self.transform(i),
                self.transforms[0](i),
                self.transforms[1](i),
                self.by_name["flip"](i),
            ]
        )


def loader(num_workers: int = 0, persistent: bool = False, context: str = "fork", **kw: Any) -> sl.SavableDataLoader:
    kw.setdefault("dataset", OwnedRngDataset())
    return sl.SavableDataLoader(
        batch_size=3,
        shuffle=True,
        seed=4,
        num_workers=num_workers,
        persistent_workers=persistent,
        multiprocessing_context=context if num_workers else None,
        **kw,
    )


# -- resume at every step ---------------------------------------------------------------


@pytest.mark.parametrize(
    "num_workers, persistent", [(0, False), (2, False), (2, True)], ids=["0-workers", "2-workers", "2-persistent"]
)
def test_owned_generators_resume_at_every_step(num_workers: int, persistent: bool) -> None:
    checked = check_resume_everywhere(lambda: loader(num_workers, persistent), epochs=2)
    assert checked == 2 * 4 + 1 + 2  # 4 batches an epoch: k = 0..8 and two points between epochs


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_each_kind_alone_resumes_into_the_next_epoch(kind: str) -> None:
    class Own:
        def __init__(self) -> None:
            self.gen = MAKERS[kind]()

        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([i, draw(self.gen), draw(self.gen)])

    check_resume_everywhere(lambda: loader(dataset=Own()), epochs=2)


def test_draws_differ_between_samples_epochs_and_generators() -> None:
    first, second = (torch.stack([row for batch in epoch for row in batch]) for epoch in epochs_of(loader(), 2))
    for column in range(1, first.shape[1]):
        assert len(set(first[:, column].tolist())) == len(first), f"column {column}: repeated draws in an epoch"
    assert not torch.equal(first.sort(0).values[:, 1:], second.sort(0).values[:, 1:]), "epochs draw the same"
    # two generators of the same kind at different paths do not draw alike
    assert not torch.equal(first[:, 1], first[:, 5])


def test_stream_is_the_same_with_any_num_workers_and_start_method() -> None:
    reference = epochs_of(loader(0), 2)
    for other in (loader(2), loader(2, persistent=True), loader(1, context="spawn")):
        for got, want in zip(epochs_of(other, 2), reference):
            assert_streams(got, want, f"num_workers={other.num_workers}")


def test_two_workers_draw_distinct_augmentations() -> None:
    class OneRng:
        def __init__(self) -> None:
            self.rng = np.random.default_rng(0)

        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> float:
            return float(self.rng.random())

    values = torch.cat(list(loader(2, dataset=OneRng(), persistent=True))).tolist()
    # torch's DataLoader gives 20 distinct values here: each worker draws from its own copy
    assert len(set(values)) == 40


def test_generators_replaced_in_worker_init_fn_are_exact() -> None:
    def init(worker_id: int) -> None:  # torch's documented fix for duplicate augmentations
        info = get_worker_info()
        info.dataset.rng = np.random.default_rng(info.seed)

    check_resume_everywhere(lambda: loader(2, worker_init_fn=init), epochs=2, steps=[0, 1, 3, 4, 5, 8])


def test_a_collate_function_s_own_generator_is_reseeded_per_batch() -> None:
    class Mix:
        def __init__(self) -> None:
            self.gen = torch.Generator().manual_seed(0)

        def __call__(self, samples: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(samples) + torch.randint(0, 2**30, (), generator=self.gen)

    check_resume_everywhere(lambda: loader(collate_fn=Mix()), epochs=2)
    check_resume_everywhere(lambda: loader(2, collate_fn=Mix()), epochs=2, steps=[0, 2, 5])


def test_restore_sample_rebuilds_batches_with_owned_draws() -> None:
    live = loader(2)
    run = [(live.restore_key, batch) for _ in range(2) for batch in live]
    fresh = loader(0)
    for key, batch in run:
        assert_streams([fresh.restore_sample(str(key))], [batch], str(key))


# -- in place, depth, limits -------------------------------------------------------------


def test_reseeded_in_place_keeping_the_user_s_objects() -> None:
    ds = OwnedRngDataset()
    ds.alias = ds.transform.gen  # one generator under two names
    before = [ds.rng, ds.transform.gen, ds.transforms[0].gen, ds.transforms[1].gen, ds.by_name["flip"].gen]
    list(loader(dataset=ds))
    after = [ds.rng, ds.transform.gen, ds.transforms[0].gen, ds.transforms[1].gen, ds.by_name["flip"].gen]
    assert all(a is b for a, b in zip(before, after))
    assert ds.alias is ds.transform.gen


def test_paths_found_and_depth() -> None:
    ds = OwnedRngDataset()
    paths = [p for p, _ in find_generators(ds, "dataset")]
    assert paths == [
        "dataset.rng",
        "dataset.transform.gen",
        "dataset.transforms[0].gen",
        "dataset.transforms[1].gen",
        "dataset.by_name['flip'].gen",
    ]

    class Node:
        def __init__(self, child: Any) -> None:
            self.child = child

    deepest = np.random.default_rng(0)
    chain: Any = deepest
    for _ in range(MAX_DEPTH):
        chain = Node(chain)
    assert [p for p, _ in find_generators(chain, "d")] == ["d" + ".child" * MAX_DEPTH]
    assert find_generators(Node(chain), "d") == []  # one step too deep


def test_what_is_not_walked() -> None:
    rng = np.random.default_rng(0)

    class Holder:
        def __init__(self) -> None:
            self.closure = lambda: rng.random()  # inside a closure: reached through the cell
            self.data = [None] * MAX_ITEMS + [np.random.default_rng(1)]  # a large list is data
            self.globals = [torch.default_generator, np.random.mtrand._rand, random.seed.__self__]
            self.partial = functools.partial(draw, torch.Generator())
            self.method = Jitter(random.Random(0)).__call__

    assert [p for p, _ in find_generators(Holder(), "d")] == [
        "d.closure<closure rng>",
        "d.partial.args[0]",
        "d.method.__self__.gen",
    ]


def test_objects_that_resist_inspection_are_skipped() -> None:
    import weakref

    class Gone:
        pass

    class Hostile(dict):
        def items(self):  # type: ignore[override]
            raise RuntimeError("no")

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(name)

    class Holder:
        def __init__(self) -> None:
            gone = Gone()
            self.dead = weakref.proxy(gone)
            del gone
            self.hostile = Hostile(a=1)
            self.rng = torch.Generator()

    assert [p for p, _ in find_generators(Holder(), "d")] == ["d.rng"]


def test_slots_and_class_attributes() -> None:
    class Slotted:
        __slots__ = ("empty", "gen")

        def __init__(self) -> None:
            self.gen = torch.Generator()

    class WithClassRng:
        shared = random.Random(0)

        def __init__(self) -> None:
            self.slotted = Slotted()

    assert [p for p, _ in find_generators(WithClassRng(), "d")] == ["d.shared", "d.slotted.gen"]


def test_seeds_depend_on_position_path_epoch_and_seed_only() -> None:
    def values(ds: OwnedRngDataset, seed: int, epoch: int, position: int) -> list[int]:
        owned = OwnedRngs(ds, None, seed, epoch)
        owned.seed_sample(position)
        return ds[0].tolist()[1:]

    ds = OwnedRngDataset()
    a = values(ds, 0, 0, 5)
    ds[1], ds[2]  # draws in between change nothing
    assert values(ds, 0, 0, 5) == a
    assert values(OwnedRngDataset(), 0, 0, 5) == a  # another copy
    for other in (values(ds, 0, 0, 6), values(ds, 0, 1, 5), values(ds, 1, 0, 5)):
        assert all(x != y for x, y in zip(a, other))


def test_system_random_is_refused_naming_it() -> None:
    class Sys:
        def __init__(self) -> None:
            self.augment = Jitter(random.SystemRandom())

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            return self.augment(i)

    with pytest.raises(LoaderUsageError, match=r"dataset\.augment\.gen is a random\.SystemRandom"):
        list(loader(dataset=Sys()))


def test_other_bit_generators_are_reseeded() -> None:
    for bit in (np.random.Philox, np.random.SFC64, np.random.MT19937, np.random.PCG64DXSM):

        class Own:
            def __init__(self, bit: Any = bit) -> None:
                self.gen = np.random.Generator(bit(0))
                self.legacy = np.random.RandomState(bit(0))

            def __len__(self) -> int:
                return 5

            def __getitem__(self, i: int) -> torch.Tensor:
                return torch.tensor([draw(self.gen), draw(self.legacy)])

        check_resume_everywhere(lambda: loader(dataset=Own()), epochs=2, steps=[0, 1, 2])


# -- savable pipelines: listed generators exact, unlisted ones left alone -----------------


class RngSource(RangeSource):
    """A savable source drawing from a generator it lists in ``_savable_fields``
    (``listed=True``) or only holds."""

    def __init__(self, n: int, worker_config: sl.WorkerConfig, listed: bool) -> None:
        self.listed = listed
        super().__init__(n, worker_config, keyed=False)

    @property
    def _savable_fields(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("pos", "gen") if self.listed else ("pos",)

    def reset_state_own(self) -> None:
        super().reset_state_own()
        if self.listed or not hasattr(self, "gen"):
            self.gen = np.random.default_rng(self.worker_config.rank_worker_id())

    def __iter__(self):
        for value in super().__iter__():
            yield torch.cat([value, torch.tensor([draw(self.gen)])])


def pipeline(num_workers: int, listed: bool) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=2)
    return sl.SavableDataLoader(
        sl.wrappers.BatchDataset(RngSource(13, wc, listed), 2),
        batch_size=None,
        worker_config=wc,
        multiprocessing_context="fork" if num_workers else None,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_listed_pipeline_generators_stay_exact(num_workers: int) -> None:
    check_resume_everywhere(lambda: pipeline(num_workers, listed=True), epochs=2)


def test_unlisted_pipeline_generators_are_left_alone() -> None:
    # Not re-seeded: the source draws its own stream, as before (resuming it is the
    # pipeline's job: list it in _savable_fields).
    draws = torch.cat(list(pipeline(0, listed=False)))[:, -1].tolist()
    assert draws == np.random.default_rng(0).integers(0, 2**30, size=13).tolist()


# -- generators made on first use (issue 31, item 1) -----------------------------------------


class LazyRng:
    """torch's documented idiom: the generator is made on the first ``__getitem__`` in each
    process, from ``get_worker_info().seed`` (0 in the main process)."""

    def __init__(self, n: int = 10) -> None:
        self.n = n
        self.rng: np.random.Generator | None = None
        self.flip: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rng is None:
            info = get_worker_info()
            self.rng = np.random.default_rng(info.seed if info is not None else 0)
            self.flip = Jitter(torch.Generator().manual_seed(info.seed if info is not None else 1))
        return torch.tensor([i, int(self.rng.integers(0, 2**30)), self.flip(i)])


@pytest.mark.parametrize(
    "num_workers, persistent", [(0, False), (2, False), (2, True)], ids=["0-workers", "2-workers", "2-persistent"]
)
def test_a_generator_made_on_first_use_resumes_at_every_step(num_workers: int, persistent: bool) -> None:
    check_resume_everywhere(lambda: loader(num_workers, persistent, dataset=LazyRng()), epochs=2)


def test_a_generator_made_on_first_use_gives_the_same_stream_with_any_num_workers() -> None:
    reference = epochs_of(loader(0, dataset=LazyRng()), 2)
    for other in (loader(2, dataset=LazyRng()), loader(3, persistent=True, dataset=LazyRng())):
        for got, want in zip(epochs_of(other, 2), reference):
            assert_streams(got, want, f"num_workers={other.num_workers}")
    live = loader(2, dataset=LazyRng())
    run = [(live.restore_key, batch) for batch in live]
    fresh = loader(0, dataset=LazyRng())
    for key, batch in run:
        assert_streams([fresh.restore_sample(str(key))], [batch], str(key))


def test_a_generator_made_after_the_first_batch_is_said() -> None:
    class Late(LazyRng):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i >= 8 and self.rng is None:
                self.rng = np.random.default_rng(0)
            return torch.tensor([i, int(self.rng.integers(0, 2**30)) if self.rng is not None else 0])

    with pytest.warns(sl.errors.UnsavedRngWarning, match=r"dataset\.rng appeared .* after its first batch"):
        list(sl.SavableDataLoader(Late(20), batch_size=2, seed=0))  # made in batch 5, seen at batch 8


# -- the seed a generator was made with (issue 31, item 2) -------------------------------------


def test_the_seed_a_generator_was_made_with_is_said_to_be_overridden_once() -> None:
    """Under torch, datasets holding ``default_rng(1)`` and ``default_rng(2)`` give other
    data; here both are re-seeded from the loader's seed (exact resume) and give the
    same: said once per process and place, naming the attribute and the way out."""
    from torch.utils.data import DataLoader

    class Seeded:
        def __init__(self, seed: int) -> None:
            self.rng = np.random.default_rng(seed)

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> float:
            return float(self.rng.random())

    def values(cls: type, seed: int) -> list[float]:
        extra = {"seed": 0} if cls is sl.SavableDataLoader else {}
        return torch.cat(list(cls(Seeded(seed), batch_size=2, **extra))).tolist()

    assert values(DataLoader, 1) != values(DataLoader, 2)
    with pytest.warns(sl.errors.UnsavedRngWarning, match=r"dataset\.rng .*seed or state it was made with is not used"):
        ours = [values(sl.SavableDataLoader, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: not again for the same class and path
        ours.append(values(sl.SavableDataLoader, 2))
    assert ours[0] == ours[1]


# -- generators the dataset's code reaches (module globals, closures, defaults) ----------------

MODULE_RNG = np.random.default_rng(0)


def module_jitter(x: int) -> int:
    """A module function drawing from a module-global generator."""
    return x + int(MODULE_RNG.integers(0, 2**30))


def default_jitter(x: int, rng: np.random.Generator = np.random.default_rng(0)) -> int:  # noqa: B008
    return x + int(rng.integers(0, 2**30))


def closure_jitter() -> Any:
    gen = torch.Generator().manual_seed(0)
    return lambda x: x + int(torch.randint(0, 2**30, (), generator=gen))


class CodeRngs:
    """Draws from a module global read in ``__getitem__``, one read by a module function
    it calls, a default argument and a closure: none of them an attribute."""

    def __init__(self) -> None:
        self.transform = closure_jitter()

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [i, int(MODULE_RNG.integers(0, 2**30)), module_jitter(i), default_jitter(i), self.transform(i)]
        )


def test_generators_reached_through_code_are_found() -> None:
    assert [p for p, _ in find_generators(CodeRngs(), "dataset")] == [
        "dataset<global MODULE_RNG>",
        "dataset.transform<closure gen>",
        "dataset<global default_jitter><default 0>",
    ]


@pytest.mark.parametrize(
    "num_workers, persistent", [(0, False), (2, False), (2, True)], ids=["0-workers", "2-workers", "2-persistent"]
)
def test_generators_reached_through_code_resume_at_every_step(num_workers: int, persistent: bool) -> None:
    check_resume_everywhere(lambda: loader(num_workers, persistent, dataset=CodeRngs()), epochs=2)


def test_generators_reached_through_code_give_one_stream_with_spawn() -> None:
    reference = epochs_of(loader(0, dataset=CodeRngs()), 1)
    assert_streams(epochs_of(loader(2, context="spawn", dataset=CodeRngs()), 1)[0], reference[0], "spawn")


@pytest.mark.parametrize("kind", [np.random.PCG64, np.random.Philox, np.random.MT19937], ids=lambda k: k.__name__)
def test_a_bit_generator_held_alone_resumes_at_every_step(kind: Any) -> None:
    """``np.random.Generator(self.bits)`` made per sample over a bit generator the dataset
    holds: the bit generator is re-seeded in place like a Generator."""

    class Bits:
        def __init__(self) -> None:
            self.bits = kind(0)

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([i, int(np.random.Generator(self.bits).integers(0, 2**30))])

    assert [p for p, _ in find_generators(Bits(), "dataset")] == ["dataset.bits"]
    check_resume_everywhere(lambda: loader(dataset=Bits()), epochs=2)

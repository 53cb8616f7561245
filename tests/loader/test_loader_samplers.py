"""SavableDataLoader with samplers of the user's (``sampler=``, ``batch_sampler=``,
``generator=``): resume at every step, with torch's samplers and custom ones."""

from __future__ import annotations

import inspect
import random
import re
import time

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import savable_loader as sl
from savable_loader.errors import ConfigMismatchError, LoaderUsageError
from savable_loader.state import decode, encode
from tests.common import (
    RandomMapDataset,
    assert_streams,
    check_resume_everywhere,
    epochs_of,
)

pytestmark = pytest.mark.timeout(300)

N = 10


class CurriculumSampler(Sampler[int]):
    """Stateful without randomness: every iteration rotates the order one step further
    (``stage``), kept in ``state_dict``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.stage = 0

    def __iter__(self):
        self.stage += 1
        for i in range(self.n):
            yield (i + self.stage) % self.n

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"stage": self.stage}

    def load_state_dict(self, state: dict) -> None:
        self.stage = state["stage"]


class EveryOther(Sampler[int]):
    """Deterministic: even indices, then odd ones."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        yield from range(0, self.n, 2)
        yield from range(1, self.n, 2)

    def __len__(self) -> int:
        return self.n


class GlobalNumpyShuffle(Sampler[int]):
    """Draws its order from NumPy's and Python's global RNGs (a class the loader does not
    know: it runs with a private stream swapped in)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        order = np.random.permutation(self.n).tolist()
        for i in order:
            yield i if random.random() < 2 else -1

    def __len__(self) -> int:
        return self.n


def data() -> RandomMapDataset:
    return RandomMapDataset(N)


SAMPLERS = {
    "random+generator": lambda ds: {"sampler": RandomSampler(ds, generator=torch.Generator().manual_seed(3))},
    "random": lambda ds: {"sampler": RandomSampler(ds)},
    "random+replacement": lambda ds: {"sampler": RandomSampler(ds, replacement=True, num_samples=13)},
    "random+replacement+generator": lambda ds: {
        "sampler": RandomSampler(ds, replacement=True, num_samples=70, generator=torch.Generator().manual_seed(1))
    },
    "sequential": lambda ds: {"sampler": SequentialSampler(ds)},
    "subset": lambda ds: {"sampler": SubsetRandomSampler(range(2, 9))},
    "weighted": lambda ds: {"sampler": WeightedRandomSampler([0.1, 0.9, 0.4, 0.7, 3.0, 0.6, 1, 1, 1, 2], 12)},
    "distributed": lambda ds: {"sampler": DistributedSampler(ds, num_replicas=2, rank=1, seed=4)},
    "batch_sampler": lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), 4, drop_last=False), "batch_size": 1},
    "generator=": lambda ds: {"shuffle": True, "generator": torch.Generator().manual_seed(7)},
    "custom stateful": lambda ds: {"sampler": CurriculumSampler(N)},
    "custom deterministic": lambda ds: {"sampler": EveryOther(N)},
    "custom global rng": lambda ds: {"sampler": GlobalNumpyShuffle(N)},
    "plain list": lambda ds: {"sampler": [3, 1, 4, 1, 5, 9, 2, 6]},
}


def factory(name: str, num_workers: int = 0, batch_size: int = 3, seed: int | None = 11):
    def make() -> sl.SavableDataLoader:
        ds = data()
        kw = {"batch_size": batch_size, "num_workers": num_workers, "seed": seed, **SAMPLERS[name](ds)}
        if num_workers:
            kw["multiprocessing_context"] = "fork"
        return sl.SavableDataLoader(ds, **kw)

    return make


#: Samplers whose generator lives across epochs. torch's RandomSampler draws lazily (and
#: once more at the very end of an epoch), so an epoch abandoned by ``break`` leaves the
#: generator elsewhere than a finished one: the live loader's next epoch then differs from
#: the uninterrupted run, with torch's DataLoader as with ours. It is not compared.
SHARED_GENERATOR = {"random+generator", "random+replacement+generator", "generator="}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_resume_at_every_step_in_process(name):
    checked = check_resume_everywhere(
        factory(name), epochs=3, variants=("live", "break", "raise"), check_live_next_epoch=name not in SHARED_GENERATOR
    )
    assert checked > 10


@pytest.mark.parametrize(
    "name",
    [
        "random+generator",
        "random",
        "distributed",
        "batch_sampler",
        "custom stateful",
        "custom global rng",
        "generator=",
    ],
)
def test_resume_with_workers(name):
    check_resume_everywhere(
        factory(name, num_workers=2),
        epochs=2,
        steps=[0, 1, 3, 4, 6],
        variants=("live", "break"),
        check_live_next_epoch=name not in SHARED_GENERATOR,
    )


def test_num_workers_may_change():
    check_resume_everywhere(
        factory("random", num_workers=2), epochs=2, restore_factory=factory("random", num_workers=0), steps=[0, 2, 5]
    )


def test_unbatched_sampler_of_lists():
    class Bulk(Sampler[list]):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            for chunk in torch.randperm(self.n).split(3):
                yield chunk.tolist()

        def __len__(self):
            return 4

    class Many(RandomMapDataset):
        def __getitem__(self, indices):
            return torch.stack([super(Many, self).__getitem__(i) for i in indices])

    def make():
        return sl.SavableDataLoader(Many(N), batch_size=None, sampler=Bulk(N), seed=2)

    check_resume_everywhere(make, epochs=2)
    assert sorted(torch.cat(list(make()))[:, 0].tolist()) == list(range(N))


def test_generator_gives_torchs_batches():
    # generator= with shuffle=True: torch's RandomSampler(generator=g), and the same draws
    # from g as torch's DataLoader, so the batches are torch's
    ds = data()
    ours = sl.SavableDataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    theirs = DataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        assert [b[:, 0].tolist() for b in ours] == [b[:, 0].tolist() for b in theirs]
    assert isinstance(ours.sampler, RandomSampler) and ours.sampler.generator is ours.generator


def test_user_sampler_is_loader_sampler_and_set_epoch_is_honoured():
    ds = data()
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, seed=1)
    loader = sl.SavableDataLoader(ds, batch_size=2, sampler=sampler, seed=0)
    assert loader.sampler is sampler and loader.batch_sampler.sampler is sampler

    def indices():
        return [i for b in loader for i in b[:, 0].tolist()]

    sampler.set_epoch(0)
    e0 = indices()
    sampler.set_epoch(1)
    e1 = indices()
    assert e0 != e1 and sorted(e0) != sorted(range(N))
    loader.set_epoch(0)  # the loader's set_epoch calls the sampler's
    assert sampler.epoch == 0 and indices() == e0


def test_distributed_sampler_set_epoch_resumes_at_every_step():
    def make():
        ds = data()
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
        return sl.SavableDataLoader(ds, batch_size=3, sampler=sampler, seed=0), sampler

    def run(loader, sampler, epochs):
        out = []
        for e in epochs:
            sampler.set_epoch(e)
            out.append(list(loader))
        return out

    reference = run(*make(), range(3))
    flat = [b for e in reference for b in e]
    assert not torch.equal(reference[0][0], reference[1][0])  # set_epoch reshuffles
    for k in range(len(flat) + 1):
        loader, sampler = make()
        seen = []
        for e in range(3 if k else 0):
            sampler.set_epoch(e)
            for batch in loader:
                seen.append(batch)
                if len(seen) == k:
                    break
            if len(seen) == k:
                break
        state = decode(encode(loader.save_state_rank()))
        fresh, fresh_sampler = make()
        fresh.restore_state_rank(state)
        rest = run(fresh, fresh_sampler, range(state.epoch, 3))
        assert_streams([b for e in rest for b in e], flat[k:], f"k={k}")


def test_order_the_loader_cannot_record_is_refused_on_restore():
    class Clock(Sampler[int]):
        def __iter__(self):
            order = list(range(N))
            random.Random(time.perf_counter_ns()).shuffle(order)  # unreachable randomness
            return iter(order)

        def __len__(self):
            return N

    loader = sl.SavableDataLoader(data(), batch_size=2, sampler=Clock(), seed=0)
    it = iter(loader)
    next(it), next(it)
    state = loader.save_state_rank()
    fresh = sl.SavableDataLoader(data(), batch_size=2, sampler=Clock(), seed=0)
    fresh.restore_state_rank(state)
    with pytest.raises(ConfigMismatchError, match="sampler order") as info:
        next(iter(fresh))  # the iteration (and its replay) begins at the first next()
    assert "cannot record" in str(info.value)


def test_sampler_states_refuse_other_configurations():
    loader = factory("random+generator")()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    assert state.config.sampler == "torch.utils.data.sampler.BatchSampler" and state.position.sampler is not None
    with pytest.raises(ConfigMismatchError) as info:
        factory("random+generator", batch_size=2)().restore_state_rank(state)
    assert info.value.field == "batch_size"
    with pytest.raises(ConfigMismatchError) as info:
        sl.SavableDataLoader(data(), batch_size=3, shuffle=True, seed=11).restore_state_rank(state)
    assert info.value.field == "sampler"
    own = sl.SavableDataLoader(data(), batch_size=3, shuffle=True, seed=11)
    next(iter(own))
    with pytest.raises(ConfigMismatchError) as info:
        factory("random+generator")().restore_state_rank(own.save_state_rank())
    assert info.value.field == "sampler"
    wc = sl.WorkerConfig(rank=0, world_size=2, seed=11)
    two = sl.SavableDataLoader(data(), batch_size=3, sampler=RandomSampler(data()), worker_config=wc)
    with pytest.raises(ConfigMismatchError, match="splits the data across ranks itself") as info:
        two.restore_state_rank(state)
    assert info.value.field == "world_size"
    states = []
    for rank in range(2):
        ds = data()
        wc = sl.WorkerConfig(rank=rank, world_size=2, seed=11)
        ranked = sl.SavableDataLoader(ds, batch_size=3, sampler=DistributedSampler(ds, 2, rank), worker_config=wc)
        next(iter(ranked))
        states.append(ranked.save_state_rank())
    one = sl.SavableDataLoader(data(), batch_size=3, sampler=DistributedSampler(data(), 1, 0), seed=11)
    with pytest.raises(ConfigMismatchError, match="splits the data across ranks itself"):
        one.restore_state_global(states)


def test_restore_keys_carry_the_dataset_indices():
    loader = factory("random+generator")()
    it = iter(loader)
    next(it)
    batch = next(it)
    key = loader.restore_key
    assert key.sample == batch[:, 0].tolist() and key.positions == [(3, 6, 1)]
    assert_streams([loader.restore_sample(str(key))], [batch], "rebuilt batch")
    fresh = factory("random+generator", num_workers=0)()
    assert_streams([fresh.restore_sample(key)], [batch], "rebuilt by another loader")
    own = sl.SavableDataLoader(data(), batch_size=3, shuffle=True, seed=11)
    with pytest.raises(sl.errors.RestoreKeyError, match="sampler"):
        own.restore_sample(key)


def test_global_rng_of_the_caller_is_left_alone():
    # torch's RandomSampler without a generator draws from torch's global RNG: the loader
    # swaps a private stream in, so the training loop's draws do not depend on the loader
    torch.manual_seed(0)
    expected = [float(torch.rand(())) for _ in range(4)]
    torch.manual_seed(0)
    loader = factory("random")()
    got = []
    for _ in loader:
        got.append(float(torch.rand(())))
    assert got == expected


def test_remaining_and_len_follow_the_sampler():
    loader = factory("random+replacement")()  # 13 samples in batches of 3
    assert len(loader) == 5 and loader.remaining() == 5
    it = iter(loader)
    next(it), next(it)
    assert loader.remaining() == 3
    state = loader.save_state_rank()
    fresh = factory("random+replacement")()
    fresh.restore_state_rank(state)
    assert len(fresh) == 5 and fresh.remaining() == 3 and len(list(fresh)) == 3
    assert fresh.remaining() == 5


def test_epochs_of_a_restored_sampler_loader_match_the_uninterrupted_run():
    reference = epochs_of(factory("random")(), 3)
    loader = factory("random")()
    list(loader)
    state = loader.save_state_rank()  # between epochs
    fresh = factory("random")()
    fresh.restore_state_rank(state)
    for e in (1, 2):
        assert_streams(list(fresh), reference[e], f"epoch {e}")


def test_in_order_false_is_refused_only_with_workers():
    if "in_order" in inspect.signature(DataLoader.__init__).parameters:
        sl.SavableDataLoader(data(), batch_size=2, in_order=False)  # harmless in the main process
    else:  # torch before 2.6 has no such argument (tests/loader/test_loader_arguments.py)
        message = f"in_order=False: torch {torch.__version__}'s DataLoader has no"
        with pytest.raises(LoaderUsageError, match=re.escape(message)):
            sl.SavableDataLoader(data(), batch_size=2, in_order=False)
    with pytest.raises(LoaderUsageError, match="in_order=False"):
        sl.SavableDataLoader(data(), batch_size=2, num_workers=2, in_order=False)


# -- DistributedSampler.set_epoch before or after the restore (issue 31, item 4) --------


def _dist_loader() -> tuple[sl.SavableDataLoader, DistributedSampler]:
    data = list(range(12))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    return sl.SavableDataLoader(data, batch_size=2, sampler=sampler), sampler


def _dist_epochs(loader: sl.SavableDataLoader, sampler: DistributedSampler, start: int) -> list[list[int]]:
    out = []
    for epoch in range(start, 3):
        sampler.set_epoch(epoch)
        out += [batch.tolist() for batch in loader]
    return out


@pytest.mark.parametrize("point", ["start", "mid", "last-batch", "after-loop"])
@pytest.mark.parametrize("call", ["set_epoch-then-restore", "restore-then-set_epoch"])
def test_distributed_sampler_set_epoch_around_the_restore_at_every_save_point(point: str, call: str) -> None:
    """The usual resumed program: ``sampler.set_epoch(epoch)`` (before or after the restore),
    then the loop. A state saved after the last batch or after the loop used to replay the
    previous epoch's order as the next epoch when set_epoch came first."""
    reference = _dist_epochs(*_dist_loader(), 0)
    loader, sampler = _dist_loader()
    sampler.set_epoch(0)
    it = iter(loader)
    got = [next(it).tolist() for _ in range({"start": 0, "mid": 1, "last-batch": 3, "after-loop": 3}[point])]
    if point == "after-loop":
        assert next(it, None) is None
    state = decode(encode(loader.save_state_rank()))
    del it
    again, sampler2 = _dist_loader()
    epoch = 1 if point in ("last-batch", "after-loop") else 0
    if call == "set_epoch-then-restore":
        sampler2.set_epoch(epoch)
        again.restore_state_rank(state)
    else:
        again.restore_state_rank(state)
        sampler2.set_epoch(epoch)
    if epoch == 0:
        got += [batch.tolist() for batch in again]
    got += _dist_epochs(again, sampler2, epoch + 1 if epoch == 0 else epoch)
    assert got == reference


@pytest.mark.parametrize("plain", [list(range(12)), range(12)], ids=["list", "range"])
def test_a_distributed_sampler_state_into_a_plain_sequence_sampler_is_refused_naming_it(plain: object) -> None:
    loader, sampler = _dist_loader()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    del it
    other = sl.SavableDataLoader(list(range(12)), batch_size=2, sampler=plain)
    with pytest.raises(ConfigMismatchError, match=r"sampler epoch at 'sampler'.*DistributedSampler"):
        other.restore_state_rank(state)


# -- generator= with persistent workers (issue 31, item 12) -------------------------------


def _generator_loader(cls: type, persistent: bool) -> DataLoader:
    return cls(
        list(range(10)),
        batch_size=3,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=2,
        persistent_workers=persistent,
    )


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent"])
def test_generator_gives_torchs_batches_with_workers_persistent_or_not(persistent: bool) -> None:
    """torch draws the workers' base seed from ``generator=`` once per iterator: at every
    epoch, or once with persistent workers (it used to be drawn at every epoch here)."""
    theirs = epochs_of(_generator_loader(DataLoader, persistent), 3)
    ours = epochs_of(_generator_loader(sl.SavableDataLoader, persistent), 3)
    assert [[b.tolist() for b in e] for e in ours] == [[b.tolist() for b in e] for e in theirs]


def test_generator_with_persistent_workers_resumes_at_every_step() -> None:
    check_resume_everywhere(lambda: _generator_loader(sl.SavableDataLoader, True), epochs=3, steps=[0, 2, 4, 5, 8])

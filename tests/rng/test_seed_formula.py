"""The one seed formula (``rng.SEED_FORMULA``, 3) end to end: NumPy's global RNG does not
share torch's Mersenne Twister stream. Through the public paths (drop-in with the loader's
own order and with a sampler of the user's, savable pipelines with and without restore
keys, plain IterableDatasets), every item of ``tests/seed_streams.py`` draws NumPy and
torch words side by side:

* a fresh loader writes formula 3, its NumPy and torch words are unrelated (pinned by
  digests), and it resumes exactly at every step;
* restore keys record formula 3 and rebuild their sample;
* a state that records another formula (1 or 2: unreleased versions wrote them; 1 is also
  what a state written before the field existed holds) and a key that records another
  formula or none are refused with our own error naming the field, the value found and
  the value expected, and the loader is left as it was.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.errors import RestoreKeyError, StateError
from savable_loader.rng import SEED_FORMULA
from savable_loader.state import decode, encode
from tests.common import check_resume_everywhere
from tests.seed_streams import DRAWS, FACTORIES, digest, make, recording

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::savable_loader.sources.iterable.ReplayWarning"),
]

#: Digests of two epochs of each loader under formula 3 (golden: a change of the formula
#: changes them).
FORMULA_3 = {
    ("dropin", 0): "ce796a0013e3a960aa1f58e2",
    ("dropin", 2): "ce796a0013e3a960aa1f58e2",
    ("sampler", 0): "8b2ebc08ab96bf1741613b8b",
    ("sampler", 2): "8b2ebc08ab96bf1741613b8b",
    ("pipeline", 0): "897c9d3cba46abcf9bcb6943",
    ("pipeline", 2): "28c6a06abfc25584a6c63dea",
    ("pipeline-keyed", 0): "31347fc40e823397465c15f1",
    ("pipeline-keyed", 2): "31347fc40e823397465c15f1",
    ("iterable", 0): "bf60f917dfaa86847ce2946a",
    ("iterable", 2): "5ddac69855b3111d06c739a7",
}
CASES = sorted(FORMULA_3)


def _items(stream: list) -> list[list[int]]:
    """The items of a stream (batches of the drop-in paths flattened)."""
    return [item for x in stream for item in (x if isinstance(x[0], list) else [x])]


def _two_epochs(loader: sl.SavableDataLoader) -> list:
    return list(loader) + list(loader)


def _words(item: list[int]) -> tuple[list[int], list[int]]:
    return item[1 : 1 + DRAWS], item[1 + DRAWS :]


@pytest.mark.parametrize(("path", "workers"), CASES)
def test_a_fresh_loader_draws_unrelated_numpy_and_torch_words(path, workers):
    loader = make(path, workers)
    assert loader.save_state_rank().config.seed_formula == SEED_FORMULA == 3
    stream = _two_epochs(loader)
    assert digest(stream) == FORMULA_3[(path, workers)]
    items = _items(stream)
    assert len(items) == 24
    for item in items:
        numpy_words, torch_words = _words(item)
        # no word of one stream at any offset in the other (2**31 values: chance ~1e-8)
        assert not set(numpy_words) & set(torch_words), item
    assert loader.save_state_rank().config.seed_formula == 3


@pytest.mark.parametrize(
    ("path", "workers"),
    [("dropin", 2), ("sampler", 0), ("pipeline", 0), ("pipeline", 2), ("pipeline-keyed", 2), ("iterable", 2)],
)
def test_formula_3_resumes_at_every_step(path, workers):
    steps = None if workers == 0 else [0, 1, 3, 6, 7, 10, 13]
    assert check_resume_everywhere(lambda: make(path, workers), 2, steps=steps) >= 7


def _refused(error: BaseException, field: str, found: object, expected: object) -> None:
    """The message names the field, the value found and the value expected, and says who
    wrote what was refused."""
    message = str(error)
    assert f"{field} is {found!r}, expected {expected!r}" in message, message
    assert "unreleased version of savable-loader" in message, message


@pytest.mark.parametrize("path", FACTORIES)
@pytest.mark.parametrize("formula", [1, 2])
def test_a_state_of_another_seed_formula_is_refused(path, formula):
    old = make(path)
    it = iter(old)
    next(it)
    next(it)
    state = decode(encode(recording(old.save_state_rank(), seed_formula=formula)))
    it.close()
    assert state.config.seed_formula == formula
    fresh = make(path)
    with pytest.raises(StateError) as info:
        fresh.restore_state_rank(state)
    _refused(info.value, "config.seed_formula", formula, SEED_FORMULA)
    # nothing of the refused state was taken: the loader runs as a fresh one
    assert digest(_two_epochs(fresh)) == FORMULA_3[(path, 0)]
    assert fresh.save_state_rank().config.seed_formula == SEED_FORMULA


@pytest.mark.parametrize("path", ["dropin", "pipeline"])
def test_a_state_written_before_the_field_existed_is_refused(path):
    plain = msgspec.to_builtins(make(path).save_state_rank())
    del plain["config"]["seed_formula"]  # as the earliest unreleased version wrote states
    state = msgspec.convert(plain, sl.state.RankState)
    assert state.config.seed_formula == 1  # the schema's default
    with pytest.raises(StateError) as info:
        make(path).restore_state_rank(state)
    _refused(info.value, "config.seed_formula", 1, SEED_FORMULA)


def test_a_gathered_state_with_one_rank_of_another_formula_is_refused():
    """On another world size too, before any rank's state is used."""

    def dropin(rank: int) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=rank, world_size=2, num_workers=0, seed=5)
        return sl.SavableDataLoader(list(range(12)), batch_size=2, shuffle=True, worker_config=wc)

    states = []
    for rank in range(2):
        loader = dropin(rank)
        next(iter(loader))
        states.append(loader.save_state_rank())
    states[1] = recording(states[1], seed_formula=2)
    one = sl.SavableDataLoader(list(range(12)), batch_size=2, shuffle=True, seed=5)
    with pytest.raises(StateError) as info:
        one.restore_state_global(states)
    _refused(info.value, "config.seed_formula", 2, SEED_FORMULA)


@pytest.mark.parametrize("path", ["dropin", "sampler", "pipeline-keyed"])
def test_keys_record_and_rebuild_their_formula(path):
    loader = make(path)
    for item in loader:
        key = loader.restore_key
        assert key.seed_formula == SEED_FORMULA
        parsed = sl.state.RestoreKey.parse(str(key))
        assert parsed == key
        assert make(path).restore_sample(parsed) == item


#: Keys as an unreleased version wrote them (no seed_formula: formula 2's samples).
OLD_KEYS = {
    "dropin": (
        '{"kind":"index","seed":5,"fingerprint":"6394c806da95d08965a08301","epoch":0,"rank":0,'
        '"positions":[[2,4,1]],"shuffle":true,"batched":true,"world_size":1,"order_algorithm":"feistel-1"}'
    ),
    "sampler": (
        '{"kind":"index","seed":5,"fingerprint":"6394c806da95d08965a08301","epoch":0,"rank":0,'
        '"positions":[[2,4,1]],"sample":[2,5],"shuffle":false,"batched":true,"world_size":1}'
    ),
    "pipeline-keyed": (
        '{"kind":"pipeline","seed":5,"fingerprint":"ac5315ad940825b67607ae27","epoch":0,"rank":0,"index":1,'
        '"sample":1,"world_size":1,"num_workers":0}'
    ),
}


@pytest.mark.parametrize("path", sorted(OLD_KEYS))
def test_a_key_made_before_the_field_is_refused(path):
    text = OLD_KEYS[path]
    key = sl.state.RestoreKey.parse(text)
    assert key.seed_formula is None
    for given in (key, text):
        with pytest.raises(RestoreKeyError) as info:
            make(path).restore_sample(given)
        _refused(info.value, "key.seed_formula", None, SEED_FORMULA)
        assert "before the field existed" in str(info.value)


@pytest.mark.parametrize("path", ["dropin", "sampler", "pipeline-keyed"])
@pytest.mark.parametrize("formula", [1, 2])
def test_a_key_of_another_seed_formula_is_refused(path, formula):
    loader = make(path)
    next(iter(loader))
    key = loader.restore_key
    for given in (
        msgspec.structs.replace(key, seed_formula=formula),
        str(key).replace('"seed_formula":3', f'"seed_formula":{formula}'),
    ):
        with pytest.raises(RestoreKeyError) as info:
            loader.restore_sample(given)
        _refused(info.value, "key.seed_formula", formula, SEED_FORMULA)


@pytest.mark.parametrize("path", ["dropin", "sampler", "pipeline-keyed"])
@pytest.mark.parametrize("bad", [0, 4, 99, -1, "3", 2.0, True])
def test_a_malformed_seed_formula_is_refused_with_the_field_named(path, bad):
    loader = make(path)
    next(iter(loader))
    key = loader.restore_key
    with pytest.raises(RestoreKeyError, match=r"seed_formula"):
        loader.restore_sample(msgspec.structs.replace(key, seed_formula=bad))
    text = str(key).replace('"seed_formula":3', f'"seed_formula":{msgspec.json.encode(bad).decode()}')
    assert text != str(key)
    with pytest.raises(RestoreKeyError, match=r"seed_formula"):
        loader.restore_sample(text)


def test_mark_sample_draws_unrelated_numpy_and_torch_words():
    from tests.seed_streams import TwoStreamsSource, draws

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=5)
    source = TwoStreamsSource(wc, keyed=True)
    made = []
    for _ in range(2):
        with _ActiveWorker(0, 0):
            source.mark_sample(7)
            made.append(draws(7))
    assert made[0] == made[1]
    numpy_words, torch_words = _words(made[0])
    assert not set(numpy_words) & set(torch_words)


def test_owned_generators_are_not_correlated():
    """A dataset's own RandomState and torch.Generator are seeded from per-path bases
    (``rng.owned``): never one value for both."""

    class Owned:
        def __init__(self) -> None:
            self.np_rng = np.random.RandomState(0)
            self.torch_rng = torch.Generator()

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> list[int]:
            return [
                *self.np_rng.randint(0, 2**31, DRAWS).tolist(),
                *torch.randint(0, 2**31, (DRAWS,), generator=self.torch_rng).tolist(),
            ]

    for item in sl.SavableDataLoader(Owned(), batch_size=None, seed=5):
        assert not set(item[:DRAWS]) & set(item[DRAWS:]), item


def _user_pipeline() -> sl.SavableDataLoader:
    """A user's pipeline around a plain IterableDataset (``TorchIterableSource`` under a
    ``MapDataset``): the source re-seeds per item itself."""
    from savable_loader.sources import TorchIterableSource
    from savable_loader.wrappers import MapDataset
    from tests.seed_streams import TwoStreamsIterable

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=5)
    pipeline = MapDataset(TorchIterableSource(TwoStreamsIterable(), wc), lambda x: x)
    return sl.SavableDataLoader(pipeline, batch_size=None, collate_fn=lambda x: x, worker_config=wc)


def test_a_torch_iterable_source_in_a_users_pipeline_seeds_numpy_apart_from_torch() -> None:
    """Formulas of unreleased versions seeded NumPy from torch's 32 bits (NumPy's second
    word was torch's first); a TorchIterableSource re-seeding per item under a user's
    wrappers does not."""
    items = list(_user_pipeline())
    assert len(items) == 12
    assert not any(item[2] == item[4] for item in items)  # np[1] != torch[0]
    state = recording(_user_pipeline().save_state_rank(), seed_formula=2)
    with pytest.raises(StateError) as info:
        _user_pipeline().restore_state_rank(state)
    _refused(info.value, "config.seed_formula", 2, SEED_FORMULA)

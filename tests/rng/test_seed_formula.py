"""Seed formula 3 end to end (``rng.SEED_FORMULA``): NumPy's global RNG no longer shares
torch's Mersenne Twister stream. Through the public paths (drop-in with the loader's own
order and with a sampler of the user's, savable pipelines with and without restore keys,
plain IterableDatasets), every item of ``tests/seed_streams.py`` draws NumPy and torch
words side by side:

* a fresh loader writes formula 3, its NumPy and torch words are unrelated, and it
  resumes exactly at every step;
* a state of formula 2 (or 1) restores into a fresh loader and goes on with the old
  streams, exactly (pinned by digests of what the previous version yielded), for the rest
  of the run;
* restore keys record their formula; a key made before the field rebuilds the formula-2
  sample; a malformed ``seed_formula`` is refused with the field named.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker, active_seed_formula
from savable_loader.errors import RestoreKeyError
from savable_loader.rng import SEED_FORMULA, seed_global
from savable_loader.state import decode, encode
from tests.common import check_resume_everywhere
from tests.seed_streams import DRAWS, at_formula, digest, make

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::savable_loader.sources.iterable.ReplayWarning"),
]

#: Digests of two epochs as savable-loader 0.x with seed formula 2 yielded them (computed
#: with the previous version's code: a fresh loader there, a formula-2 state here).
FORMULA_2 = {
    ("dropin", 0): "6065bc02a43e3f9591082b8e",
    ("dropin", 2): "6065bc02a43e3f9591082b8e",
    ("sampler", 0): "8ec8480fc8fe4d5f025133ee",
    ("sampler", 2): "8ec8480fc8fe4d5f025133ee",
    ("pipeline", 0): "1805ef539bd5012d3f8398a2",
    ("pipeline", 2): "3d75589dee5bc957520a0e5f",
    ("pipeline-keyed", 0): "538612feaa6a504c1ebdc4ad",
    ("pipeline-keyed", 2): "538612feaa6a504c1ebdc4ad",
    ("iterable", 0): "4a081092180de56419d7016f",
    ("iterable", 2): "333788f883b5cac8e469d7be",
}
#: The same loaders fresh, under formula 3 (torch's words are formula 2's; NumPy's are new).
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
CASES = sorted(FORMULA_2)


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


@pytest.mark.parametrize(("path", "workers"), CASES)
@pytest.mark.parametrize("formula", [1, 2])
def test_a_run_of_formula_1_or_2_keeps_the_shared_stream(path, workers, formula):
    loader = at_formula(make(path, workers), formula)
    stream = _two_epochs(loader)
    assert digest(stream) == FORMULA_2[(path, workers)], "the previous version's stream"
    for item in _items(stream):
        numpy_words, torch_words = _words(item)
        # one Mersenne Twister: torch's first word is NumPy's second
        assert numpy_words[1] == torch_words[0], "formulas 1 and 2: NumPy's stream is torch's"
    assert loader.save_state_rank().config.seed_formula == formula


@pytest.mark.parametrize(
    ("path", "workers"),
    [("dropin", 2), ("sampler", 0), ("pipeline", 0), ("pipeline", 2), ("pipeline-keyed", 2), ("iterable", 2)],
)
def test_formula_3_resumes_at_every_step(path, workers):
    steps = None if workers == 0 else [0, 1, 3, 6, 7, 10, 13]
    assert check_resume_everywhere(lambda: make(path, workers), 2, steps=steps) >= 7


@pytest.mark.parametrize(("path", "workers"), [("dropin", 2), ("sampler", 0), ("pipeline", 2), ("iterable", 0)])
@pytest.mark.parametrize("formula", [1, 2])
def test_an_older_state_restored_into_a_fresh_loader_keeps_its_formula(path, workers, formula):
    reference = _two_epochs(at_formula(make(path, workers), formula))
    assert digest(reference) == FORMULA_2[(path, workers)]
    for k in (0, 1, 4, len(reference) // 2, len(reference) // 2 + 3):
        old = at_formula(make(path, workers), formula)
        it = iter(old)
        got = [next(it) for _ in range(min(k, len(reference) // 2))]
        if k >= len(reference) // 2:
            assert next(it, None) is None
            it = iter(old)
            got += [next(it) for _ in range(k - len(got))]
        state = decode(encode(old.save_state_rank()))
        it.close()
        assert state.config.seed_formula == formula
        fresh = make(path, workers)  # a new loader: formula 3 until the restore
        fresh.restore_state_rank(state)
        rest = list(fresh)
        again = fresh.save_state_rank()
        assert again.config.seed_formula == formula, "kept for the rest of the run"
        if k < len(reference) // 2:
            rest += list(fresh)
        assert got + rest == reference, f"k={k}"


@pytest.mark.parametrize("path", ["dropin", "sampler", "pipeline-keyed"])
@pytest.mark.parametrize("formula", [1, 2, 3])
def test_keys_record_and_rebuild_their_formula(path, formula):
    loader = at_formula(make(path), formula) if formula != 3 else make(path)
    for item in loader:
        key = loader.restore_key
        assert key.seed_formula == formula
        parsed = sl.state.RestoreKey.parse(str(key))
        assert parsed == key
        for rebuilder in (make(path), at_formula(make(path), 2), at_formula(make(path), 3)):
            assert rebuilder.restore_sample(parsed) == item, "the key's own formula, whatever the loader's"


#: Keys as the previous version wrote them (no seed_formula), and the batches they named.
OLD_KEYS = {
    "dropin": (
        '{"kind":"index","seed":5,"fingerprint":"6394c806da95d08965a08301","epoch":0,"rank":0,'
        '"positions":[[2,4,1]],"shuffle":true,"batched":true,"world_size":1,"order_algorithm":"feistel-1"}',
        [
            [3, 1863099209, 1405377218, 2012963016, 1405377218, 253050125, 163915941],
            [4, 918241281, 575027638, 40837499, 575027638, 539426411, 2003270316],
        ],
    ),
    "sampler": (
        '{"kind":"index","seed":5,"fingerprint":"6394c806da95d08965a08301","epoch":0,"rank":0,'
        '"positions":[[2,4,1]],"sample":[2,5],"shuffle":false,"batched":true,"world_size":1}',
        [
            [2, 1877817987, 304768460, 1718838352, 304768460, 619534308, 871263901],
            [5, 2079282078, 444977277, 1225196502, 444977277, 1011853382, 1164232750],
        ],
    ),
    "pipeline-keyed": (
        '{"kind":"pipeline","seed":5,"fingerprint":"ac5315ad940825b67607ae27","epoch":0,"rank":0,"index":1,'
        '"sample":1,"world_size":1,"num_workers":0}',
        [1, 631853179, 1980892452, 658796995, 1980892452, 1893232241, 47774584],
    ),
}


@pytest.mark.parametrize("path", sorted(OLD_KEYS))
def test_a_key_made_before_the_field_rebuilds_the_formula_2_sample(path):
    text, batch = OLD_KEYS[path]
    key = sl.state.RestoreKey.parse(text)
    assert key.seed_formula is None
    assert make(path).restore_sample(key) == batch  # a fresh (formula 3) loader
    assert make(path).restore_sample(text) == batch
    assert at_formula(make(path), 2).restore_sample(key) == batch
    assert at_formula(make(path), 1).restore_sample(key) == batch  # as the previous version rebuilt it
    fresh = make(path)
    it = iter(fresh)
    next(it)
    assert next(it) != batch, "a fresh loader draws other NumPy words for the same key"
    it.close()


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


def test_mark_sample_follows_the_loading_context():
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=5)
    from tests.seed_streams import TwoStreamsSource, draws

    source = TwoStreamsSource(wc, keyed=True)
    assert active_seed_formula() == SEED_FORMULA
    made = {}
    for formula in (None, 2, 3):
        with _ActiveWorker(0, 0, formula):
            source.mark_sample(7)
            made[formula] = draws(7)
    assert made[None] == made[3] != made[2]
    numpy_words, torch_words = _words(made[2])
    assert numpy_words[1] == torch_words[0]
    with _ActiveWorker(0, 0, 2), _ActiveWorker(1, 0):  # a nested context keeps the formula
        assert active_seed_formula() == 2
    assert active_seed_formula() == SEED_FORMULA


def test_owned_generators_are_not_correlated():
    """A dataset's own RandomState and torch.Generator are seeded from per-path bases
    (``rng.owned``): never one value for both, under any formula."""

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

    for formula in (2, 3):
        loader = sl.SavableDataLoader(Owned(), batch_size=None, seed=5)
        if formula == 2:
            at_formula(loader, 2)
        for item in loader:
            assert not set(item[:DRAWS]) & set(item[DRAWS:]), item


def test_seed_global_refuses_an_unknown_formula():
    with pytest.raises(ValueError, match="seed formula 4"):
        seed_global(1, 4)


def _user_pipeline() -> sl.SavableDataLoader:
    """A user's pipeline around a plain IterableDataset (``TorchIterableSource`` under a
    ``MapDataset``): the source re-seeds per item itself."""
    from savable_loader.sources import TorchIterableSource
    from savable_loader.wrappers import MapDataset
    from tests.seed_streams import TwoStreamsIterable

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=5)
    pipeline = MapDataset(TorchIterableSource(TwoStreamsIterable(), wc), lambda x: x)
    return sl.SavableDataLoader(pipeline, batch_size=None, collate_fn=lambda x: x, worker_config=wc)


@pytest.mark.parametrize("formula", [2, 3])
def test_a_torch_iterable_source_in_a_users_pipeline_follows_the_restored_formula(formula: int) -> None:
    """Formula 2 seeds NumPy from torch's 32 bits (NumPy's second word is torch's first);
    a state of formula 2 restored into a pipeline built around a TorchIterableSource must
    keep that stream (the source re-seeds per item with the loader's formula)."""
    items = list(at_formula(_user_pipeline(), formula))
    assert len(items) == 12
    shifted = [item[2] == item[4] for item in items]  # np[1] == torch[0]
    assert all(shifted) if formula == 2 else not any(shifted)

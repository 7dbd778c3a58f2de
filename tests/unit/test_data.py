"""Determinism and partitioning of the byte-level token stream."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from geopipe.model.data import (
    Corpus,
    TokenStream,
    global_indices,
    micro_batches_per_pipeline,
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    rng = np.random.default_rng(0)
    return Corpus.from_bytes(rng.integers(0, 256, size=10_000, dtype=np.uint8).tobytes())


def test_sample_is_pure_function_of_seed_and_index(corpus: Corpus) -> None:
    a, b = TokenStream(corpus, seed=5), TokenStream(corpus, seed=5)
    # Order of requests must not matter: no hidden state.
    later = b.sample(9, 32)
    np.testing.assert_array_equal(a.sample(3, 32), b.sample(3, 32))
    np.testing.assert_array_equal(a.sample(9, 32), later)
    s = a.sample(3, 32)
    assert s.dtype == np.int64 and s.shape == (33,)
    assert not np.array_equal(a.sample(3, 32), a.sample(4, 32))
    assert not np.array_equal(a.sample(3, 32), TokenStream(corpus, seed=6).sample(3, 32))


def test_batch_shapes_and_shift(corpus: Corpus) -> None:
    stream = TokenStream(corpus, seed=1)
    x, y = stream.batch([4, 5, 6], 16)
    assert x.shape == y.shape == (3, 16)
    assert x.dtype == y.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(x[1].numpy(), stream.sample(5, 16)[:-1])


@pytest.mark.parametrize(
    ("global_batch", "num_pipelines", "micro_batch_size"),
    [(8, 1, 1), (8, 2, 2), (12, 3, 2), (12, 4, 3), (16, 4, 4), (6, 6, 1)],
)
def test_global_indices_partition_each_step(
    global_batch: int, num_pipelines: int, micro_batch_size: int
) -> None:
    n_micro = micro_batches_per_pipeline(global_batch, num_pipelines, micro_batch_size)
    for step in (0, 1, 7):
        seen: list[int] = []
        for p in range(num_pipelines):
            for m in range(n_micro):
                idx = global_indices(step, global_batch, p, num_pipelines, m, micro_batch_size)
                assert len(idx) == micro_batch_size
                seen.extend(idx)
        assert len(set(seen)) == len(seen), "micro-batches overlap"
        assert sorted(seen) == list(range(step * global_batch, (step + 1) * global_batch))


def test_global_indices_layout() -> None:
    # Pipeline 1 of 2 gets the second half of step 3's batch, split in order.
    assert global_indices(3, 8, 1, 2, 0, 2) == [28, 29]
    assert global_indices(3, 8, 1, 2, 1, 2) == [30, 31]


def test_global_indices_validation() -> None:
    with pytest.raises(ValueError, match="num_pipelines"):
        global_indices(0, 10, 0, 3, 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        global_indices(0, 12, 0, 2, 0, 4)
    with pytest.raises(ValueError, match="micro_batch"):
        global_indices(0, 8, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="pipeline"):
        global_indices(0, 8, 2, 2, 0, 2)


def test_resume_reproduces_batches(corpus: Corpus) -> None:
    stream = TokenStream(corpus, seed=11)
    state = stream.state_dict(step=4)
    assert state == {"seed": 11, "step": 4, "corpus_digest": corpus.digest}
    resumed = TokenStream(corpus, seed=11)
    step = resumed.load_state_dict(state)
    idx = global_indices(step, 8, 1, 2, 1, 2)
    for a, b in zip(stream.batch(idx, 16), resumed.batch(idx, 16), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="seed"):
        TokenStream(corpus, seed=12).load_state_dict(state)
    other = Corpus.from_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="digest"):
        TokenStream(other, seed=11).load_state_dict(state)


def test_file_corpus(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(b"hello world " * 20)
    corpus = Corpus(path)
    assert len(corpus) == 240
    assert corpus.digest == Corpus.from_bytes(b"hello world " * 20).digest
    assert len(Corpus(path, max_bytes=50)) == 50


def test_directory_corpus_sorted_and_skips_binary(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"BBBB")
    (tmp_path / "a.txt").write_bytes(b"AAAA")
    (tmp_path / "c.bin").write_bytes(b"\0\1\2\3")
    corpus = Corpus(tmp_path)
    assert corpus.tokens.tobytes() == b"AAAABBBB"
    assert len(corpus) == 8


def test_missing_path_and_short_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Corpus(tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\(text\\) bytes"):
        Corpus(tmp_path / "empty")
    short = TokenStream(Corpus.from_bytes(b"abcd"), seed=0)
    with pytest.raises(ValueError, match="needs at least 11"):
        short.sample(0, 10)
    assert short.sample(0, 3).tolist() == list(b"abcd")


def test_stdlib_corpus_is_deterministic() -> None:
    a = Corpus(max_bytes=100_000)
    b = Corpus("stdlib", max_bytes=100_000)
    assert len(a) == 100_000
    assert a.digest == b.digest
    assert b"import" in a.tokens.tobytes()

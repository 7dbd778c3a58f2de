"""TokenDataset: windows across shards, sampling through TokenStream, the digest, and one-line
errors for damaged datasets; open_corpus's choice of corpus."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from _tokdata import stdlib_sources, train_small_tokenizer

from geopipe.model.data import VOCAB_SIZE, Corpus, TokenStream, open_corpus
from geopipe.model.prepare import prepare_data
from geopipe.model.tokens import DatasetError, TokenDataset

SHARD = 3_000


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_small_tokenizer(tmp_path_factory.mktemp("tok") / "small-bpe")


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory, tok_dir: Path) -> Path:
    """About 12k tokens in shards of 3k: several shard boundaries."""
    out = tmp_path_factory.mktemp("ds") / "ds"
    prepare_data(stdlib_sources(6), tok_dir, out, shard_tokens=SHARD, progress=False)
    return out


@pytest.fixture
def copy(dataset_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the dataset that a test may damage."""
    return Path(shutil.copytree(dataset_dir, tmp_path / "ds"))


def raw_tokens(path: Path) -> np.ndarray:
    """All tokens, read with plain numpy from the shard files (no TokenDataset)."""
    m = json.loads((path / "manifest.json").read_text())
    parts = [np.fromfile(path / s["file"], dtype="<u2") for s in m["shards"]]
    return np.concatenate(parts).astype(np.int64)


def test_opens_with_the_manifest_figures(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir)
    m = ds.manifest
    assert len(ds) == ds.token_count == m["token_count"] == len(raw_tokens(dataset_dir))
    assert len(ds.shards) == len(m["shards"]) >= 3
    assert all(len(s) == SHARD for s in ds.shards[:-1])
    assert ds.vocab_size == 512 and ds.documents == 6
    assert ds.tokenizer_dir == dataset_dir / "tokenizer"
    assert (ds.tokenizer_dir / "tokenizer.json").is_file()
    assert ds.shards[0].dtype == np.dtype("<u2") and not ds.shards[0].flags.writeable
    ds.verify()


def test_pickles_as_its_path(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # not the tokens
    back = pickle.loads(blob)
    assert back.digest == ds.digest and np.array_equal(back.window(0, 500), ds.window(0, 500))


def test_window_reads_across_shard_boundaries(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir)
    whole = raw_tokens(dataset_dir)
    n = len(ds)
    cases = [(0, n), (0, 1), (n - 1, 1), (n, 0), (SHARD - 1, 2), (SHARD - 5, SHARD + 10)]
    cases += [(SHARD * k - d, m) for k in (1, 2, 3) for d in (0, 1, 7) for m in (1, 7, 64)]
    for offset, size in cases:
        w = ds.window(offset, size)
        assert w.dtype == np.int64 and w.shape == (size,)
        np.testing.assert_array_equal(w, whole[offset : offset + size], err_msg=f"{offset}+{size}")
    for offset, size in [(n - 3, 4), (-1, 2), (0, n + 1), (5, -1)]:
        with pytest.raises(ValueError, match="outside the dataset"):
            ds.window(offset, size)


def test_token_stream_over_a_dataset(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir)
    whole = raw_tokens(dataset_dir)
    a, b = TokenStream(ds, seed=3), TokenStream(TokenDataset(dataset_dir), seed=3)
    later = b.sample(40, 64)
    for i in (0, 1, 40, 10_000):
        s = a.sample(i, 64)
        offset = int(np.random.default_rng([3, i]).integers(0, len(ds) - 64))
        np.testing.assert_array_equal(s, whole[offset : offset + 65])
        np.testing.assert_array_equal(s, b.sample(i, 64))
    np.testing.assert_array_equal(a.sample(40, 64), later)
    assert not np.array_equal(a.sample(0, 64), TokenStream(ds, seed=4).sample(0, 64))
    x, y = a.batch([5, 6, 7], 32)
    assert x.shape == y.shape == (3, 32)
    np.testing.assert_array_equal(x[1].numpy(), a.sample(6, 32)[:-1])
    np.testing.assert_array_equal(y[1].numpy(), a.sample(6, 32)[1:])
    assert int(x.max()) < ds.vocab_size
    state = a.state_dict(step=9)
    assert state == {"seed": 3, "step": 9, "corpus_digest": ds.digest}
    assert b.load_state_dict(state) == 9
    with pytest.raises(ValueError, match="digest"):
        TokenStream(Corpus.from_bytes(b"x" * 100), seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="needs at least"):
        a.sample(0, len(ds))


def test_digest_is_stable_and_names_the_content(dataset_dir: Path, copy: Path) -> None:
    ds = TokenDataset(dataset_dir)
    assert ds.digest == TokenDataset(dataset_dir).digest == TokenDataset(copy).digest
    assert len(ds.digest) == 64
    m = json.loads((copy / "manifest.json").read_text())
    m["shards"][1]["sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(m))
    assert TokenDataset(copy).digest != ds.digest
    m = json.loads((dataset_dir / "manifest.json").read_text())
    m["tokenizer"]["sha256"] = "1" * 64
    (copy / "manifest.json").write_text(json.dumps(m))
    assert TokenDataset(copy).digest != ds.digest


def test_corrupt_shard_fails_verify_naming_the_shard(copy: Path) -> None:
    shard = copy / "tokens-00001.bin"
    data = bytearray(shard.read_bytes())
    data[101] ^= 0x01
    shard.write_bytes(bytes(data))
    ds = TokenDataset(copy)  # same size: opening is cheap and cannot tell
    with pytest.raises(DatasetError, match=r"tokens-00001\.bin: sha256 mismatch") as err:
        ds.verify()
    assert str(copy) in str(err.value) and "\n" not in str(err.value)


def test_damaged_tokenizer_copy_fails_verify(copy: Path) -> None:
    tok = copy / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|end|>"', 1))
    with pytest.raises(DatasetError, match=r"tokenizer\.json: sha256 mismatch"):
        TokenDataset(copy).verify()


def test_truncated_or_missing_shard(copy: Path) -> None:
    shard = copy / "tokens-00002.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"tokens-00002\.bin: \d+ bytes, expected \d+ .*trunc"):
        TokenDataset(copy)
    shard.unlink()
    with pytest.raises(DatasetError, match=r"tokens-00002\.bin: shard missing"):
        TokenDataset(copy)


def test_missing_or_bad_manifest(copy: Path, tmp_path: Path) -> None:
    manifest = copy / "manifest.json"
    good = manifest.read_text()
    manifest.unlink()
    with pytest.raises(DatasetError, match=r"manifest\.json: missing"):
        TokenDataset(copy)
    with pytest.raises(DatasetError, match=r"manifest\.json: no such directory"):
        TokenDataset(tmp_path / "nope")
    manifest.write_text(good[:50])
    with pytest.raises(DatasetError, match=r"manifest\.json: unreadable"):
        TokenDataset(copy)
    manifest.write_text(good.replace("geopipe-tokens/1", "geopipe-tokens/9"))
    with pytest.raises(DatasetError, match="format 'geopipe-tokens/9', expected"):
        TokenDataset(copy)
    m = json.loads(good)
    m["token_count"] += 1
    manifest.write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="but the shards hold"):
        TokenDataset(copy)
    m = json.loads(good)
    m["shards"][0]["file"] = "../escape.bin"
    manifest.write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="not a plain file name"):
        TokenDataset(copy)
    m = json.loads(good)
    del m["vocab_size"]
    manifest.write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="'vocab_size' missing"):
        TokenDataset(copy)


def test_open_corpus_picks_the_kind(dataset_dir: Path, tmp_path: Path) -> None:
    ds = open_corpus(str(dataset_dir))
    assert isinstance(ds, TokenDataset) and ds.digest == TokenDataset(dataset_dir).digest
    (tmp_path / "a.txt").write_bytes(b"hello world " * 10)
    for source in (tmp_path, tmp_path / "a.txt"):
        c = open_corpus(source, max_bytes=50)
        assert isinstance(c, Corpus) and len(c) == 50
    c = open_corpus("stdlib", max_bytes=1000)
    assert isinstance(c, Corpus) and c.vocab_size == VOCAB_SIZE == 256


def test_byte_corpus_window_matches_its_bytes() -> None:
    data = bytes(range(256)) * 4
    c = Corpus.from_bytes(data)
    w = c.window(250, 10)
    assert w.dtype == np.int64 and w.tolist() == list(data[250:260])
    s = TokenStream(c, seed=7).sample(2, 16)
    offset = int(np.random.default_rng([7, 2]).integers(0, len(data) - 16))
    assert s.tolist() == list(data[offset : offset + 17])

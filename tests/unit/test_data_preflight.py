"""The driver's check of ``training.data`` before Ray starts: a missing manifest, a corrupt
shard, a vocabulary past the model's embedding or a too-short corpus is a LaunchError naming
``training.data`` (the CLI turns it into one line and exit 2), never a crash mid-run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _tokdata import stdlib_sources, train_small_tokenizer

from geopipe.config import parse_cluster
from geopipe.model.prepare import prepare_data
from geopipe.model.tokens import TokenDataset
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.models import check_data_source


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pre")
    tok = train_small_tokenizer(tmp / "tok")
    out = tmp / "ds"
    prepare_data(stdlib_sources(3), tok, out, shard_tokens=2_000, progress=False)
    return out


def spec_for(data: str, vocab: int = 512, seq: int = 64):
    site = {"nodes": 1, "devices_per_node": 1, "device_memory_gb": 2, "device_tflops": 0.05}
    doc = {
        "name": "pre",
        "sites": [{"name": "a", **site}],
        "model": {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": vocab, "max_seq_len": seq},
        "training": {"global_batch_size": 2, "steps": 1, "lr": 0.001, "data": data},
    }
    return parse_cluster(doc, "test")


def test_a_good_dataset_passes_with_its_digest(dataset: Path) -> None:
    vocab = TokenDataset(dataset).vocab_size
    assert check_data_source(spec_for(str(dataset), vocab=vocab)) == TokenDataset(dataset).digest


def test_byte_corpus_passes(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    assert len(check_data_source(spec_for(str(tmp_path / "t.txt"), vocab=256))) == 64


def test_vocabulary_past_the_model_is_refused(dataset: Path) -> None:
    vocab = TokenDataset(dataset).vocab_size
    want = rf"training\.data: .* vocabulary of {vocab} .* has {vocab - 1}"
    with pytest.raises(LaunchError, match=want):
        check_data_source(spec_for(str(dataset), vocab=vocab - 1))
    with pytest.raises(LaunchError, match=r"vocabulary of 256 .* has 100"):
        check_data_source(spec_for("stdlib", vocab=100))


def test_corrupt_shard_is_refused(dataset: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(dataset, tmp_path / "ds"))
    shard = sorted(bad.glob("tokens-*.bin"))[1]
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF  # same size: only the hash can tell
    shard.write_bytes(bytes(raw))
    vocab = TokenDataset(bad).vocab_size
    with pytest.raises(LaunchError, match=rf"training\.data: .*{shard.name}: sha256 mismatch"):
        check_data_source(spec_for(str(bad), vocab=vocab))


def test_missing_manifest_is_refused_not_read_as_text(dataset: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(dataset, tmp_path / "ds"))
    (bad / "manifest.json").unlink()
    with pytest.raises(LaunchError, match=r"training\.data: .*manifest\.json: missing"):
        check_data_source(spec_for(str(bad), vocab=4096))


def test_missing_path_and_short_corpus(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"training\.data: .* does not exist"):
        check_data_source(spec_for(str(tmp_path / "nope")))
    (tmp_path / "t.txt").write_text("x" * 2000)
    with pytest.raises(LaunchError, match="fewer than one sample"):
        check_data_source(spec_for(str(tmp_path / "t.txt"), vocab=256, seq=4096))

"""The validated YAML's model and data, as the stage actors, calibration and checkpoints need
them, and the driver's check of the data before any actor starts.

The one conversion of :class:`~geopipe.config.ModelSpec` into the runtime's
:class:`~geopipe.model.family.ModelDesc` (shipped to every actor over Ray) and into a
checkpoint manifest's ``model`` entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geopipe.config import ClusterSpec, ModelSpec
from geopipe.model.data import open_corpus
from geopipe.model.family import ModelDesc
from geopipe.model.tokens import DatasetError, TokenDataset
from geopipe.runtime.control.cluster import LaunchError

__all__ = ["check_data_source", "model_desc", "model_manifest", "model_shape"]


def model_desc(m: ModelSpec) -> ModelDesc:
    """What a stage actor builds its layers from: the built-in GPT's shape, or a
    `transformers` family's config.json (and its weights' directory, when it has them)."""
    if m.family == "gpt":
        return ModelDesc(
            "gpt",
            m.n_layer,
            m.n_embd,
            m.vocab_size,
            gpt={
                "n_layer": m.n_layer,
                "n_embd": m.n_embd,
                "n_head": m.n_head,
                "vocab_size": m.vocab_size,
                "block_size": m.max_seq_len,
            },
        )
    config = json.loads((Path(m.hf) / "config.json").read_text())
    return ModelDesc.from_hf(config, weights_dir=m.hf if m.hf_weights else None)


def model_shape(spec: ClusterSpec) -> dict[str, Any]:
    """The model fields a checkpoint must match to be resumed by this run (the family too,
    for `transformers` models: a Llama and a Mistral of one shape are different models)."""
    m = spec.model
    shape: dict[str, Any] = {
        "n_layer": m.n_layer,
        "n_embd": m.n_embd,
        "n_head": m.n_head,
        "vocab_size": m.vocab_size,
        "max_seq_len": m.max_seq_len,
    }
    if m.family != "gpt":
        shape["family"] = m.family
    return shape


def model_manifest(spec: ClusterSpec) -> dict[str, Any]:
    """A checkpoint manifest's ``model``: :func:`model_shape`, and for a `transformers`
    model its config.json and tying, so ``geopipe export`` can rebuild it."""
    out = model_shape(spec)
    if spec.model.family != "gpt":
        desc = model_desc(spec.model)
        out.update(tie_embeddings=desc.tie, hf_config=desc.hf_config)
    return out


def check_data_source(spec: ClusterSpec) -> str:
    """Open ``training.data`` in the driver, before Ray starts, and refuse what would fail
    mid-run: a missing or damaged dataset (every shard's sha256 is checked — hashing runs
    at disk speed, ~1 GB/s, against a run of hours), a vocabulary larger than the model's
    (token ids past the embedding), or a corpus shorter than one sample. Builds the
    built-in ``stdlib-bpe`` dataset into this node's cache on first use, so the actors find
    it there. Returns the corpus digest."""
    t = spec.training
    try:
        corpus = open_corpus(t.data, max_bytes=t.data_max_bytes)
        if isinstance(corpus, TokenDataset):
            corpus.verify()
    except (DatasetError, OSError, ValueError) as exc:
        raise LaunchError(f"training.data: {exc}") from None
    vocab = spec.model.vocab_size
    if corpus.vocab_size > vocab:
        raise LaunchError(
            f"training.data: {t.data!r} has a vocabulary of {corpus.vocab_size} tokens but the "
            f"model's embedding has {vocab}: use a dataset made with the model's tokenizer"
        )
    need = spec.model.max_seq_len + 1
    if len(corpus) < need:
        raise LaunchError(
            f"training.data: {t.data!r} holds {len(corpus)} tokens, fewer than one sample "
            f"({need} tokens)"
        )
    return corpus.digest

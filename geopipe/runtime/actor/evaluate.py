"""Held-out evaluation on a stage replica: forward only, through the pipeline's own links.

``training.eval`` (:mod:`geopipe.config.observe`) evaluates ``batches`` global batches of
held-out sequences between two optimizer steps. The held-out set is fixed for the run: eval
sample ``i`` is a window of the held-out data drawn from ``(eval seed, i)`` exactly as a
training sample is (:class:`~geopipe.model.data.TokenStream`), so every evaluation reads the
same sequences and a reference (``transformers`` in one process) can replay them. The
sequences are cut into the plan's micro-batches; micro-batch ``i`` goes to pipeline
``i mod pipelines``. Each pipeline's first stage embeds its micro-batches and sends them down
under the keys ``("E", step, j)`` (the training keys' form, another kind), every later stage
receives, runs forward under ``torch.no_grad`` in eval mode and sends on, and the last stage
returns each micro-batch's loss. Nothing is stored for backward, no optimizer state moves,
and the links carry the activations with their configured codecs, as training's do.

The held-out data is either a dataset of its own (``training.eval.data``) or the last
``holdout`` share of the training data's tokens (:func:`split_corpus`); then the training
stream samples only the part before it, and that part's digest (not the whole corpus's)
is the run's data digest, so a checkpoint written with a split resumes only with the same
split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from geopipe.model.data import TokenStream, open_corpus
from geopipe.model.gpt import lm_loss

__all__ = [
    "EVAL_SEED_SALT",
    "EvalSetup",
    "HeldOut",
    "StageEval",
    "eval_samples",
    "run_eval",
    "split_corpus",
]

# The held-out stream's seed is the training seed plus this (its samples are drawn apart
# from training's even when the held-out data is the training data itself).
EVAL_SEED_SALT = 0x5EED_E7A1


@dataclass(frozen=True)
class EvalSetup:
    """``training.eval`` as a stage replica needs it (plain data, shipped over Ray)."""

    data: str | None  # a dataset of its own, or None: the training data's held-out tail
    holdout: float
    sequences: int  # held-out sequences per evaluation (batches × global batch)
    seed: int  # the training seed (the eval stream's is this + EVAL_SEED_SALT)
    data_max_bytes: int


class HeldOut:
    """Tokens ``[start, end)`` of a corpus as a corpus of its own (what
    :class:`~geopipe.model.data.TokenStream` reads: ``len``, ``window``, ``digest``)."""

    def __init__(self, corpus: Any, start: int, end: int, part: str) -> None:
        self.corpus, self.start, self.end, self.part = corpus, start, end, part
        self.source = f"{corpus.source}[{part}: tokens {start}..{end}]"

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    def window(self, offset: int, n: int) -> np.ndarray:
        if offset < 0 or offset + n > len(self):
            raise IndexError(f"window [{offset}, {offset + n}) outside {self.source}")
        return self.corpus.window(self.start + offset, n)

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.corpus.digest}[{self.start}:{self.end}]".encode()).hexdigest()


def split_corpus(corpus: Any, holdout: float, seq_len: int) -> tuple[HeldOut, HeldOut]:
    """(training part, held-out part): the last ``holdout`` share of the tokens is held out;
    each part must hold at least one sample (``seq_len + 1`` tokens)."""
    n = len(corpus)
    held = int(n * holdout)
    cut = n - held
    need = seq_len + 1
    if held < need or cut < need:
        raise ValueError(
            f"training.eval.holdout: {holdout:g} of {corpus.source!r} ({n} tokens) holds out "
            f"{held} tokens and leaves {cut} for training; each part needs at least {need} "
            "(a sample of seq_len + 1): give a larger share, more data, or training.eval.data"
        )
    return HeldOut(corpus, 0, cut, "train"), HeldOut(corpus, cut, n, "held out")


def eval_samples(sequences: int, micro_batch_size: int, pipelines: int, pipeline: int) -> list:
    """The held-out sample indices of each micro-batch ``pipeline`` evaluates: micro-batch
    ``i`` holds samples ``[i*b, (i+1)*b)`` and goes to pipeline ``i mod pipelines`` (a last,
    short micro-batch is dropped: ``sequences`` is a multiple of the global batch, which the
    micro-batch divides)."""
    total = sequences // micro_batch_size
    return [
        list(range(i * micro_batch_size, (i + 1) * micro_batch_size))
        for i in range(pipeline, total, pipelines)
    ]


def held_out_stream(setup: EvalSetup, train_corpus: Any, seq_len: int) -> tuple[Any, TokenStream]:
    """(the corpus training should sample, the held-out stream) for a first or last stage
    holding ``train_corpus`` (the training data as opened, or as split before)."""
    seed = setup.seed + EVAL_SEED_SALT
    if isinstance(train_corpus, HeldOut):  # set again (a new layout): split the whole anew
        train_corpus = train_corpus.corpus
    if setup.data is not None:
        return train_corpus, TokenStream(open_corpus(setup.data, setup.data_max_bytes), seed)
    train, held = split_corpus(train_corpus, setup.holdout, seq_len)
    return train, TokenStream(held, seed)


@dataclass
class EvalStage:
    """What :func:`run_eval` needs of the stage replica running it."""

    engine: Any  # the StageEngine: module, device, dtype
    links: Any  # the StageLinks
    first: bool
    last: bool
    shape: tuple[int, int, int]  # an activation: (micro-batch, sequence, hidden)
    recv_timeout_s: float


def run_eval(
    st: EvalStage, stream: TokenStream | None, samples: list, step: int, seq_len: int
) -> list[float]:
    """Forward ``samples`` (one list of indices per micro-batch) through this stage without
    gradients; the last stage returns each micro-batch's mean loss, the others []."""
    engine, links = st.engine, st.links
    keys = [("E", step, j) for j in range(len(samples))]
    links.expect([] if st.first else keys, [], st.shape, engine.dtype)
    module = engine.module
    was_training = module.training
    module.eval()
    losses = []
    try:
        with torch.no_grad():
            for j, key in enumerate(keys):
                if st.first:
                    x = stream.batch(samples[j], seq_len)[0].to(engine.device)
                else:
                    got = links.inbox.get(key, timeout=st.recv_timeout_s)
                    x = got.to(engine.device).to(engine.dtype)
                out = module(x)
                if st.last:
                    y = stream.batch(samples[j], seq_len)[1].to(engine.device)
                    losses.append(float(lm_loss(out, y)))
                else:
                    links.send_forward(key, out)
        links.finish()
    finally:
        module.train(was_training)
    return losses


class StageEval:
    """A stage replica's evaluation state (``StageWorker.set_eval`` makes it): the held-out
    stream of a first or last stage, which also narrows the stage's training stream to the
    training part when the held-out data is the training data's tail."""

    def __init__(self, setup: EvalSetup, stage: Any) -> None:
        self.setup = setup
        self.stream: TokenStream | None = None
        if stage.stream is not None:
            train, self.stream = held_out_stream(setup, stage.stream.corpus, stage.plan.seq_len)
            stage.stream = TokenStream(train, stage.spec.seed)

    def run(self, stage: Any, step: int) -> dict[str, Any]:
        """This replica's share of one evaluation (``stage`` is the StageWorker)."""
        plan, spec = stage.plan, stage.spec
        samples = eval_samples(
            self.setup.sequences, plan.micro_batch_size, plan.pipelines, spec.replica
        )
        st = EvalStage(
            stage.engine, stage.links, stage.first, stage.last, stage.shape, spec.recv_timeout_s
        )
        losses = run_eval(st, self.stream, samples, step, plan.seq_len)
        return {"stage": stage.k, "pipeline": spec.replica, "group": spec.group, "losses": losses}

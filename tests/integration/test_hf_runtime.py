"""Tier 2: Hugging Face families trained across two emulated sites, against `transformers`.

Each test writes a tiny model with ``save_pretrained`` (so both sides start from the same
pretrained weights), launches the real runtime on it (Ray actors, DeepSpeed ZeRO-1, the
direct data plane, codec none, fp32) and replays the same batches through the
`transformers` model in this process with torch Adam and the same LR schedule.
"""

from __future__ import annotations

import copy
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from _hfdoc import LLAMA, two_site_hf_doc
from _tokdata import stdlib_sources, train_small_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from geopipe.config import parse_cluster
from geopipe.model.data import TokenStream, global_indices, open_corpus
from geopipe.model.gpt import lm_loss
from geopipe.model.prepare import prepare_data
from geopipe.runtime.actor.lr import lr_factor
from geopipe.runtime.control.controller import Controller, LaunchOptions

pytestmark = pytest.mark.ray

# The runtime around a stage is the same for every family; what differs per family (the
# stage's modules, forward and backward) is checked against `transformers` in the unit tier
# (tests/unit/test_hf_stage.py: Llama, Qwen2, Mistral; test_hf_families.py: the rest). Here
# the two runs the module's other tests need: a tied embedding split over two sites (the
# pipeline's tied-weight sync) and an untied one.
FAMILIES = {
    "llama-gqa-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "llama-gqa-untied": (LlamaConfig, {"tie_word_embeddings": False}),
}


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def save_model(tmp: Path, name: str, **override) -> Path:
    cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**LLAMA, **extra, **override}))
    out = tmp / f"model-{name}"
    model.save_pretrained(out)
    return out


def hf_doc(model_dir: Path, name: str, steps: int = 3, precision: str = "fp32") -> dict:
    """Two sites of one device each, one pipeline of two stages, codec none."""
    return two_site_hf_doc(f"hf-{name}-{precision}", model_dir, steps=steps, precision=precision)


def launch(doc: dict, tmp: Path, resume: str | bool = False, state: dict | None = None):
    spec = parse_cluster(doc, "test")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp), progress=False, resume=resume))
    try:
        ctl.launch()
        steps = ctl.train().steps
        if state is not None:
            state.update(ctl.gather_state())
        return ctl, steps
    finally:
        ctl.close()


def reference(doc: dict, model_dir: Path, trained: list | None = None) -> tuple[list, list]:
    """`transformers` in one process: per-step mean loss and gradient norm (the tied weight
    counted once per copy the pipeline holds, as the runtime reports it)."""
    spec = parse_cluster(doc, "ref")
    t, pl = spec.training, spec.plan
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(lr_factor, warmup_steps=t.warmup_steps, total_steps=t.steps)
    )
    stream = TokenStream(open_corpus(t.data, max_bytes=t.data_max_bytes), t.seed)
    b, s = pl.micro_batch_size, pl.seq_len
    micro = t.global_batch_size // b
    tied = model.config.tie_word_embeddings
    losses, norms = [], []
    for step in range(t.steps):
        opt.zero_grad()
        step_losses = []
        for mb in range(micro):
            x, y = stream.batch(global_indices(step, t.global_batch_size, 0, 1, mb, b), s)
            loss = lm_loss(model(input_ids=x).logits, y)
            (loss / micro).backward()
            step_losses.append(loss.item())
        sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
        if tied:  # two copies in the pipeline, each with the summed gradient
            sq += float(model.model.embed_tokens.weight.grad.pow(2).sum())
        norms.append(math.sqrt(sq))
        opt.step()
        sched.step()
        losses.append(sum(step_losses) / len(step_losses))
    if trained is not None:
        trained.append(model)
    return losses, norms


@pytest.fixture(scope="module")
def token_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset (512-token BPE over a few stdlib files), as prepare-data makes it."""
    tmp = tmp_path_factory.mktemp("tokens")
    tok = train_small_tokenizer(tmp / "tok", vocab=512)
    prepare_data(stdlib_sources(6), tok, tmp / "ds", shard_tokens=4_000, progress=False)
    return tmp / "ds"


# The family whose fp32 run trains on the prepared token dataset (BPE, vocabulary 512)
# instead of the stdlib's bytes: that run is also the token-dataset test's.
ON_TOKENS = "llama-gqa-tied"


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory: pytest.TempPathFactory, token_dataset: Path):
    """``fp32_runs(name)``: (model directory, document, controller, steps) of the 3-step
    fp32 run of family ``name`` (:data:`ON_TOKENS` on the token dataset), launched once for
    every test of the module that trains it (the family's parity test, the bf16 comparison,
    the token-dataset test; a launch costs seconds of actor start-up). Callers must not
    modify what they get."""
    done: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            if name == ON_TOKENS:
                model_dir = save_model(tmp, name, vocab_size=512)
                doc = hf_doc(model_dir, name)
                doc["training"]["data"] = str(token_dataset)
            else:
                model_dir = save_model(tmp, name)
                doc = hf_doc(model_dir, name)
            done[name] = (model_dir, doc, *launch(doc, tmp / "run"))
        return done[name]

    return get


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hf_family_across_two_sites_matches_transformers(fp32_runs, name: str) -> None:
    model_dir, doc, ctl, steps = fp32_runs(name)
    assert ctl.plan.stage_sites == ("east", "west")
    ref_losses, ref_norms = reference(doc, model_dir)
    assert [m.loss for m in steps] == pytest.approx(ref_losses, abs=1e-5)
    assert steps[0].grad_norm == pytest.approx(ref_norms[0], rel=1e-5)
    assert [m.grad_norm for m in steps] == pytest.approx(ref_norms, rel=1e-4)


def test_token_dataset_trains_like_transformers_and_exports(
    tmp_path: Path, token_dataset: Path, fp32_runs
) -> None:
    """A tied Llama over a prepared token dataset (BPE ids up to 511, several shards; the
    family test's :data:`ON_TOKENS` run): the same losses as `transformers` reading the
    same dataset; then `geopipe export` of the run loads in `transformers` as the model
    trained in-process (logits to 1e-4), with the dataset's tokenizer."""
    from transformers import AutoTokenizer

    from geopipe.cli import main

    model_dir, doc, ctl, steps = fp32_runs(ON_TOKENS)
    assert doc["training"]["data"] == str(token_dataset)
    trained: list = []
    ref_losses, _ = reference(doc, model_dir, trained)
    assert [m.loss for m in steps] == pytest.approx(ref_losses, abs=1e-5)
    assert steps[0].loss > 5.0  # ln(512) ≈ 6.2: BPE ids, not bytes
    assert main(["export", str(ctl.run_dir), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    untrained = AutoModelForCausalLM.from_pretrained(model_dir)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = exported(input_ids=x).logits, trained[0](input_ids=x).logits
        before = untrained(input_ids=x).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - before).abs().max().item() > 1e-2  # it is the trained model
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (
        tok("def f(): pass")["input_ids"]
        == AutoTokenizer.from_pretrained(token_dataset / "tokenizer")("def f(): pass")["input_ids"]
    )


def test_bf16_resume_is_exact(tmp_path: Path, token_dataset: Path) -> None:
    """bf16 with a tied embedding split over two sites, on a token dataset: 4 steps straight
    == resuming from the step-2 checkpoint for 2 more, losses and final fp32 master
    weights and Adam state bitwise (the tied head's copy restores from its own tensor)."""
    model_dir = save_model(tmp_path, "llama-gqa-tied", vocab_size=512)
    doc = hf_doc(model_dir, "bf16resume", steps=4, precision="bf16")
    doc["training"]["data"] = str(token_dataset)
    doc["training"]["checkpoint"] = {"every_steps": 2, "keep": 3}
    full_state: dict = {}
    _, full = launch(doc, tmp_path / "a", state=full_state)
    resumed_state: dict = {}
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000002"
    ctl, second = launch(doc, tmp_path / "b", resume=str(ckpt), state=resumed_state)
    assert ctl.start_step == 2
    assert [m.loss for m in second] == [m.loss for m in full[2:]]
    for group in ("params", "exp_avg", "exp_avg_sq"):
        assert full_state[group].keys() == resumed_state[group].keys()
        for name, t in full_state[group].items():
            assert torch.equal(t, resumed_state[group][name]), (group, name)


def test_bf16_trains_in_bf16_and_halves_activations(tmp_path: Path, fp32_runs) -> None:
    """The same Llama in bf16: close to fp32 (3 steps: within 2 %); what crosses the WAN is
    bf16 (codec none: exactly half fp32's bytes); the activations a stage holds shrink too,
    though not to half: RMSNorm and the loss upcast to fp32 and keep those copies. The fp32
    run is the family test's (the same seeded model, document and batches)."""
    model_dir, _, _, fp32 = fp32_runs("llama-gqa-untied")
    doc = hf_doc(model_dir, "bf16run", precision="bf16")
    _, bf16 = launch(doc, tmp_path / "bf16")
    for a, b in zip(fp32, bf16, strict=True):
        assert a.loss != b.loss and abs(a.loss - b.loss) / a.loss < 0.02
        assert b.wan_bytes * 2 == pytest.approx(a.wan_bytes, rel=0.01)
    ratio = [
        b / a
        for a, b in zip(fp32[-1].peak_activation_bytes, bf16[-1].peak_activation_bytes, strict=True)
    ]
    assert all(0.45 <= r <= 0.65 for r in ratio), ratio


def test_unsupported_precision_on_cpu_is_a_clear_launch_error(tmp_path: Path) -> None:
    from geopipe.runtime.control.cluster import LaunchError

    model_dir = save_model(tmp_path, "llama-gqa-untied")
    doc = copy.deepcopy(hf_doc(model_dir, "fp16", precision="fp16"))
    spec = parse_cluster(doc, "test")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path / "r"), progress=False))
    try:
        with pytest.raises(LaunchError, match="fp16"):
            ctl.launch()
    finally:
        ctl.close()

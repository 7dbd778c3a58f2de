"""``prepare_data`` / ``geopipe prepare-data``: exact tokens per input kind, byte-identical
output whatever the process count, clear one-line errors, and the built-in stdlib-bpe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _tokdata import SMALL_VOCAB, stdlib_sources, train_small_tokenizer

from geopipe.cli import main
from geopipe.model import prepare
from geopipe.model.builtin import (
    EOS_TOKEN,
    STDLIB_BPE_VOCAB,
    cache_root,
    ensure_stdlib_bpe,
    stdlib_bpe_files,
)
from geopipe.model.inputs import collect_inputs
from geopipe.model.prepare import OutputExistsError, prepare_data
from geopipe.model.tokens import DatasetError, TokenDataset, choose_dtype

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_small_tokenizer(tmp_path_factory.mktemp("tok") / "small-bpe")


@pytest.fixture(scope="session")
def tok(tok_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def expected_tokens(tok: Any, docs: list[str]) -> list[int]:
    """Each non-empty document tokenized on its own (special-token text as plain text) + EOS."""
    out: list[int] = []
    for d in docs:
        if d:
            ids = tok(d, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            out += [*ids, tok.eos_token_id]
    return out


def all_tokens(path: Path) -> list[int]:
    ds = TokenDataset(path)
    return ds.window(0, len(ds)).tolist()


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_jsonl_parquet_give_the_tokens_of_each_document(
    tmp_path: Path, tok_dir: Path, tok: Any
) -> None:
    src = tmp_path / "in"
    (src / "b").mkdir(parents=True)
    (src / "b" / "z.md").write_text("# Zed\n\nlast by path")
    (src / "a.txt").write_text("plain text, one document\nover two lines\n")
    (src / "empty.txt").write_text("")  # skipped: no document, no EOS
    (src / ".hidden.txt").write_text("never read")
    (src / "c.bin").write_bytes(b"\0\1\2binary")  # skipped inside a directory
    rows = [{"text": "first line doc", "id": 1}, {"text": "é ünïcode ☃ doc"}, {"text": ""}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n\n   \n" for r in rows))  # blank lines skipped
    pq_docs = ["parquet one", "parquet two\nwith newline", "three", "def f(x):\n    return x\n"]
    pq.write_table(
        pa.table({"id": list(range(4)), "body": pq_docs}),
        tmp_path / "e.parquet",
        row_group_size=3,
    )
    m = prepare_data([src, jsonl], tok_dir, tmp_path / "out", progress=False)
    docs = [
        "plain text, one document\nover two lines\n",
        "# Zed\n\nlast by path",
        "first line doc",
        "é ünïcode ☃ doc",
    ]
    want = expected_tokens(tok, docs)
    assert all_tokens(tmp_path / "out") == want
    assert m["documents"] == 4 and m["token_count"] == len(want)
    assert m["sources"] == [str(src), str(jsonl)]
    # Parquet, another field name, and several row groups.
    m = prepare_data(
        [tmp_path / "e.parquet"], tok_dir, tmp_path / "out-pq", text_field="body", progress=False
    )
    assert all_tokens(tmp_path / "out-pq") == expected_tokens(tok, pq_docs)
    assert m["documents"] == 4 and m["text_field"] == "body"


def test_manifest_fields(tmp_path: Path, tok_dir: Path, tok: Any) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("x = 1\n")
    m = prepare_data([doc], tok_dir, tmp_path / "out", progress=False)
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk == m
    assert m["format"] == "geopipe-tokens/1"
    assert m["vocab_size"] == len(tok) == SMALL_VOCAB
    assert m["eos_token_id"] == tok.convert_tokens_to_ids(EOS_TOKEN)
    assert m["dtype"] == "uint16" and m["input_bytes"] == 6
    assert m["tokenizer"]["name"] == "small-bpe" and m["tokenizer"]["dir"] == "tokenizer"
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()
    [shard] = m["shards"]
    assert shard["file"] == "tokens-00000.bin" and shard["tokens"] == m["token_count"]
    assert (tmp_path / "out" / shard["file"]).stat().st_size == 2 * shard["tokens"]


def test_special_token_text_is_plain_text_so_eos_only_ends_documents(
    tmp_path: Path, tok_dir: Path
) -> None:
    rows = [{"text": f"doc {i} says <|endoftext|> inside"} for i in range(5)]
    m = prepare_data(
        [write_jsonl(tmp_path / "a.jsonl", rows)], tok_dir, tmp_path / "out", progress=False
    )
    tokens = np.array(all_tokens(tmp_path / "out"))
    ends = np.flatnonzero(tokens == m["eos_token_id"])
    assert len(ends) == m["documents"] == 5
    assert ends[-1] == len(tokens) - 1


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_byte_identical_whatever_the_process_count(
    tmp_path: Path, tok_dir: Path, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "_TASK_BYTES", 8_000)  # many tasks, so the pool shares them out
    files = stdlib_sources(12)
    rows = [{"text": p.read_text(encoding="utf-8", errors="replace")[:3000]} for p in files]
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    inputs = [*files, jsonl]
    assert len(prepare._plan(collect_inputs(inputs), "text")) >= 6
    pools: list[int] = []

    class Spy(prepare.ProcessPoolExecutor):
        def __init__(self, processes: int, *args: Any, **kwargs: Any) -> None:
            pools.append(processes)
            super().__init__(processes, *args, **kwargs)

    monkeypatch.setattr(prepare, "ProcessPoolExecutor", Spy)
    outs = []
    for n in (1, 2, 3):
        out = tmp_path / f"out{n}"
        prepare_data(inputs, tok_dir, out, processes=n, shard_tokens=5_000, progress=False)
        outs.append(_tree(out))
    assert pools == [2, 3]  # one process ran in this one
    assert outs[0] == outs[1] == outs[2]
    shards = [k for k in outs[0] if k.startswith("tokens-")]
    assert len(shards) >= 3
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    docs += [r["text"] for r in rows]
    assert all_tokens(tmp_path / "out2") == expected_tokens(tok, docs)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left"


def test_dtype_choice() -> None:
    assert choose_dtype(256) == choose_dtype(65535) == "uint16"
    assert choose_dtype(65536) == choose_dtype(200_000) == "uint32"
    with pytest.raises(ValueError):
        choose_dtype(0)


def test_large_vocab_is_stored_as_uint32(tmp_path: Path, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    # 65,100 more entries in the BPE's vocabulary (no text reaches them) and one added token
    # after them: a vocabulary past uint16 in ~1 s (65,100 added tokens took ~4 s)
    wide = tmp_path / "wide"
    shutil.copytree(tok_dir, wide)
    doc = json.loads((wide / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    vocab.update({f"\u0120unused{i}": len(vocab) + i for i in range(65_100)})
    (wide / "tokenizer.json").write_text(json.dumps(doc))
    big = AutoTokenizer.from_pretrained(str(wide), local_files_only=True)
    big.add_tokens(["<t65099>"])
    big.save_pretrained(str(tmp_path / "big"))
    top = len(big) - 1  # <t65099>, id 65612: does not fit in uint16
    text = "a <t65099> b c"
    (tmp_path / "a.txt").write_text(text)
    m = prepare_data([tmp_path / "a.txt"], tmp_path / "big", tmp_path / "out", progress=False)
    assert m["dtype"] == "uint32" and m["vocab_size"] == len(big) > 65535
    tokens = all_tokens(tmp_path / "out")
    assert tokens == expected_tokens(big, [text])
    assert top in tokens
    assert (tmp_path / "out" / "tokens-00000.bin").stat().st_size == 4 * len(tokens)


def test_jsonl_line_without_the_field_names_file_and_line(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare, "_TASK_BYTES", 100)  # the bad line lies in a later task
    rows: list[Any] = [{"text": f"row {i} " * 5} for i in range(30)]
    rows[23] = {"txt": "typo"}
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(DatasetError, match=r"a\.jsonl:24: no 'text' field$"):
        prepare_data([path], tok_dir, tmp_path / "out", progress=False)
    rows[23] = {"text": 5}
    write_jsonl(path, rows)
    with pytest.raises(DatasetError, match=r"a\.jsonl:24: field 'text' is int, not a string"):
        prepare_data([path], tok_dir, tmp_path / "out", processes=2, progress=False)
    path.write_text('{"text": "ok"}\n{"text": "unterminated\n')
    with pytest.raises(DatasetError, match=r"a\.jsonl:2: not valid JSON"):
        prepare_data([path], tok_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left"


def test_parquet_without_the_column_or_with_nulls(tmp_path: Path, tok_dir: Path) -> None:
    pq.write_table(pa.table({"body": ["a", None, "c"]}), tmp_path / "a.parquet")
    with pytest.raises(DatasetError, match=r"a\.parquet: no column 'text' \(columns: body\)"):
        prepare_data([tmp_path / "a.parquet"], tok_dir, tmp_path / "out", progress=False)
    with pytest.raises(DatasetError, match=r"a\.parquet: row 1: 'body' is null"):
        prepare_data(
            [tmp_path / "a.parquet"], tok_dir, tmp_path / "out", text_field="body", progress=False
        )
    (tmp_path / "b.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"b\.parquet: not a readable Parquet file"):
        prepare_data([tmp_path / "b.parquet"], tok_dir, tmp_path / "out", progress=False)


def test_bad_tokenizer_dirs(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match=r"empty: no tokenizer \(no tokenizer\.json"):
        prepare_data([tmp_path / "a.txt"], empty, tmp_path / "out")
    with pytest.raises(DatasetError, match="nope: not a directory"):
        prepare_data([tmp_path / "a.txt"], tmp_path / "nope", tmp_path / "out")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(DatasetError, match="broken: cannot load the tokenizer: ") as err:
        prepare_data([tmp_path / "a.txt"], broken, tmp_path / "out")
    assert "\n" not in str(err.value)


def test_tokenizer_without_eos_is_refused(tmp_path: Path, tok: Any) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer).save_pretrained(
        str(tmp_path / "no-eos")
    )
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(DatasetError, match="no-eos: the tokenizer has no EOS token"):
        prepare_data([tmp_path / "a.txt"], tmp_path / "no-eos", tmp_path / "out")


def test_inputs_errors(tmp_path: Path, tok_dir: Path) -> None:
    with pytest.raises(DatasetError, match=r"missing\.txt: no such file or directory"):
        prepare_data([tmp_path / "missing.txt"], tok_dir, tmp_path / "out")
    (tmp_path / "x.bin").write_bytes(b"\0\0\0")
    with pytest.raises(DatasetError, match=r"x\.bin: not a text, JSONL or Parquet file"):
        prepare_data([tmp_path / "x.bin"], tok_dir, tmp_path / "out")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DatasetError, match=r"empty\.txt: no documents"):
        prepare_data([tmp_path / "empty.txt"], tok_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused_unless_overwrite(
    tmp_path: Path, tok_dir: Path, tok: Any
) -> None:
    (tmp_path / "a.txt").write_text("first")
    out = tmp_path / "out"
    prepare_data([tmp_path / "a.txt"], tok_dir, out, progress=False)
    (tmp_path / "a.txt").write_text("second version")
    with pytest.raises(OutputExistsError, match="out: exists"):
        prepare_data([tmp_path / "a.txt"], tok_dir, out, progress=False)
    assert all_tokens(out) == expected_tokens(tok, ["first"])
    prepare_data([tmp_path / "a.txt"], tok_dir, out, progress=False, overwrite=True)
    assert all_tokens(out) == expected_tokens(tok, ["second version"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]


def test_output_inside_an_input_directory_is_not_read_back(
    tmp_path: Path, tok_dir: Path, tok: Any
) -> None:
    (tmp_path / "a.txt").write_text("only me")
    prepare_data([tmp_path], tok_dir, tmp_path / "tok", progress=False)
    prepare_data([tmp_path], tok_dir, tmp_path / "tok", progress=False, overwrite=True)
    assert all_tokens(tmp_path / "tok") == expected_tokens(tok, ["only me"])


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_cli(tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"content": f"document number {i}"} for i in range(7)]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    out = tmp_path / "out"
    args = [str(src), "--tokenizer", str(tok_dir), "--out", str(out), "--text-field", "content"]
    code, stdout, _ = _cli(capsys, "prepare-data", *args, "--no-progress", "--processes", "2")
    assert code == 0
    ds = TokenDataset(out)
    assert stdout.startswith(f"{out}: 7 documents, {len(ds):,} tokens (uint16, vocab 512) in 1 ")
    assert "MB/s)" in stdout and stdout.count("\n") == 1
    code, _, err = _cli(capsys, "prepare-data", *args, "--no-progress")
    assert code == 2 and err == f"geopipe: {out}: exists (overwrite it with --overwrite)\n"
    assert _cli(capsys, "prepare-data", *args, "--no-progress", "--overwrite")[0] == 0
    write_jsonl(src, [*rows, {"text": "wrong field"}])
    code, _, err = _cli(capsys, "prepare-data", *args, "--no-progress", "--overwrite")
    assert code == 2 and err == f"geopipe: {src}:8: no 'content' field\n"
    bad_tok = ["prepare-data", str(src), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o")]
    code, _, err = _cli(capsys, *bad_tok)
    assert code == 2
    assert (
        err == f"geopipe: {tmp_path}: no tokenizer (no tokenizer.json or tokenizer_config.json)\n"
    )
    assert _cli(capsys, "prepare-data", str(src), "--out", "x")[0] == 2  # --tokenizer required


def test_stdlib_bpe_build_and_reuse(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = ensure_stdlib_bpe(tmp_path)
    assert path == tmp_path / "stdlib-bpe-4096"
    ds = TokenDataset(path)
    ds.verify()
    tok = AutoTokenizer.from_pretrained(str(ds.tokenizer_dir), local_files_only=True)
    assert len(tok) == ds.vocab_size == STDLIB_BPE_VOCAB
    assert tok.eos_token == EOS_TOKEN and ds.eos_token_id == tok.eos_token_id
    tokens = ds.window(0, len(ds))
    ends = np.flatnonzero(tokens == ds.eos_token_id)
    files = stdlib_bpe_files()
    assert len(ends) == ds.documents == sum(1 for p in files if p.stat().st_size)
    assert ends[-1] == len(ds) - 1
    first = next(p for p in files if p.stat().st_size)
    assert tok.decode(tokens[: ends[0]].tolist()) == first.read_text()
    assert len(ds) > 1_000_000
    stamps = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert ensure_stdlib_bpe(tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamps  # not rebuilt


def test_concurrent_stdlib_bpe_builders_agree(tmp_path: Path) -> None:
    """Two processes building at once: one rename wins, both return a valid dataset.

    Each builds from the stdlib's first 300 kB (not the 8 MB the demo's dataset takes: the
    race is the same) and starts only once both have imported, so the builds overlap."""
    code = """if True:
        import sys, time
        from pathlib import Path
        import geopipe.model.builtin as b
        from geopipe.model.tokens import TokenDataset
        files = b.stdlib_bpe_files
        b.stdlib_bpe_files = lambda: files(300_000)
        gate = Path(sys.argv[2])
        (gate / sys.argv[3]).touch()
        while len(list(gate.iterdir())) < 2:
            time.sleep(0.01)
        print(TokenDataset(b.ensure_stdlib_bpe(sys.argv[1])).digest)
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (gate := tmp_path.parent / f"{tmp_path.name}-gate").mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), str(gate), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    digests = {r[0].strip() for r in results}
    assert len(digests) == 1
    assert TokenDataset(tmp_path / "stdlib-bpe-4096").digest in digests
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stdlib-bpe-4096"]


def test_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOPIPE_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("GEOPIPE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "geopipe"

import filecmp
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_weipipe.data import ByteLevelTokenizer, NullTokenizer, check_indexed_dataset

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample_text_document"


def _load_tool(name):
    return importlib.import_module(f"tools.{name}")  # pool workers find _encode by module name


preprocess_data = _load_tool("preprocess_data")
make_sample_corpus = _load_tool("make_sample_corpus")


def _read_idx_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


def test_committed_sample_corpus_is_reproducible(tmp_path, monkeypatch):
    out = tmp_path / "sample.jsonl"
    monkeypatch.setattr(sys, "argv", ["make_sample_corpus.py", "--output", str(out)])
    make_sample_corpus.main()
    assert filecmp.cmp(out, REPO / "data" / "sample.jsonl", shallow=False)
    rc = preprocess_data.main([
        "--input", str(out), "--output-prefix", str(tmp_path / "sample"), "--append-eod",
        "--tokenizer-type", "ByteLevelTokenizer", "--workers", "2", "--log-interval", "400",
    ])
    assert rc == 0
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / "sample_text_document") + ext, str(SAMPLE) + ext, shallow=False)


def test_round_trip_and_multiple_keys(tmp_path, capsys):
    docs = [{"text": "héllo wörld", "title": "one"}, {"text": "", "title": "two"},
            {"text": "third doc ✓", "title": "three"}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in docs) + "\n\n")
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "c"),
                               "--json-keys", "text", "title", "--append-eod", "--log-interval", "1"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "processed 2 documents" in stdout and "MB/s" in stdout and "done: 3 documents" in stdout
    tok = ByteLevelTokenizer()
    text_docs = _read_idx_docs(tmp_path / "out" / "c_text_document")
    assert [tok.detokenize(d) for d in text_docs] == ["héllo wörld", "third doc ✓"]  # empty one skipped
    assert all(d[-1] == tok.eod for d in text_docs)
    titles = _read_idx_docs(tmp_path / "out" / "c_title_document")
    assert [tok.detokenize(d) for d in titles] == ["one", "two", "three"]
    assert check_indexed_dataset(str(tmp_path / "out" / "c_title_document")).num_documents == 3


def test_null_tokenizer_without_eod(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text('{"text": "1 2 3"}\n{"text": "7 8"}\n')
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "n"),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    assert rc == 0
    assert _read_idx_docs(tmp_path / "n_text_document") == [[1, 2, 3], [7, 8]]
    assert NullTokenizer(10).eod not in sum(_read_idx_docs(tmp_path / "n_text_document"), [])


@pytest.mark.parametrize(
    "content, args, message",
    [
        (None, [], "does not exist"),
        ('{"text": "ok"}\n{"text": "broken\n', [], "line 2 is not valid JSON"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', [], "line 3 has no key 'text'"),
        ('{"text": 5}\n', [], "line 1 has a non-string value"),
        ('["text"]\n', [], "line 1 is not a JSON object"),
        (b'{"text": "\xff"}\n', [], "line 1 is not valid UTF-8"),
        ('{"text": "1 x"}\n', ["--tokenizer-type", "NullTokenizer", "--vocab-size", "4"], "line 1 cannot be tokenized"),
        ('{"text": "a"}\n', ["--tokenizer-type", "HuggingFaceTokenizer"], "needs tokenizer_model"),
        ('{"text": ""}\n', [], "holds no non-empty 'text' documents"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, content, args, message, workers):
    src = tmp_path / "in.jsonl"
    if isinstance(content, str):
        src.write_text(content)
    elif isinstance(content, bytes):
        src.write_bytes(content)
    out = tmp_path / "out"
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(out / "x"),
                               "--workers", str(workers), *args])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not out.exists() or os.listdir(out) == []


def test_cli_exit_code_and_single_stderr_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "fine"}\nnot json\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tools.preprocess_data", "--input", str(src), "--output-prefix", str(tmp_path / "x"),
         "--workers", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {src} line 3 is not valid JSON (Expecting value at column 1)"]
    assert not list(tmp_path.glob("x_*"))

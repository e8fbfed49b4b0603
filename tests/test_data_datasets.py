import json
import os
import shutil
from pathlib import Path

import numpy
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_weipipe.data import (
    ByteLevelTokenizer,
    DataConfig,
    NullTokenizer,
    build_data_loader,
    build_train_valid_test_datasets,
    check_indexed_dataset,
)
from harness import run_distributed

REPO = Path(__file__).resolve().parents[1]
SAMPLE = str(REPO / "data" / "sample_text_document")
SAMPLE_JSONL = REPO / "data" / "sample.jsonl"


def _copy_sample(dst_dir: Path, name: str = "copy") -> str:
    prefix = str(dst_dir / name)
    shutil.copy(SAMPLE + ".bin", prefix + ".bin")
    shutil.copy(SAMPLE + ".idx", prefix + ".idx")
    return prefix


def _tiny_dataset(prefix: str, num_docs: int, eod: int = 256) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for d in range(num_docs):
        ids = list(f"document {d} says hello".encode()) + [eod]
        builder.add_document(numpy.array(ids, dtype=numpy.uint16), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def _split_on_eod(row: torch.Tensor, eod: int) -> list[list[int]]:
    pieces, cur = [], []
    for t in row.tolist():
        if t == eod:
            pieces.append(cur)
            cur = []
        else:
            cur.append(t)
    pieces.append(cur)
    return pieces


def test_sample_corpus_batches_detokenize_to_source_text(tmp_path):
    tok = ByteLevelTokenizer()
    cfg = DataConfig(data_path=[SAMPLE], seq_length=256, data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, tok, [64, 16, 4])
    assert isinstance(train, GPTDataset) and len(train) >= 64
    assert valid is not None and test is not None
    batch = next(iter(build_data_loader(train, 8, 0, 0, 1)))
    tokens, labels = batch["tokens"], batch["labels"]
    assert tokens.shape == labels.shape == (8, 256) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert torch.equal(batch["position_ids"][0], torch.arange(256))
    assert batch["loss_mask"].shape == (8, 256) and bool((batch["loss_mask"] == 1).all())
    mask = batch["attention_mask"]
    assert mask.shape == (8, 1, 256, 256) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(256, 256, dtype=torch.bool), diagonal=1))
    source = "\n".join(json.loads(line)["text"] for line in SAMPLE_JSONL.open())
    checked = 0
    for row in tokens:
        for piece in _split_on_eod(row, tok.eod):
            if len(piece) >= 16:
                assert tok.detokenize(piece) in source
                checked += 1
    assert checked >= 8


def test_eod_resets_positions_and_masks_loss(tmp_path):
    tok = ByteLevelTokenizer()
    cfg = DataConfig(
        data_path=[SAMPLE], seq_length=512, data_cache_path=str(tmp_path / "cache"),
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
    )
    train, _, _ = build_train_valid_test_datasets(cfg, tok, [16, 4, 4])
    sample = next(train[i] for i in range(len(train)) if bool((train[i]["tokens"] == tok.eod).any()))
    tokens = sample["tokens"]
    e = int((tokens == tok.eod).nonzero()[0])
    assert sample["loss_mask"][e] == 0 and sample["loss_mask"].sum() == 512 - int((tokens == tok.eod).sum())
    if e + 1 < 512:
        assert sample["position_ids"][e + 1] == 0
        assert bool(sample["attention_mask"][0, e + 1, e])  # True = masked: no attention across documents


def test_loader_resumes_and_splits_data_parallel_ranks(tmp_path):
    cfg = DataConfig(data_path=[SAMPLE], seq_length=64, data_cache_path=str(tmp_path / "cache"),
                     create_attention_mask=False)
    train, _, _ = build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [200, 8, 8])
    full = [b["tokens"] for b in build_data_loader(train, 4, 0, 0, 1)]
    resumed = [b["tokens"] for b in build_data_loader(train, 4, 8, 0, 1)]
    assert "attention_mask" not in next(iter(build_data_loader(train, 4, 0, 0, 1)))
    assert len(resumed) == len(full) - 2
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[2:]))
    # Two data-parallel ranks together see exactly the single-rank stream, without overlap.
    r0 = [b["tokens"] for b in build_data_loader(train, 2, 0, 0, 2)]
    r1 = [b["tokens"] for b in build_data_loader(train, 2, 0, 1, 2)]
    assert torch.equal(torch.cat([r0[0], r1[0]]), full[0])
    assert torch.equal(torch.cat([r0[5], r1[5]]), full[5])
    assert build_data_loader(None, 4, 0, 0, 1) is None


def test_loader_with_worker_processes(tmp_path):
    cfg = DataConfig(data_path=[SAMPLE], seq_length=32, data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [32, 4, 4])
    serial = [b["tokens"] for _, b in zip(range(3), build_data_loader(train, 4, 4, 0, 1))]
    workers = [b["tokens"] for _, b in zip(range(3), build_data_loader(train, 4, 4, 0, 1, num_workers=2))]
    assert all(torch.equal(a, b) for a, b in zip(serial, workers))


def test_weighted_blend_without_process_group(tmp_path):
    other = _copy_sample(tmp_path)
    cache = str(tmp_path / "cache")
    cfg = DataConfig(data_path=["0.25", SAMPLE, "0.75", other], seq_length=128, data_cache_path=cache)
    tok = ByteLevelTokenizer()
    train, valid, _ = build_train_valid_test_datasets(cfg, tok, [100, 20, 4])
    assert isinstance(train, BlendedDataset) and len(train) == 100 and len(valid) == 20
    ids = [int(train[i]["dataset_id"]) for i in range(100)]
    assert ids.count(1) == 75
    again, _, _ = build_train_valid_test_datasets(cfg, tok, [100, 20, 4])  # per-prefix cache hit
    assert torch.equal(again[7]["tokens"], train[7]["tokens"])


def test_unweighted_blend_of_prefixes(tmp_path):
    other = _copy_sample(tmp_path)
    cfg = DataConfig(data_path=[SAMPLE, other], seq_length=128, data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [50, 10, 2])
    assert isinstance(train, BlendedDataset) and len(train) == 50


def test_mock_data():
    cfg = DataConfig(mock_data=True, seq_length=32, tokenizer_type="NullTokenizer", vocab_size=500)
    tok = NullTokenizer(500)
    train, valid, test = build_train_valid_test_datasets(cfg, tok, [40, 8, 8])
    assert isinstance(train, MockGPTDataset) and len(train) >= 40
    batch = next(iter(build_data_loader(train, 4, 0, 0, 1)))
    assert batch["tokens"].shape == (4, 32) and int(batch["tokens"].max()) < tok.vocab_size


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(seq_length=0), "seq_length"),
        (dict(mock_data=True), "not both"),
        (dict(data_path=None), "no training data"),
        (dict(data_path=[]), "no training data"),
        (dict(split="90,abc"), "split"),
        (dict(split="0,0,0"), "positive total"),
        (dict(num_workers=-1), "num_workers"),
        (dict(data_path=["/nonexistent/prefix"]), r"/nonexistent/prefix\.idx does not exist"),
        (dict(data_path=["-1", SAMPLE, "1", SAMPLE]), "positive"),
        (dict(data_path=["1", SAMPLE, SAMPLE]), "mixes weights"),
        (dict(tokenizer_type="NoSuchTokenizer"), "not one of"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent.json"), "does not exist"),
    ],
)
def test_validate_rejects(changes, message):
    args = dict(data_path=[SAMPLE], seq_length=128)
    args.update(changes)
    with pytest.raises(ValueError, match=message):
        DataConfig(**args).validate()


def test_validate_accepts_sample_and_reports_its_size():
    DataConfig(data_path=[SAMPLE], seq_length=128).validate()
    info = check_indexed_dataset(SAMPLE)
    assert info.num_documents == info.num_sequences == sum(1 for _ in SAMPLE_JSONL.open())
    assert info.bin_bytes == os.path.getsize(SAMPLE + ".bin")


def test_cache_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DataConfig(data_path=[SAMPLE], seq_length=8, data_cache_path=str(tmp_path / "file")).validate()


@pytest.mark.parametrize("keep", [10, 40, 5000])
def test_truncated_idx_names_the_file(tmp_path, keep):
    prefix = _copy_sample(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(keep)
    cfg = DataConfig(data_path=[prefix], seq_length=64, data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"{prefix}\.idx .*truncated"):
        cfg.validate()
    with pytest.raises(ValueError, match=rf"{prefix}\.idx"):
        build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [8, 8, 8])


def test_truncated_bin_names_the_file(tmp_path):
    prefix = _copy_sample(tmp_path)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin \({size - 1} bytes\) is truncated"):
        DataConfig(data_path=["1", SAMPLE, "1", prefix], seq_length=64).validate()


def test_garbage_idx_is_rejected(tmp_path):
    prefix = _copy_sample(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    with pytest.raises(ValueError, match=rf"{prefix}\.idx is not a Megatron indexed dataset"):
        check_indexed_dataset(prefix)


def test_split_without_documents_fails_instead_of_hanging(tmp_path):
    prefix = _tiny_dataset(str(tmp_path / "tiny"), num_docs=10)
    with pytest.raises(ValueError, match="leaves the valid split no documents"):
        DataConfig(data_path=[prefix], seq_length=16).validate()
    cfg = DataConfig(data_path=[prefix], seq_length=16, split="8,2,0", data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [20, 4, 0])
    assert test is None and len(train) >= 20 and len(valid) >= 4


def test_weighted_blend_needs_sizes():
    cfg = DataConfig(data_path=["1", SAMPLE, "1", SAMPLE], seq_length=16)
    with pytest.raises(ValueError, match="sample count"):
        build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [10, None, 10])


def _build_on_rank(rank, world_size, cache):
    cfg = DataConfig(data_path=["0.5", SAMPLE, "0.5", SAMPLE], seq_length=64, data_cache_path=cache)
    train, _, _ = build_train_valid_test_datasets(cfg, ByteLevelTokenizer(), [64, 8, 8])
    loader = build_data_loader(train, 2, 0, rank, world_size)
    first = next(iter(loader))["tokens"]
    return len(train), train[3]["tokens"].tolist(), first.tolist()


@pytest.mark.distributed
def test_blend_with_cache_on_two_ranks(tmp_path):
    results = run_distributed(_build_on_rank, 2, str(tmp_path / "cache"), timeout=120)
    (n0, s0, b0), (n1, s1, b1) = results
    assert n0 == n1 == 64 and s0 == s1 and b0 != b1
    assert any(name.endswith("BlendedDataset-train-dataset_index.npy") for name in os.listdir(tmp_path / "cache"))
    n, s, _ = _build_on_rank(0, 1, str(tmp_path / "cache"))  # single process reads the same cache
    assert n == 64 and s == s0


def test_sample_corpus_is_learnable_in_fifty_steps(tmp_path):
    """A tiny causal transformer's loss must fall clearly on the shipped corpus."""
    torch.manual_seed(0)
    tok = ByteLevelTokenizer()
    cfg = DataConfig(data_path=[SAMPLE], seq_length=64, data_cache_path=str(tmp_path / "cache"),
                     create_attention_mask=False)
    train, _, _ = build_train_valid_test_datasets(cfg, tok, [50 * 8, 8, 8])
    width = 64
    emb, pos = torch.nn.Embedding(tok.vocab_size, width), torch.nn.Embedding(64, width)
    block = torch.nn.TransformerEncoderLayer(width, 4, 128, dropout=0.0, batch_first=True)
    head = torch.nn.Linear(width, tok.vocab_size)
    params = [p for m in (emb, pos, block, head) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(64)
    losses = []
    for step, batch in enumerate(build_data_loader(train, 8, 0, 0, 1)):
        if step == 50:
            break
        h = block(emb(batch["tokens"]) + pos(batch["position_ids"]), src_mask=causal, is_causal=True)
        loss = torch.nn.functional.cross_entropy(head(h).flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) == 50
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses

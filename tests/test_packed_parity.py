"""Packed documents under Ulysses and FPDT against the plain single-process path.

The reference is the CP=1 run without FPDT, where megatron-core builds the dense [s, s]
mask from the EOD tokens (``--reset-attention-mask``) and its own attention applies it.
The long-context runs never see that mask: they get document offsets and compute
attention block by block. Samples come from a corpus of short documents (1 to 20 tokens)
so that every sample holds several documents, checked below, and the reference's losses
differ from the same run without the flag (so the mask is exercised and the test can fail).
"""

import os

import numpy
import pytest
import torch

from harness import run_distributed
from harness.runs import SAMPLE_DATA, merge_ranks, tiny_gpt_args, train_many
from harness.state import max_relative_difference

RTOL = 1e-5
EOD = 256  # ByteLevelTokenizer
PACKED = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
LLAMA = dict(
    num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
    seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, make_vocab_size_divisible_by=512, global_batch_size=4, split="1,0,0",
)
RUNS = {
    "ulysses-cp2": dict(context_parallel_size=2),
    "fpdt-cp2-4chunks": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16),
    "fpdt-cp2-8chunks-offload": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=8, fpdt_offload=True),
}
# Learned absolute positions read the dataset's per-document position ids (--reset-position-ids).
ABSOLUTE = dict(position_embedding_type="learned_absolute", max_position_embeddings=64)


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """An indexed dataset of short documents cut from the sample corpus, EOD after each
    (lengths 1..20 with the EOD, so one-token documents occur)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    src = IndexedDataset(SAMPLE_DATA)
    text = numpy.concatenate([src[i] for i in range(40)])
    text = text[text != EOD]
    rng = numpy.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp("packed") / "short_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    at = 0
    for _ in range(800):
        n = int(rng.integers(0, 20))
        builder.add_item(torch.from_numpy(numpy.append(text[at : at + n], EOD).astype(numpy.int64)))
        builder.end_document()
        at += n
    builder.finalize(prefix + ".idx")
    return prefix


def _args(prefix, packed=True, **overrides):
    flags = dict(LLAMA, data_path=prefix, data_cache_path=os.path.join(os.path.dirname(prefix), "cache"))
    if packed:
        flags.update(PACKED)
    flags.update(overrides)
    return tiny_gpt_args(**flags)


def _docs_per_sample(argv, world_size):
    """EOD counts of the samples the first iterations read (the data the runs train on)."""
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.data.datasets import build_train_valid_test_datasets
    from megatron_weipipe.data.tokenizers import build_tokenizer

    cfg = parse_config(argv, world_size=world_size)
    tok = build_tokenizer(cfg.data.tokenizer_type, None, None)
    train, _, _ = build_train_valid_test_datasets(cfg.data, tok, [12, 0, 0])
    return [int((train[i]["tokens"] == EOD).sum()) for i in range(12)], "attention_mask" in train[0]


@pytest.fixture(scope="module")
def reference(short_docs):
    argvs = [_args(short_docs), _args(short_docs, packed=False), _args(short_docs, **ABSOLUTE)]
    per_rank = run_distributed(train_many, 1, argvs, timeout=300)
    return merge_ranks(per_rank, 0), merge_ranks(per_rank, 1), merge_ranks(per_rank, 2)


@pytest.fixture(scope="module")
def world2(short_docs):
    argvs = [_args(short_docs, **o) for o in RUNS.values()]
    argvs.append(_args(short_docs, **ABSOLUTE, **RUNS["fpdt-cp2-4chunks"]))
    per_rank = run_distributed(train_many, 2, argvs, timeout=600)
    return {name: merge_ranks(per_rank, i) for i, name in enumerate(list(RUNS) + ["fpdt-cp2-4chunks-absolute"])}


def test_samples_hold_several_documents(short_docs):
    counts, dense = _docs_per_sample(_args(short_docs, context_parallel_size=2, fpdt=True, fpdt_chunk_size=16), 2)
    assert min(counts) >= 3, counts
    assert not dense, "the data path built a dense mask for Ulysses/FPDT"


def test_reference_mask_matters(reference):
    packed, unpacked, _ = reference
    assert max(abs(a - b) for a, b in zip(packed["losses"], unpacked["losses"])) > 1e-3


@pytest.mark.parametrize("layout", list(RUNS) + ["fpdt-cp2-4chunks-absolute"])
def test_packed_matches_plain_path(layout, world2, reference):
    run, ref = world2[layout], reference[2 if layout.endswith("absolute") else 0]
    assert len(run["losses"]) == 3
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) <= RTOL * abs(b), (run["losses"], ref["losses"])
    for a, b in zip(run["grad_norms"], ref["grad_norms"]):
        assert abs(a - b) <= RTOL * abs(b), (run["grad_norms"], ref["grad_norms"])
    for it, g in ref["grads"].items():
        rel, where = max_relative_difference(run["grads"][it], g)
        assert rel < RTOL, f"iteration {it}: gradient of {where} differs by {rel:.2e}"
    rel, where = max_relative_difference(run["params"], ref["params"])
    assert rel < RTOL, f"parameter {where} differs by {rel:.2e}"
    worst = max(max_relative_difference(run["grads"][it], g)[0] for it, g in ref["grads"].items())
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
    print(f"{layout}: losses {loss:.1e}, grads {worst:.1e}, params {rel:.1e} (max relative)")

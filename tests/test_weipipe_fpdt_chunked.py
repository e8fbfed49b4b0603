"""WeiPipe rings under FPDT run the final norm, output layer and loss in sequence chunks.

A Llama-style model (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer),
float32, dropout off: a weipipe-interleave ring of 2 with FPDT (4 chunks of 16 tokens)
gives the losses, every gradient and every parameter of the single-process run without
FPDT within 1e-5 relative, and the ring's head did go through the chunked functions
(counted inside the ranks). Each chunk holds different tokens of the corpus, so a chunk
placed at the wrong offset changes the loss.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.runs import merge_ranks, tiny_gpt_args, train_and_collect
from harness.state import max_relative_difference

RTOL = 1e-5

LLAMA = dict(
    num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
    seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=512,
    global_batch_size=4, train_iters=2,
)
RING = dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave", fpdt=True,
            fpdt_chunk_size=16)


def counted_train(rank: int, world_size: int, argv: list[str]) -> dict:
    """train_and_collect, counting the chunked loss calls and the chunked final-norm pieces."""
    from megatron_weipipe.fpdt import chunked as chunked_mod
    from megatron_weipipe.fpdt import loss as loss_mod

    counts = {"loss_chunks": [], "norm_pieces": []}
    plain_ce, plain_seq = loss_mod.ChunkedCrossEntropyFunction.forward, chunked_mod.sequence_chunked

    def ce_forward(ctx, hidden, weight, labels, plan):
        counts["loss_chunks"].append(plan.num_chunks)
        return plain_ce(ctx, hidden, weight, labels, plan)

    def seq(fn, x, num_chunks):
        counts["norm_pieces"].append(num_chunks)
        return plain_seq(fn, x, num_chunks)

    loss_mod.ChunkedCrossEntropyFunction.forward = staticmethod(ce_forward)
    chunked_mod.sequence_chunked = seq
    try:
        out = train_and_collect(rank, world_size, argv)
    finally:
        loss_mod.ChunkedCrossEntropyFunction.forward = staticmethod(plain_ce)
        chunked_mod.sequence_chunked = plain_seq
    return dict(out, counts=counts)


def _args(**overrides):
    return tiny_gpt_args(**{**LLAMA, **overrides})


@pytest.fixture(scope="module")
def runs():
    reference = run_distributed(counted_train, 1, _args(), timeout=300)
    ring = run_distributed(counted_train, 2, _args(**RING), timeout=300)
    return reference, ring


def test_weipipe_fpdt_head_runs_chunked_and_matches_reference(runs):
    reference, ring = runs
    assert reference[0]["counts"] == {"loss_chunks": [], "norm_pieces": []}  # no FPDT: megatron-core's head
    for rank_out in ring:
        c = rank_out["counts"]
        # every microbatch's loss went through the chunked cross entropy in 4 chunks, and
        # the final norm (no layer norm is chunked in a ring) through 4 sequence pieces
        assert c["loss_chunks"] and set(c["loss_chunks"]) == {4}
        assert c["norm_pieces"] and set(c["norm_pieces"]) == {4}
        assert len(c["norm_pieces"]) == len(c["loss_chunks"])
    ref = _merge(reference)
    got = _merge(ring)
    assert len(got["losses"]) == len(ref["losses"]) == 2
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= RTOL * abs(b), (got["losses"], ref["losses"])
    for it in ref["grads"]:
        assert set(got["grads"][it]) == set(ref["grads"][it])
        worst, where = max_relative_difference(got["grads"][it], ref["grads"][it])
        assert worst <= RTOL, (it, where, worst)
    worst, where = max_relative_difference(got["params"], ref["params"])
    assert worst <= RTOL, (where, worst)


def test_reference_differs_from_initial_state(runs):
    """The comparison is not vacuous: gradients are non-zero and the two steps differ."""
    reference, _ = runs
    ref = _merge(reference)
    g1, g2 = (ref["grads"][it] for it in sorted(ref["grads"]))
    assert any(torch.as_tensor(t).abs().max() > 0 for t in g1.values())
    assert max_relative_difference(g1, g2)[0] > 1e-3


def _merge(per_rank: list[dict]) -> dict:
    return merge_ranks([[r] for r in per_rank], 0)

"""Predicted bytes equal the closed forms of docs/how-it-works/weipipe.md and the model's real sizes."""

from __future__ import annotations

import pytest

from megatron_weipipe.schedules.ir.actions import Flow
from megatron_weipipe.schedules.timing.closed_forms import expected_messages
from megatron_weipipe.simulator import collectives
from megatron_weipipe.simulator.calibration import ChunkTimes
from megatron_weipipe.simulator.costs import CostModel
from megatron_weipipe.simulator.hardware import DEVICES, Cluster, LinkSpec
from megatron_weipipe.simulator.rank_order import Layout
from megatron_weipipe.simulator.project import FLAGS_BYTES, NORM_BYTES, counter_bytes, simulate_run
from megatron_weipipe.simulator.run_spec import RunSpec
from megatron_weipipe.shape import ModelShape

SHAPE = ModelShape(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=1000)
LLAMA = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=32,
                   micro_batch_size=1, vocab_size=500, swiglu=True, normalization="RMSNorm",
                   add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True)


@pytest.mark.parametrize("name", ["weipipe-naive", "weipipe-interleave", "weipipe-zb"])
@pytest.mark.parametrize("P,G", [(2, 1), (2, 3), (4, 2), (8, 1)])
@pytest.mark.parametrize("grad_bytes", [4, 2])
def test_weipipe_bytes_are_the_message_closed_forms(name, P, G, grad_bytes):
    spec = RunSpec(SHAPE, Layout(pp=P), global_batch_size=2 * G * P, schedule=name, compute_bytes=2,
                   weipipe_grad_bytes=grad_bytes).validate()
    chunk = SHAPE.num_layers // P * SHAPE.layer_params()
    got = counter_bytes(spec, spec.build_schedule())
    for r in range(P):
        m = expected_messages(name, P, G, r)
        weights = m[Flow.FWD_WEIGHTS] + m[Flow.BWD_WEIGHTS] + m.get(Flow.PLACEMENT, 0)
        assert got[r]["weights"] == weights * chunk * 2
        assert got[r]["gradients"] == m[Flow.GRADS] * chunk * grad_bytes


@pytest.mark.parametrize("P,N", [(2, 4), (4, 8)])
def test_1f1b_activation_bytes(P, N):
    spec = RunSpec(SHAPE, Layout(pp=P), global_batch_size=2 * N, schedule="1f1b", compute_bytes=4).validate()
    got = counter_bytes(spec, spec.build_schedule())
    act = SHAPE.micro_batch_size * SHAPE.seq_length * SHAPE.hidden_size * 4
    for r in range(P):
        # a stage sends N activations forward (not the last) and N gradients back (not the first)
        assert got[r].get("activations", 0) == act * N * ((r < P - 1) + (r > 0))


def test_collective_payloads_follow_the_training_loop():
    P, N = 4, 8
    spec = RunSpec(SHAPE, Layout(pp=P), global_batch_size=2 * N, schedule="1f1b", compute_bytes=4).validate()
    got = counter_bytes(spec, spec.build_schedule())
    emb = SHAPE.padded_vocab() * SHAPE.hidden_size * 4
    # DP = 1 and TP = 1: the gradient and cross-entropy all-reduces run on one-rank groups, which send nothing
    assert got[1]["collectives"] == FLAGS_BYTES + NORM_BYTES
    assert got[0]["collectives"] == emb + FLAGS_BYTES + NORM_BYTES
    assert got[P - 1]["collectives"] == emb + FLAGS_BYTES + NORM_BYTES
    # with peers, they count their payload
    spec = RunSpec(SHAPE, Layout(pp=P, dp=2, tp=2), global_batch_size=4 * N, schedule="1f1b",
                   compute_bytes=4).validate()
    got = counter_bytes(spec, spec.build_schedule())
    emb_tp = SHAPE.padded_vocab(2) // 2 * SHAPE.hidden_size * 4
    ce = 3 * SHAPE.tokens * 4 * N
    assert got[1]["collectives"] == spec.rank_params(1) * 4 + FLAGS_BYTES + NORM_BYTES
    assert got[P - 1]["collectives"] == spec.rank_params(P - 1) * 4 + emb_tp + ce + FLAGS_BYTES + NORM_BYTES


def test_replayed_transfers_carry_the_counted_bytes():
    link = LinkSpec("x", 100.0, 1.0)
    cluster = Cluster(device=DEVICES["h100"], intra=link, inter=link)
    chunk = ChunkTimes(1, 1e-3, 2e-3, 1e-3, 1e-3)
    costs = CostModel(chunk, chunk, 0, 0, 0, 0, 0)
    for name in ("1f1b", "weipipe-zb"):
        spec = RunSpec(SHAPE, Layout(pp=4), global_batch_size=16, schedule=name)
        r = simulate_run(spec, cluster, costs)
        for rank, row in enumerate(r.counter):
            p2p = sum(v for k, v in row.items() if k != "collectives")
            assert sum(t.nbytes for t in r.trace.transfers if t.src == rank) == p2p


@pytest.mark.parametrize("n", [1, 2, 8])
def test_ring_formulas(n):
    link = LinkSpec("x", 10.0, 5.0)
    ar = collectives.all_reduce(10**9, n, link)
    assert ar.wire_bytes == pytest.approx(2 * (n - 1) / n * 1e9)
    assert ar.seconds == pytest.approx(0 if n == 1 else 2 * (n - 1) / n * 0.1 + 2 * (n - 1) * 5e-6)
    ag = collectives.all_gather(10**9, n, link)
    assert ag.wire_bytes == pytest.approx((n - 1) / n * 1e9)


def test_layout_places_tp_innermost_and_pipelines_across_nodes():
    lay = Layout(tp=2, pp=4, cp=1, dp=2)
    assert lay.world == 16
    assert lay.pipeline_ranks() == [0, 4, 8, 12]
    assert lay.tensor_ranks() == [0, 1]
    assert lay.data_parallel_ranks() == [0, 2]
    cluster = Cluster(device=DEVICES["h100"], intra=LinkSpec("nv", 300, 1), inter=LinkSpec("ib", 40, 5),
                      gpus_per_node=8)
    assert cluster.link(0, 4).name == "nv" and cluster.link(4, 8).name == "ib"


@pytest.fixture(scope="module")
def megatron_models():
    """Parameter counts of real megatron-core GPTModels (one process, built on the CPU)."""
    from megatron_weipipe.model.gpt import build_gpt_model
    from megatron_weipipe.training.host_calibration import pretrain_config_for, single_process_megatron

    out = {}
    for key, shape in (("gpt", SHAPE), ("llama", LLAMA)):
        cfg = pretrain_config_for(shape, 2)
        with single_process_megatron(cfg):
            V = shape.padded_vocab()
            for pre, post in ((True, False), (False, True), (False, False), (True, True)):
                model = build_gpt_model(cfg, V, pre_process=pre, post_process=post)
                out[(key, pre, post)] = sum(p.numel() for p in model.parameters())
    return out


@pytest.mark.parametrize("key,shape", [("gpt", SHAPE), ("llama", LLAMA)])
def test_parameter_counts_match_megatron_core(megatron_models, key, shape):
    layers = 2 * shape.layer_params()
    assert megatron_models[(key, False, False)] == layers
    assert megatron_models[(key, True, False)] == layers + shape.embedding_params()
    head = shape.norm_params() + shape.word_embedding_params()
    assert megatron_models[(key, False, True)] == layers + head
    single = layers + shape.embedding_params() + shape.norm_params()
    if shape.untie_embeddings_and_output_weights:
        single += shape.word_embedding_params()
    assert megatron_models[(key, True, True)] == single
    # the WeiPipe ring rank: owned layers plus the replicated ends, as schedules/weipipe_train builds it
    spec = RunSpec(shape.__class__(**{**shape.__dict__, "num_layers": 2 * 2}), Layout(pp=2), 4, "weipipe-zb")
    assert spec.rank_params(0) == single

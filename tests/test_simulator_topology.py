"""Node topology in the simulator: the per-node 25 GbE link, HSDP and FSDP2's options, TawPipe's
closed-form cost, and the tawpipe-paper report. Pure Python, no processes."""

from __future__ import annotations

import functools
import shlex

import pytest

from megatron_weipipe.errors import SimulatorError
from megatron_weipipe.simulator import baselines, collectives, sharding
from megatron_weipipe.simulator.cli import costs_for, parse_command
from megatron_weipipe.simulator.hardware import LINKS
from megatron_weipipe.simulator.project import simulate_run
from megatron_weipipe.simulator.topology import tawpipe_cost

# 8 GPUs as 2 nodes of 4; a fast link inside a node, a slow one between
SMALL = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 2048 --micro-batch-size 1 "
         "--global-batch-size 16 --gpu a800 --link nvlink-a800,eth25 --gpus-per-node 4 "
         "--hidden-dropout 0 --attention-dropout 0 --bf16")


def run(extra: str):
    args, cluster, specs = parse_command(shlex.split(f"{SMALL} {extra}"))
    spec = specs[0]
    return simulate_run(spec, cluster, costs_for(args, spec, cluster)), spec, cluster, costs_for(args, spec, cluster)


def test_broadcast_and_reduce_move_one_payload_per_forwarding_rank():
    link = LINKS["eth25"]
    c = collectives.broadcast(10**8, 4, link)
    assert c.wire_bytes == 10**8
    assert c.seconds == pytest.approx(10**8 / 2.8e9 + 3 * 25e-6)
    assert collectives.reduce(10**8, 1, link).seconds == 0.0


def test_eth25_is_one_nic_per_node_shared_by_the_rings_that_cross_it_at_once():
    _, _, cluster, _ = run("--num-gpus 8 --schedules fsdp")
    assert cluster.inter.name == "eth25" and cluster.inter.per_node and cluster.inter.bandwidth_gbs == 2.8
    shards, replicas = sharding.groups(list(range(8)), 2)
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]] and replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # four replica rings (one per shard rank) leave node 0 together: a quarter of the NIC each
    assert cluster.crossing_link(replicas[0], replicas).bandwidth_gbs == pytest.approx(2.8 / 4)
    # one ring over every rank crosses each node boundary once: the whole NIC
    assert cluster.crossing_link(list(range(8)), [list(range(8))]).bandwidth_gbs == 2.8
    # inside a node: the intra-node link, unshared
    assert cluster.crossing_link([0, 1], [[0, 1], [2, 3]]) is cluster.intra


def test_hsdp_gathers_and_reduce_scatters_in_the_node_and_all_reduces_the_shard_across():
    r, spec, cluster, _ = run("--num-gpus 8 --schedules fsdp --hsdp-replicas 2")
    s, N = spec.shape, spec.num_microbatches
    assert spec.layout.dp == 8 and spec.fsdp.replicas == 2 and N == 2
    comms, link, across = baselines._unit_comms(spec, cluster)
    layer = s.layer_params(1)
    c = comms[1]
    n = 4  # shard group: one node
    assert link.name == "nvlink-a800" and across.bandwidth_gbs == pytest.approx(2.8 / 4)
    assert c.gather.wire_bytes == pytest.approx((n - 1) / n * layer * 2)
    assert c.reduce_scatter.wire_bytes == pytest.approx((n - 1) / n * layer * 4)
    assert c.all_reduce.payload_bytes == layer * 4 // n
    assert c.all_reduce.wire_bytes == pytest.approx(2 * (2 - 1) / 2 * (layer * 4 // n))
    assert c.all_reduce.seconds == pytest.approx(c.all_reduce.wire_bytes / (0.7e9) + 2 * 25e-6)
    total = s.total_params()
    # per microbatch: two gathers and a reduce-scatter inside the node, an all-reduce across
    assert r.bytes_per_link[0]["nvlink-a800"] == pytest.approx(N * (n - 1) / n * total * (2 * 2 + 4), rel=1e-6)
    assert r.bytes_per_link[0]["eth25/4"] == pytest.approx(
        N * sum(x.all_reduce.wire_bytes for x in comms), rel=1e-9)
    # the inter-node wire dominates: the iteration is at least its all-reduces back to back
    assert r.iteration_s >= N * sum(x.all_reduce.seconds for x in comms)


def test_fsdp2_options_cut_gathers_and_gradient_syncs():
    base, spec, _, _ = run("--num-gpus 8 --schedules fsdp --hsdp-replicas 2")
    once, _, _, _ = run("--num-gpus 8 --schedules fsdp --hsdp-replicas 2 --fsdp-grad-sync-once")
    both, _, _, _ = run("--num-gpus 8 --schedules fsdp --hsdp-replicas 2 --fsdp-grad-sync-once --fsdp-no-reshard")
    s, N, n = spec.shape, spec.num_microbatches, 4
    total = s.total_params()
    assert once.bytes_per_link[0]["nvlink-a800"] == pytest.approx((n - 1) / n * total * (N * 2 * 2 + 4), rel=1e-6)
    assert both.bytes_per_link[0]["nvlink-a800"] == pytest.approx((n - 1) / n * total * (N * 2 + 4), rel=1e-6)
    assert once.bytes_per_link[0]["eth25/4"] == pytest.approx(base.bytes_per_link[0]["eth25/4"] / N)
    assert once.iteration_s < base.iteration_s and both.iteration_s <= once.iteration_s
    # memory: unsharded fp32 gradients, then every unit's gathered bf16 weights as well
    assert once.peak_memory - base.peak_memory == pytest.approx(total * 4)
    assert both.peak_memory - once.peak_memory == pytest.approx(total * 2)


def test_reduce_dtype_halves_gradient_bytes():
    r, spec, cluster, _ = run("--num-gpus 8 --schedules fsdp --hsdp-replicas 2 --fsdp-reduce-dtype bf16")
    comms, _, _ = baselines._unit_comms(spec, cluster)
    layer = spec.shape.layer_params(1)
    assert comms[1].reduce_scatter.payload_bytes == layer * 2 and comms[1].all_reduce.payload_bytes == layer * 2 // 4
    total, N = spec.shape.total_params(), spec.num_microbatches
    assert r.bytes_per_link[0]["nvlink-a800"] == pytest.approx(N * 3 / 4 * total * (2 * 2 + 2), rel=1e-6)


def test_hsdp_with_one_replica_is_fsdp():
    a, _, _, _ = run("--num-gpus 8 --schedules fsdp")
    b, _, _, _ = run("--num-gpus 8 --schedules fsdp --hsdp-replicas 1")
    assert a.iteration_s == b.iteration_s and a.bytes_per_link == b.bytes_per_link and a.counter == b.counter


def test_sharding_reads_the_trainers_flags():
    from megatron_weipipe.arguments import parse_config

    model = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 1 --global-batch-size 12 --mock-data --tokenizer-type ByteLevelTokenizer "
             "--untie-embeddings-and-output-weights --train-iters 1 --lr 1e-4").split()
    cfg = parse_config(model + ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "3",
                                "--torch-fsdp2-no-reshard-after-forward", "--torch-fsdp2-no-grad-sync-per-microbatch"],
                       world_size=6)
    assert sharding.sharding_from(cfg) == sharding.FsdpSharding(3, False, False)
    for want in (sharding.FsdpSharding(), sharding.FsdpSharding(3, False, False), sharding.FsdpSharding(2, True, False)):
        flags = sharding.trainer_flags(want)  # the inverse: the flags a sharding is run with
        assert sharding.sharding_from(parse_config(model + flags, world_size=6)) == want, flags
    plain = parse_config(model + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
                         world_size=6)
    assert sharding.sharding_from(plain) == sharding.FsdpSharding()  # instances without FSDP2: the optimizer's
    assert sharding.sharding_from(plain, replicas=4, grad_sync_once=True) == sharding.FsdpSharding(4, True, False)
    with pytest.raises(SimulatorError, match="HSDP replicas"):
        run("--num-gpus 8 --schedules fsdp --hsdp-replicas 3")


def test_tawpipe_bytes_and_time_in_closed_form():
    r, spec, cluster, costs = run("--pipeline-model-parallel-size 8 --schedules tawpipe")
    c = tawpipe_cost(spec, cluster, costs)
    P, n, G = 8, 2, spec.num_microbatches // 8
    w, g = spec.chunk_params() * 2, spec.chunk_params() * 4
    assert (c.microbatches, c.steps_per_microbatch) == (G, P)
    # per node and direction: half the chunks are the other node's: weights in both passes, gradients once
    assert c.inter_bytes == pytest.approx(G * P * (n - 1) / n * (2 * w + g))
    assert r.bytes_per_link[0]["eth25"] == pytest.approx(c.inter_bytes / 4)
    assert c.backward.inter == pytest.approx(0.5 * (w / 2.8e9 + g / 2.8e9 + 2 * 25e-6))
    assert c.forward.intra == pytest.approx(w / 160e9 + 3 * 3e-6)
    assert r.iteration_s == pytest.approx(c.iteration)
    # free links: compute-bound, the chunk-steps add up to every layer's compute per microbatch
    free = tawpipe_cost(spec, cluster.with_links(intra=cluster.intra.__class__("x", 1e9, 0.0),
                                                 inter=cluster.inter.__class__("y", 1e9, 0.0)), costs)
    m = costs.for_layers(1).module
    per_mb = 8 * (m.forward + m.backward) + costs.embed_forward + costs.embed_backward + costs.head_forward \
        + costs.head_backward
    assert free.pipeline == pytest.approx(G * per_mb + (n - 1) * (free.forward.compute + free.backward.compute) / 2,
                                          rel=1e-6)
    # a single node: no inter-node wire at all
    one, _, _, _ = run("--pipeline-model-parallel-size 4 --schedules tawpipe")
    assert "eth25" not in one.bytes_per_link[0]


def test_tawpipe_beats_weipipe_when_the_ring_crosses_slow_links():
    taw, _, _, _ = run("--pipeline-model-parallel-size 8 --schedules tawpipe")
    wei, _, _, _ = run("--pipeline-model-parallel-size 8 --schedules weipipe-interleave")
    assert taw.iteration_s < wei.iteration_s


def test_tawpipe_report_runs(monkeypatch):
    from tools import simulator_report
    from tools.simulator_validation import doc_tables

    tiny = functools.partial(doc_tables.tawpipe_table, model=SMALL.split("--gpu")[0].replace(
        "--global-batch-size 16 ", ""), cluster="--gpu a800 --link nvlink-a800,eth25 --gpus-per-node 4",
        gpus=8, nodes=2, accumulation=2, variants=doc_tables.TAWPIPE_VARIANTS[:2])
    monkeypatch.setattr(doc_tables, "tawpipe_table", tiny)
    assert simulator_report.main(["tawpipe-paper"]) == 0
    table = tiny()
    rows = [l for l in table.splitlines() if l.startswith("| ") and "variant" not in l]
    assert len(rows) == 3 and all("%" in l for l in rows)  # two variants and the paper's figures
    assert "python -m tools.simulate" in table and "--schedules tawpipe" in table


def test_trainer_flags_and_what_if_flags_project_alike():
    untied = "--num-gpus 8 --schedules fsdp --untie-embeddings-and-output-weights"
    a, spec_a, _, _ = run(f"{untied} --hsdp-replicas 2 --fsdp-grad-sync-once --fsdp-no-reshard")
    b, spec_b, _, _ = run(f"{untied} --use-torch-fsdp2 --num-distributed-optimizer-instances 2 "
                          "--torch-fsdp2-no-grad-sync-per-microbatch --torch-fsdp2-no-reshard-after-forward")
    assert spec_a.fsdp == spec_b.fsdp == sharding.FsdpSharding(2, False, False)
    assert a.iteration_s == b.iteration_s and a.bytes_per_link == b.bytes_per_link

"""tools/plan.py: the layouts it ranks are the trainer's, fit by the estimator, ranked by the
simulator exactly as an exhaustive search ranks them, and launch as printed."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from tools.planner import cli
from tools.planner.evaluate import Evaluator
from tools.planner.search import plan
from tools.planner.space import Rung, accepted, memory_ladder, structures, trainer_config

TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 176 --vocab-size 1024 "
        "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 8 --bf16 "
        "--hidden-dropout 0 --attention-dropout 0 --swiglu --normalization RMSNorm --disable-bias-linear "
        "--position-embedding-type rope --untie-embeddings-and-output-weights "
        "--tokenizer-type NullTokenizer --mock-data --train-iters 1 --lr 1e-4").split()
CLUSTER = ["--gpu", "h100", "--gpus-per-node", "4", "--nodes", "1", "--link", "nvlink,ib"]


def _cluster(extra=()):
    from megatron_weipipe.simulator.cli import build_cluster

    hw, opts, base = cli.parse(TINY + CLUSTER + list(extra))
    return build_cluster(hw), base


def test_branch_and_bound_ranks_the_top_as_the_exhaustive_search_and_lines_launch_as_printed():
    from megatron_weipipe.simulator.run_spec import spec_from_config

    cluster, base = _cluster()
    top = plan(base, cluster, 1, keep=3)
    every = plan(base, cluster, 1, keep=10**6)
    assert every.bounded == 0 and top.bounded > 0 and top.simulations < every.simulations
    assert len(every.ranked) == len(top.ranked) + top.bounded
    speeds = [e.tokens_per_s for e in every.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert [(e.candidate.describe(), e.tokens_per_s) for e in top.ranked[:3]] == \
        [(e.candidate.describe(), e.tokens_per_s) for e in every.ranked[:3]]
    ev = Evaluator(cluster)
    for e in top.ranked[:3]:
        line = cli.launch_line(base, e.candidate.flags, 1, 4)
        head, _, flags = line.partition(" pretrain_gpt.py ")
        assert head == "torchrun --nproc-per-node 4 --nnodes 1"
        cfg = trainer_config(shlex.split(flags), 4)  # pretrain_gpt.py's own parse and start-up rules
        assert spec_from_config(cfg, attention_impl="flash") == ev.spec(e.candidate)
        assert e.memory.device <= cluster.device.memory_gb * 1e9


def test_the_trainer_refuses_what_it_cannot_run():
    cluster, base = _cluster()
    odd = [a if a != "4" or base[i - 1] != "--num-layers" else "3" for i, a in enumerate(base)]
    p = plan(odd, cluster, 1, keep=10**6)
    assert p.ranked and all(e.candidate.structure.pp in (1, 3) for e in p.ranked)
    assert any("--num-layers" in reason for reason in p.rejections.counts)
    # each refusal is the trainer's: the same flags fail its start-up
    st = next(s for s in structures(4, 4, 3) if s.pp == 2)
    assert accepted(odd, st, Rung("none", ()), 4) is None
    with pytest.raises(Exception):
        trainer_config(odd + st.flags(), 4)


def test_a_structure_climbs_the_memory_ladder_to_its_first_fit():
    cluster, base = _cluster()
    ev = Evaluator(cluster)
    ladder = memory_ladder(256, (128,))
    st = next(s for s in structures(4, 4, 4) if (s.tp, s.cp, s.pp, s.mode.name) == (1, 1, 1, "ddp"))
    none, full = (ev.memory(accepted(base, st, r, 4)).device for r in (ladder[0], ladder[2]))
    assert full < none
    cap = (none + full) / 2  # the plain run does not fit, full recomputation does
    small = replace(cluster, device=replace(cluster.device, memory_gb=cap / 1e9))
    p = plan(base, small, 1, keep=10**6, fpdt_chunks=(128,))
    picked = next(e for e in p.ranked if e.candidate.structure == st)
    assert picked.candidate.rung.name in ("full", "full+offload-inputs", "selective")
    assert picked.memory.device <= cap
    for rung in ladder[:ladder.index(picked.candidate.rung)]:
        c = accepted(base, st, rung, 4)
        assert c is None or ev.memory(c).device > cap
    assert all(e.memory.device <= cap for e in p.ranked)


def test_bad_input_is_one_line(capsys):
    assert cli.main(TINY + CLUSTER + ["--pipeline-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pipeline-model-parallel-size" in err[0]
    i = TINY.index("--train-iters")
    no_length = TINY[:i] + TINY[i + 2:]
    assert cli.main(no_length + CLUSTER) == 2
    assert "--train-iters" in capsys.readouterr().err


def test_confirm_dry_runs_the_pick_against_the_estimator(capsys, tmp_path):
    import json

    path = tmp_path / "plan.json"
    assert cli.main(TINY + ["--gpu", "h100", "--gpus-per-node", "1", "--nodes", "1", "--top", "1",
                            "--confirm", "1", "--confirm-timeout", "300", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc-per-node 1 --nnodes 1 pretrain_gpt.py" in out
    assert "agree" in out and "FAILED" not in out
    (row,) = json.loads(path.read_text())["ranked"]
    assert row["launch"] in out and row["device_bytes"] == max(row["device_bytes_per_rank"]) > 0


def test_testbed_groups_and_verdicts():
    from tools.planner import testbed_check as tc

    with open(tc.RESULTS) as f:
        groups = tc.measured_groups(f.read())
    assert len(groups) == 31 and {g.layers for g in groups} == {2, 4} and {g.microbatches for g in groups} == {2, 4, 8, 32}
    g = next(g for g in groups if (g.preset, g.seq, g.layers) == ("a800-nvlink", 1024, 2))
    assert g.fastest()[0] == "weipipe-interleave"
    assert set(tc.candidates(g)) == {m[0] for m in g.measured}  # the planner's space holds every measured row
    four = next(g for g in groups if g.layers == 4)
    assert "interleaved" in tc.candidates(four)
    pred = {m[0]: 1.0 for m in g.measured}
    assert tc.verdict(g, {**pred, "weipipe-interleave": 2.0})["status"] == "exact"
    assert tc.verdict(g, {**pred, "weipipe-zb": 2.0})["status"] == "within spread"  # rounds overlap the fastest's
    assert tc.verdict(g, {**pred, "fsdp": 2.0})["status"] == "miss"


def test_testbed_groups_carry_their_batch_and_their_sweeps_host_speed():
    """A sweep's own host FLOP/s (its presets' emulated rates follow it) holds for its tables
    until the next section; each batch's table is a group of its own; the FSDP2 option rows
    are the planner's FSDP2 modes of the same flags."""
    from tools.planner import testbed_check as tc

    row = "| eth25 | 16384 | {} | 100 [90, 110] | 1.00 [1.00, 1.00] | x |"
    text = "\n".join([
        "## A sweep", "host: 87.0 GFLOP/s (one core ...)",
        "layers=2 hidden=32 heads=2 micro-batch 1, 8 microbatches/iteration (4 per FSDP2 rank)",
        row.format("1f1b"), row.format("fsdp-no-reshard-sync-once"),
        "layers=2 hidden=32 heads=2 micro-batch 1, 32 microbatches/iteration (16 per FSDP2 rank)",
        row.format("fsdp-sync-once"),
        "## The recorded sweep", "layers=2 hidden=32 heads=2 micro-batch 1, 4 microbatches/iteration",
        row.format("fsdp")])
    groups = tc.measured_groups(text)
    assert [(g.microbatches, g.flops, len(g.measured)) for g in groups] == [
        (8, 87.0e9, 2), (32, 87.0e9, 1), (4, tc.RECORDED_FLOPS, 1)]
    assert set(tc.candidates(groups[0])) == {"1f1b", "fsdp-no-reshard-sync-once"}
    assert set(tc.candidates(groups[1])) == {"fsdp-sync-once"}


def test_the_papers_methods_are_layouts_the_trainer_accepts():
    from tools.planner import papers

    for s in papers.settings():
        hw, opts, base = cli.parse(shlex.split(f"{s.model} {papers.RUN}") + shlex.split(s.cluster))
        cand, why = papers.paper_layout(s, base, opts.nodes * hw.gpus_per_node)
        assert cand is not None, (s.name, why)


def test_testbed_check_ranks_the_planners_layouts_by_the_testbed_prediction(tmp_path):
    """The check's ranking is the simulator's testbed prediction of each row, for the
    layouts of the planner's space (a calibration set written here: no host probe runs)."""
    from megatron_weipipe.simulator import calibration as calib
    from megatron_weipipe.simulator.calibration import ChunkTimes, Fsdp2Overhead, HostCalibration
    from megatron_weipipe.simulator.testbed import TestbedShape
    from tools.planner import testbed_check as tc

    shape, seq = TestbedShape(), 1024
    g = tc.Group("ib-edr", seq, shape.layers, shape.hidden, shape.heads, shape.microbatches,
                 (("1f1b", 3.0, 2.0, 4.0), ("weipipe-zb", 5.0, 4.5, 5.5), ("fsdp", 1.0, 0.5, 1.5)))
    name = f"L{shape.layers}-h{shape.hidden}-a{shape.heads}"
    ct = ChunkTimes(1, 0.01, 0.02, 0.014, 0.006)
    calib.save(HostCalibration(shape=shape.model(seq), module=ct, flat=ct, embed_forward=1e-3, embed_backward=2e-3,
                               head_forward=3e-3, head_backward=4e-3, optimizer_per_param=0.0, repeats=1),
               str(tmp_path / f"testbed-{name}-s{seq}.json"))
    (tmp_path / f"loop-{name}.json").write_text('{"seconds": 0.0}')
    (tmp_path / f"fsdp2-{name}.json").write_text(Fsdp2Overhead(2e-3, 4e-3, 0.01).to_json())
    (row,) = tc.check([g], [str(tmp_path)])
    assert set(row["predicted"]) == {"1f1b", "weipipe-zb", "fsdp"}
    assert row["choice"] == max(row["predicted"], key=row["predicted"].get)
    assert "--pipeline-model-parallel-size" in row["launch"]
    assert "first choice a hit in" in tc.report([row])

"""tools/simulate.py: a table per schedule and a PNG for good input; one line on stderr
and exit status 2 for bad input (unknown preset, a layout that cannot work)."""

from __future__ import annotations

import json

import pytest

from megatron_weipipe.simulator.cli import main

SMALL = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 4096 --micro-batch-size 1 "
         "--global-batch-size 16 --pipeline-model-parallel-size 4").split()


def test_table_json_and_png(tmp_path, capsys):
    png, out = tmp_path / "t.png", tmp_path / "r.json"
    rc = main(SMALL + ["--gpu", "h100", "--link", "nvlink,ib", "--gpus-per-node", "2",
                       "--schedules", "1f1b,interleaved,weipipe-interleave,weipipe-zb",
                       "--plot", str(png), "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for name in ("1f1b", "interleaved", "weipipe-interleave", "weipipe-zb"):
        assert f"| {name} |" in text
    assert "ib " in text and "nvlink " in text  # the pipeline crosses nodes of 2 GPUs
    assert png.stat().st_size > 10_000
    rows = json.loads(out.read_text())
    assert [r["schedule"] for r in rows] == ["1f1b", "interleaved", "weipipe-interleave", "weipipe-zb"]
    for r in rows:
        assert r["iteration_s"] > r["pipeline_s"] > 0 and 0 <= r["bubble"] < 1
        assert len(r["memory"]) == 4


def test_fpdt_section(capsys):
    rc = main(["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length",
               "262144", "--context-parallel-size", "4", "--fpdt", "--fpdt-chunk-size", "32768",
               "--fpdt-offload", "--gpu", "a100", "--link", "nvlink3,ib"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "8 chunks" in text and "host memory" in text and "prefetch" in text


@pytest.mark.parametrize("extra,needle", [
    (["--gpu", "tpu9"], "--gpu"),
    (["--link", "carrier-pigeon"], "--link"),
    (["--host-link", "usb"], "--host-link"),
    (["--schedules", "gpipe"], "--schedules"),
    (["--num-layers", "7"], "--num-layers"),
    (["--global-batch-size", "6"], "multiple"),
    (["--num-attention-heads", "6"], "--num-attention-heads"),
    (["--num-gpus", "6"], "--num-gpus"),
    (["--schedules", "interleaved", "--virtual-stages", "3"], "interleaved"),
    (["--context-parallel-size", "16"], "context"),
    (["--fpdt", "--fpdt-chunk-size", "3000", "--context-parallel-size", "2"], "--fpdt-chunk-size"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, extra, needle):
    rc = main(SMALL + extra)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


def test_weipipe_with_context_parallelism_is_simulated(capsys):
    """The training rules accept a WeiPipe ring per context-parallel rank, and so does the simulator."""
    rc = main(SMALL + ["--context-parallel-size", "2", "--schedules", "weipipe-zb"])
    assert rc == 0 and "| weipipe-zb |" in capsys.readouterr().out


def test_pipeline_schedules_need_a_pipeline(capsys):
    rc = main(SMALL[:-2] + ["--pipeline-model-parallel-size", "1", "--schedules", "weipipe-zb"])
    assert rc == 2 and "pipeline-model-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--weipipe-grad-dtype", "fp8"], ["--no-such-flag"], ["--num-layers", "x"]])
def test_bad_flags_are_one_line_too(capsys, extra):
    with pytest.raises(SystemExit) as e:
        main(SMALL + extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")

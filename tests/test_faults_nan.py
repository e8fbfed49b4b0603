"""A NaN in one microbatch's loss: stop with its iteration, rank and microbatch, or skip the step.

The NaN is injected (MEGATRON_WEIPIPE_INJECT_NAN) into the loss of microbatch 1 of
rank 1 in iteration 3: the last stage of a 2-stage 1F1B pipeline (stop); one of the two
WeiPipe ranks, each of which computes the loss of its own microbatches, and the second
context-parallel rank under FPDT, which holds half of each sequence's loss (skip). The
hook sits in model/gpt_step.py's loss, which all of them call.
"""

import re

import pytest

from harness.faults import Job, tiny_args

ARGS = dict(pipeline_model_parallel_size=2, global_batch_size=8)
ENV = {"MEGATRON_WEIPIPE_INJECT_NAN": "3:1:1", "MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2"}


def _run(**flags) -> tuple[list[int], str]:
    job = Job(2, tiny_args(5, **{**ARGS, **flags}), torchrun=False, env=ENV)
    try:
        codes = job.wait(120)
        job.wait_all_gone(10)
    finally:
        job.close()
    return codes, job.output()


@pytest.mark.timeout(150)
def test_nan_stops_the_run_naming_it():
    codes, out = _run()
    assert codes == [1, 1]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == ["error: [rank 0] NaN/Inf lm loss at iteration 3 on rank 1, microbatch 1 of that rank"], out
    assert "iteration        3/" not in out


SKIP_LAYOUTS = {
    "weipipe": dict(pipeline_schedule="weipipe-naive"),
    "fpdt-cp2": dict(pipeline_model_parallel_size=1, context_parallel_size=2, fpdt=True, fpdt_chunk_size=16),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", list(SKIP_LAYOUTS))
def test_nan_step_is_skipped_and_counted(layout):
    codes, out = _run(skip_nan_steps=True, **SKIP_LAYOUTS[layout])
    assert codes == [0, 0], out[-3000:]
    assert "WARNING: NaN/Inf lm loss at iteration 3 on rank 1, microbatch 1 of that rank: step skipped" in out
    counts = {
        int(m.group(1)): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"iteration\s+(\d+)/.*number of skipped iterations:\s+(\d+) \| "
                             r"number of nan iterations:\s+(\d+)", out)
    }
    assert counts == {1: (0, 0), 2: (0, 0), 3: (1, 1), 4: (1, 1), 5: (1, 1)}
    finite = re.findall(r"lm loss: (\S+) \|", out)
    assert len(finite) == 5 and all(v.lower() != "nan" for v in finite)

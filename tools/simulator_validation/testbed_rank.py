"""One rank of link_testbed.py: the trainer's own pretrain(), run once per job.

    python -m tools.simulator_validation.testbed_rank JOBS.json OUT.json   (RANK, WORLD_SIZE, MASTER_ADDR/PORT set;
                                                                          the repository root on PYTHONPATH)

JOBS.json is a list of {"key": ..., "argv": [...]}: pretrain_gpt.py command lines, run in
order in this one process (the import and process-group start-up are paid once; each job
builds its model, optimizer and data afresh, as pretrain_gpt.py does). Per job this rank
records every logged iteration's wall time, this process's CPU seconds (the work, whatever
else shares the core) and bytes sent by kind (pretrain's on_log, the
numbers of the `sent/rank/iter` log line). A job with "calibrate" instead of "argv" times
the layers of that shape here, on this rank's core, in the minute before the runs it
precedes (megatron_weipipe/training/host_calibration.py; every rank times on its own, nothing is sent), so
that a prediction is calibrated where and when the rows are measured. OUT.json is
rewritten after every job.
"""

import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def main(jobs_path: str, out_path: str) -> int:
    import torch.distributed as dist

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.initialize import destroy_model_parallel_groups
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain
    from pretrain_gpt import model_provider

    if os.environ.get("TESTBED_CORE"):  # taskset did it already where installed
        os.sched_setaffinity(0, {int(os.environ["TESTBED_CORE"])})
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        if "calibrate" in job:
            results.append(dict(calibrate(job["calibrate"]), key=job["key"], rank=dist.get_rank()))
            _write(results, out_path)
            continue
        logs = []
        cfg = parse_config(job["argv"])
        t0 = time.time()
        cpu = [time.process_time()]

        def on_log(s):  # log interval 1: the CPU seconds since the previous log are this iteration's
            now = time.process_time()
            logs.append({"iteration": s["iteration"], "elapsed_ms": s["elapsed_ms"], "cpu_s": now - cpu[0],
                         "bytes_sent": dict(s["bytes_sent"])})
            cpu[0] = now

        pretrain(cfg, model_provider, forward_step, on_log=on_log)
        destroy_model_parallel_groups()  # before the next job: its threads would share this core
        results.append({"key": job["key"], "wall_s": time.time() - t0, "iterations": logs,
                        "rank": dist.get_rank()})
        _write(results, out_path)
    from megatron_weipipe.initialize import shutdown_distributed

    shutdown_distributed()
    return 0


def calibrate(spec: dict) -> dict:
    """{"calibration": HostCalibration as JSON, "wall_s"} of the testbed model at spec["seq"]:
    a 1F1B stage's layers, as testbed_compare.py calibrates them, without the optimizer."""
    import torch.distributed as dist

    from megatron_weipipe.simulator.testbed import TestbedShape
    from megatron_weipipe.training import host_calibration

    if not dist.is_initialized():  # the first job: the group pretrain() would start (env://)
        dist.init_process_group("gloo")
    shape = TestbedShape(spec["layers"], spec["hidden"], spec["heads"])
    t0 = time.time()
    cal = host_calibration.calibrate(shape.model(spec["seq"]), max(1, spec["layers"] // 2), repeats=spec["repeats"],
                                     min_seconds=spec.get("min_seconds", 0.0),
                                     time_optimizer=False)
    return {"calibration": json.loads(cal.to_json()), "wall_s": time.time() - t0}


def _write(results: list, out_path: str) -> None:
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

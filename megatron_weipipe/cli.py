"""Process entry: parse, validate, train, and turn failures into one line + exit code.

Exit codes: 0 finished or stopped on request (SIGTERM, --exit-interval,
--exit-duration-in-mins) with a checkpoint saved; 2 bad flags or inputs found before
any process group exists; 1 any failure during the run (data, checkpoint, NaN, a peer
rank). Expected failures print ``error: [rank R] <one line>`` once, from the rank that
found them; anything unexpected also prints its traceback first.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from megatron_weipipe.errors import EXIT_CONFIG, launcher_rank

EXIT_FAILURE = 1  # a failure during the run (data, checkpoint, NaN, peer rank)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _check_host(cfg) -> None:
    """What this host cannot run (FP8 without Transformer Engine on a recent GPU, ...), before
    any process group exists: one line and exit 2, like a bad flag."""
    from megatron_weipipe.model.layer_choice import check_host
    from megatron_weipipe.platform import detect_platform

    check_host(cfg, detect_platform())


def run_main(argv, model_provider, forward_step) -> int:
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.config import ConfigError

    logging.basicConfig(level=os.environ.get("MEGATRON_WEIPIPE_LOG_LEVEL", "WARNING"), format="%(message)s")
    rank = launcher_rank()
    try:
        cfg = parse_config(argv)
        _check_host(cfg)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_CONFIG

    from megatron_weipipe.initialize import shutdown_distributed
    from megatron_weipipe.training.checkpoint.directory import CheckpointError
    from megatron_weipipe.training.pretrain import pretrain
    from megatron_weipipe.training.step import NaNError

    expected = (CheckpointError, NaNError, ValueError, FileNotFoundError, KeyboardInterrupt)
    try:
        pretrain(cfg, model_provider, forward_step)
    except BaseException as e:
        report = getattr(e, "report", None) or _one_line(e)
        if not isinstance(e, expected) and not report.startswith("stopping:"):  # not explained by a peer
            traceback.print_exc()
        if not getattr(e, "quiet", False):
            print(f"error: [rank {rank}] {report}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    finally:
        shutdown_distributed()
    return 0

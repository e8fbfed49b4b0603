"""torchrun, except that SIGTERM lets the ranks save and exit 0 instead of failing the job.

    python -m megatron_weipipe.launch --nproc-per-node 8 pretrain_gpt.py --exit-signal-handler ...

torchrun answers SIGTERM by raising inside its agent: it sends SIGTERM to every worker,
SIGKILLs them after ``--shutdown-timeout`` (30 s by default) and exits non-zero even when
every worker saved and exited 0. Here SIGTERM is left out of torchrun's own handling
and forwarded to the workers instead; with ``--exit-signal-handler`` they finish the
iteration, save a checkpoint and exit 0, and so does this launcher. Everything else
(SIGINT, a failing worker, all torchrun flags) behaves as in torchrun.
"""

from __future__ import annotations

import signal
import sys


def _forward_to_workers(signum, frame) -> None:
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def main(argv=None) -> None:
    import torch.distributed.run as run

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        argv = ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", *argv]
    signal.signal(signal.SIGTERM, _forward_to_workers)
    run.main(argv)


if __name__ == "__main__":
    main()

"""torchrun, except that SIGTERM lets the ranks save and exit 0 instead of failing the job.

    python -m megatron_weipipe.launch --nproc-per-node 8 pretrain_gpt.py --exit-signal-handler ...

torchrun answers SIGTERM by raising inside its agent: it sends SIGTERM to every worker,
SIGKILLs them after ``--shutdown-timeout`` (30 s by default) and exits non-zero even when
every worker saved and exited 0. Here SIGTERM is left out of torchrun's own handling
and forwarded to the workers instead; with ``--exit-signal-handler`` they finish the
iteration, save a checkpoint and exit 0, and so does this launcher. Everything else
(SIGINT, a failing worker, all torchrun flags) behaves as in torchrun.

One more guard: once this host's workers have all exited, torchrun's agent still talks
to the rendezvous store (exit barrier, shutdown), and a store call over a link whose
packets vanish never returns. If the agent is still there
MEGATRON_WEIPIPE_LAUNCHER_GRACE seconds (default 60) after its last worker exited, this
launcher exits 1 with a message instead of hanging.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def _forward_to_workers(signum, frame) -> None:
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def _exit_when_stranded(grace: float, endpoint: str) -> None:
    """Exit 1 if the agent outlives its last worker by ``grace`` seconds (see the docstring)."""
    import psutil

    me = psutil.Process()
    had_workers, gone_since = False, None
    while True:
        time.sleep(0.5)
        try:
            workers = [c for c in me.children() if c.status() != psutil.STATUS_ZOMBIE]
        except psutil.Error:
            continue
        if workers:
            had_workers, gone_since = True, None
        elif had_workers:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > grace:
                print(f"error: [launcher] this host's ranks exited {grace:.0f}s ago and torchrun's agent is "
                      f"still waiting on the rendezvous store {endpoint}: it is unreachable; exiting",
                      file=sys.stderr, flush=True)
                os._exit(1)


def _endpoint(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a.startswith(("--rdzv-endpoint=", "--rdzv_endpoint=")):
            return a.split("=", 1)[1]
        if a in ("--rdzv-endpoint", "--rdzv_endpoint") and i + 1 < len(argv):
            return argv[i + 1]
    return "(local)"


def main(argv=None) -> None:
    import torch.distributed.run as run

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        argv = ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", *argv]
    signal.signal(signal.SIGTERM, _forward_to_workers)
    grace = float(os.environ.get("MEGATRON_WEIPIPE_LAUNCHER_GRACE", "60"))
    threading.Thread(target=_exit_when_stranded, args=(grace, _endpoint(argv)), daemon=True).start()
    run.main(argv)


if __name__ == "__main__":
    main()

"""--confirm: the dry run (tools/dry_run.py) of a planned layout's heaviest rank, against
the estimator the plan filtered with.

The dry run executes the rank's real program under fake tensors and reports its peak
beside the estimator's for the same run (its ``estimator`` entry, on the layers the dry
run builds: megatron-core's local layers for ``--platform cuda``). The check is that the two
agree: a plan whose fit rests on the estimator is only as good as that agreement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOLERANCE = 0.10  # tools/simulator_validation/dry_run_vs_estimator.py's


@dataclass(frozen=True)
class Confirmation:
    rank: int  # the global rank dry-run (the heaviest pipeline / ring rank's first)
    dry_run: int  # its accelerator peak, bytes
    estimator: int  # the estimator's for the same run
    dry_run_host: int
    estimator_host: int
    error: str = ""  # the dry run's failure, if any

    @property
    def ratio(self) -> float:
        return self.estimator / self.dry_run if self.dry_run else float("inf")

    def agrees(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        host_ok = (self.estimator_host == self.dry_run_host or
                   abs(self.estimator_host / max(self.dry_run_host, 1) - 1) <= tolerance)
        return not self.error and abs(self.ratio - 1) <= tolerance and host_ok


def confirm(flags: Sequence[str], world: int, rank: int, timeout: float = 1800.0) -> Confirmation:
    """Run the dry run of ``rank`` of ``world`` on pretrain_gpt.py ``flags`` in its own process."""
    cmd = [sys.executable, "-m", "tools.dry_run", *flags, "--world-size", str(world), "--rank", str(rank),
           "--json", "--platform", "cuda"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Confirmation(rank, 0, 0, 0, 0, error=f"dry run took over {timeout:g} s")
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return Confirmation(rank, 0, 0, 0, 0, error=f"dry run exit {p.returncode}: {tail}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    est = out["estimator"]
    return Confirmation(rank, out["peak_accelerator_bytes"], est["peak_accelerator_bytes"], out["host_bytes"],
                        est["host_bytes"])

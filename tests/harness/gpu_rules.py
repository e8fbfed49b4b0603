"""Train under the two GPU rules a CPU run cannot feel: no host sync inside
forward-backward (harness/syncs.py) and no host tensor in an NCCL collective
(harness/devices.py)."""

from __future__ import annotations

from harness.devices import DeviceDiscipline
from harness.syncs import SyncCounter

FORWARD_BACKWARD = "forward_backward"  # the schedule's forward_backward, inside "forward/backward"


def train_under_gpu_rules(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    """Train each flag set with both checks installed. Per run: the iterations, the syncs
    {region: {site: calls}} (regions: the loop's phases from ``faults.set_phase``, and
    FORWARD_BACKWARD), the host tensors that reached would-be NCCL calls (as text) and how
    many such calls were checked."""
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe import faults
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.schedules import registry
    from megatron_weipipe.training.pretrain import pretrain

    out = []
    for argv in argvs:
        cfg = parse_config(argv, world_size=world_size)
        devices = DeviceDiscipline()
        syncs = SyncCounter(is_host=devices.is_host)
        schedule_class = registry.train_class(cfg.schedule_name)
        plain_forward_backward, plain_set_phase = schedule_class.forward_backward, faults.set_phase
        phase = []

        def forward_backward(self, *args, **kwargs):
            with syncs.region(FORWARD_BACKWARD):
                return plain_forward_backward(self, *args, **kwargs)

        def set_phase(name, iteration=None):
            while phase:
                phase.pop().__exit__(None, None, None)
            phase.append(syncs.region(name))
            phase[-1].__enter__()
            return plain_set_phase(name, iteration)

        def model_provider(*args, **kwargs):
            return devices.mark_module(pretrain_gpt.model_provider(*args, **kwargs))

        schedule_class.forward_backward, faults.set_phase = forward_backward, set_phase
        devices.install()
        try:
            with syncs:
                state = pretrain(cfg, model_provider, forward_step)
        finally:
            devices.uninstall()
            schedule_class.forward_backward, faults.set_phase = plain_forward_backward, plain_set_phase
            while phase:
                phase.pop().__exit__(None, None, None)
        out.append({"iterations": state.iteration, "syncs": {k: dict(v) for k, v in syncs.calls.items()},
                    "checked": devices.checked_calls, "host_tensors": sorted({str(v) for v in devices.violations})})
        parallel_state.destroy_model_parallel()
    return out

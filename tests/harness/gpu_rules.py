"""Train under the two GPU rules a CPU run cannot feel: no host sync inside
forward-backward (harness/syncs.py) and no host tensor in an NCCL collective
(harness/devices.py)."""

from __future__ import annotations

from harness.devices import DeviceDiscipline
from harness.syncs import SyncCounter

FORWARD_BACKWARD = "forward_backward"  # the schedule's forward_backward, inside "forward/backward"


class GpuRules:
    """Both checks around one training run of ``cfg``: the syncs {region: {site: calls}}
    (regions: the loop's phases from ``faults.set_phase``, and FORWARD_BACKWARD), the host
    tensors that reached would-be NCCL calls (as text) and how many such calls were checked.
    Build the run's models through ``model_provider`` (their parameters live on the device)."""

    def __init__(self, cfg) -> None:
        from megatron_weipipe.schedules import registry

        self.devices = DeviceDiscipline()
        self.syncs = SyncCounter(is_host=self.devices.is_host)
        self.schedule_class = registry.train_class(cfg.schedule_name)
        self._phase: list = []

    def model_provider(self, provider):
        def model_provider(*args, **kwargs):
            return self.devices.mark_module(provider(*args, **kwargs))
        return model_provider

    def __enter__(self) -> "GpuRules":
        from megatron_weipipe import faults
        from megatron_weipipe.byte_counter import process_byte_counter

        # torch.distributed's counting wrappers first (start-up installs them once per
        # process): the discipline wraps them and puts them back, so ctx.bytes keeps counting.
        process_byte_counter()

        syncs, phase = self.syncs, self._phase
        self._plain = plain_forward_backward, plain_set_phase = self.schedule_class.forward_backward, faults.set_phase

        def forward_backward(schedule, *args, **kwargs):
            with syncs.region(FORWARD_BACKWARD):
                return plain_forward_backward(schedule, *args, **kwargs)

        def set_phase(name, iteration=None):
            while phase:
                phase.pop().__exit__(None, None, None)
            phase.append(syncs.region(name))
            phase[-1].__enter__()
            return plain_set_phase(name, iteration)

        self.schedule_class.forward_backward, faults.set_phase = forward_backward, set_phase
        self.devices.install()
        syncs.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from megatron_weipipe import faults

        try:
            self.syncs.__exit__(*exc)
        finally:
            self.devices.uninstall()
            self.schedule_class.forward_backward, faults.set_phase = self._plain
            while self._phase:
                self._phase.pop().__exit__(None, None, None)

    def report(self, iterations: int) -> dict:
        return {"iterations": iterations, "syncs": {k: dict(v) for k, v in self.syncs.calls.items()},
                "checked": self.devices.checked_calls,
                "host_tensors": sorted({str(v) for v in self.devices.violations})}


def train_under_gpu_rules(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    """Train each flag set with both checks installed (GpuRules' report per run)."""
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    out = []
    for argv in argvs:
        cfg = parse_config(argv, world_size=world_size)
        with GpuRules(cfg) as rules:
            state = pretrain(cfg, rules.model_provider(pretrain_gpt.model_provider), forward_step)
        out.append(rules.report(state.iteration))
        parallel_state.destroy_model_parallel()
    return out

"""Inside a rank: what megatron-core's DDP, distributed optimizer and pipeline schedules did,
recorded in call order (tests/test_ddp_options.py reads it).

Each probe wraps megatron-core functions by name for the duration of one run and restores
them; the events are plain tuples, picklable back to the test process.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _patched(owner, name: str, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def record_param_gathers(events: list):
    """("forward", forward_only) per schedule call, ("step",) / ("stepped",) around the
    distributed optimizer's step, ("gather", asynchronous) per all-gather of a bucket group's
    parameters, and ("wait",) when a forward pre-hook waits for one (or a forced sync
    finishes one in flight)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_weipipe.schedules.gpt.megatron_schedules import MegatronSchedule

    def gather(original):
        def start_param_sync(self, force_sync=False):
            if force_sync and self.param_gather_handle is not None:
                events.append(("wait",))
            else:
                events.append(("gather", bool(self.ddp_config.overlap_param_gather and not force_sync)))
            return original(self, force_sync=force_sync)
        return start_param_sync

    def step(original):
        def step_with_ready_grads(self):
            events.append(("step",))
            try:
                return original(self)
            finally:
                events.append(("stepped",))
        return step_with_ready_grads

    def finish(original):
        def finish_param_sync(self, *args, **kwargs):
            # in flight, or not yet started: the hook then starts it and waits for it
            pending = self.param_gather_handle is not None or not self.param_gather_dispatched
            out = original(self, *args, **kwargs)
            if pending:
                events.append(("wait",))
            return out
        return finish_param_sync

    def forward_backward(original):
        def wrapped(self, forward_step, microbatches, forward_only=False):
            events.append(("forward", forward_only))
            return original(self, forward_step, microbatches, forward_only=forward_only)
        return wrapped

    with _patched(pgb._ParamAndGradBucketGroup, "start_param_sync", gather), \
            _patched(DistributedOptimizer, "step_with_ready_grads", step), \
            _patched(pgb._ParamAndGradBucketGroup, "finish_param_sync", finish), \
            _patched(MegatronSchedule, "forward_backward", forward_backward):
        yield


@contextlib.contextmanager
def record_p2p(events: list):
    """("p2p", waited) per megatron-core point-to-point exchange: waited is False where the
    schedule took the requests back to overlap them (overlap_p2p_comm)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    def communicate(original):
        def wrapped(self, *args, wait_on_reqs=True, **kwargs):
            events.append(("p2p", bool(wait_on_reqs)))
            return original(self, *args, wait_on_reqs=wait_on_reqs, **kwargs)
        return wrapped

    with _patched(P2PCommunicator, "_communicate", communicate):
        yield


@contextlib.contextmanager
def record_validation(values: list):
    """Every validation loss the loop computes."""
    from megatron_weipipe.training import evaluation

    def evaluate(original):
        def wrapped(run):
            value = original(run)
            values.append(value)
            return value
        return wrapped

    with _patched(evaluation, "evaluate", evaluate):
        yield


@contextlib.contextmanager
def capture_optimizer(found: list):
    """The megatron-core optimizer a run builds."""
    from megatron_weipipe.training import run_setup

    def build(original):
        def wrapped(*args, **kwargs):
            optimizer = original(*args, **kwargs)
            found.append(optimizer)
            return optimizer
        return wrapped

    with _patched(run_setup, "build_optimizer", build):
        yield


def optimizer_shard(optimizer) -> dict:
    """What one rank's distributed optimizer holds: the sizes of its data-parallel groups and
    its Adam first moments, flattened in parameter order."""
    import numpy as np

    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    moments = [inner.optimizer.state[p]["exp_avg"].detach().reshape(-1).double().cpu().numpy()
               for group in inner.optimizer.param_groups for p in group["params"]]
    inter = getattr(inner, "distributed_optimizer_instance_id", 0)
    return {"shard_group_size": inner.data_parallel_group.size(), "instance": inter,
            "exp_avg": np.concatenate(moments) if moments else np.zeros(0)}

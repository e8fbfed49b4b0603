"""``--overlap-param-gather``: the distributed optimizer's parameter all-gather, deferred into the next forward.

With megatron-core DDP's ``overlap_param_gather`` the optimizer step updates only this
rank's shard of each parameter and gathers nothing (``DistributedOptimizer.step_with_ready_grads``,
0.16 to 0.19); the gather of a bucket group starts at the forward pre-hook of the first
module that uses one of its parameters, which waits for it and starts the next group's
(with virtual stages, megatron-core's interleaved schedule starts each chunk's gathers
through ``param_sync_func`` and the hooks only wait). Between a step and the next training
forward the model's parameters are therefore stale outside this rank's shard: evaluation
and checkpoint saving must first finish the gather, as Megatron-LM's training loop does.
This class is that lifecycle; the training loop says when.
"""

from __future__ import annotations


class DeferredParamGather:
    """The forward pre-hooks (and ``param_sync_func``) of megatron-core DDP chunks, switched
    on and off as Megatron-LM's ``enable_forward_pre_hook`` / ``disable_forward_pre_hook`` do."""

    def __init__(self, chunks: list, config):
        self.chunks = chunks
        self.config = config  # the first chunk's TransformerConfig: megatron-core's schedules read it
        self.param_sync_func = config.param_sync_func
        self.active = True  # DDP registers its hooks when it is built

    def pause(self, sync: bool) -> None:
        """Hooks off (and the schedule's gather dispatch); ``sync``: gather every parameter now."""
        if self.active:
            for chunk in self.chunks:
                chunk.disable_forward_pre_hook(param_sync=sync)
            self.config.param_sync_func = None
            self.active = False
        elif sync:
            self.finish()

    def resume(self) -> None:
        """Hooks on: the next forward waits for (and starts) each bucket group's gather."""
        if not self.active:
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()
            self.config.param_sync_func = self.param_sync_func
            self.active = True

    def finish(self) -> None:
        """Every gather done now (waited for if in flight); the hooks stay as they are and find
        nothing left to wait for."""
        for chunk in self.chunks:
            chunk.start_param_sync(force_sync=True)

"""What Megatron-LM's ``train()`` does around the steps for speed and memory, at the same points:

* ``--overlap-param-gather`` (schedules/gpt/param_gather.py): the forward pre-hooks are off
  until the first step that updates the weights (an error in a loaded checkpoint or the
  initialisation is then not spread by the first all-gather); evaluation runs with them off
  and every gather finished, a checkpoint is saved after every gather finished, and at the
  end of training they are switched off with the gathers done;
* ``--manual-gc``: Python's automatic garbage collection off from the start of training,
  one full collection then, every ``--manual-gc-interval`` iterations, and before / after
  (generation 0) each evaluation unless ``--no-manual-gc-eval``; it is switched back on when
  training ends, however it ends;
* ``--empty-unused-memory-level``: the platform's ``empty_cache`` after each
  forward/backward and evaluation step (1), and after each optimizer step (2); nothing on a
  CPU host.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Optional

from megatron_weipipe.config import TrainingConfig
from megatron_weipipe.platform import Platform
from megatron_weipipe.schedules.gpt.param_gather import DeferredParamGather


class Housekeeping:
    def __init__(self, training: TrainingConfig, param_gather: Optional[DeferredParamGather], platform: Platform):
        """``param_gather``: the schedule's (None without --overlap-param-gather)."""
        self.gather = param_gather
        self.platform = platform
        self.memory_level = training.empty_unused_memory_level
        self.manual_gc = training.manual_gc
        self.gc_interval = training.manual_gc_interval
        self.gc_eval = training.manual_gc_eval
        self._gc_was_enabled: Optional[bool] = None
        self._first_step_done = False

    def start(self) -> None:
        """Before the first iteration of this run."""
        if self.manual_gc:
            self._gc_was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        if self.gather is not None:
            self.gather.pause(sync=False)  # the parameters are whole: loaded or initialised

    def after_forward_backward(self) -> None:
        if self.memory_level >= 1:
            self.platform.empty_cache()

    def after_optimizer_step(self, stepped: bool) -> None:
        if self.memory_level >= 2:
            self.platform.empty_cache()
        if stepped and not self._first_step_done:
            self._first_step_done = True
            if self.gather is not None:
                self.gather.resume()  # the next forward gathers what this step updated

    def after_iteration(self, iteration: int) -> None:
        if self.manual_gc and self.gc_interval and iteration % self.gc_interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        """Around one validation run."""
        resume = self.gather is not None and self.gather.active
        if resume:
            self.gather.pause(sync=True)
        if self.manual_gc and self.gc_eval:
            gc.collect()
        yield
        if self.manual_gc and self.gc_eval:
            gc.collect(generation=0)  # what the evaluation made
        if resume:
            self.gather.resume()

    def after_evaluation_step(self) -> None:
        if self.memory_level >= 1:
            self.platform.empty_cache()

    def before_save(self) -> None:
        """The checkpoint holds every rank's whole parameters, not the last step's stale ones."""
        if self.gather is not None and self.gather.active:
            self.gather.finish()

    def stop(self) -> None:
        """After the last iteration: the gathers done and the hooks off, as Megatron-LM leaves them."""
        if self.gather is not None:
            self.gather.pause(sync=True)

    def restore(self) -> None:
        """However training ended (no collective here): Python's automatic collection as it was."""
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = None

"""What each compute action of a schedule costs, in seconds.

Two sources with one shape: FLOPs over a device's sustained rate (plus memory-bound
elementwise work and the tensor/context-parallel collectives inside a layer, which
Megatron does not overlap), or a HostCalibration of this machine.

A split backward (weipipe-zb's BACKWARD_INPUT / BACKWARD_WEIGHT) is priced the way the
runtime's `weight_pass` runs it (weight_pass.WeightPass, weight_pass.SIMULATED_WEIGHT_PASSES):
- "stored": I computes both gradients in one pass (a full backward), W only adds the
  stored weight gradient to the travelling token;
- "replay": I is an input-gradient pass keeping the graph, W a second autograd pass,
  which for k layers redoes the full backward of the k-1 upper layers (to reach the
  lower layers' weights) and the weight part of the bottom one;
- "ideal": a per-layer weight-gradient kernel (GPT training's deferred weight GEMMs,
  Transformer Engine's delayed wgrad): I and W cost their own FLOPs, as the schedule
  assumes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from megatron_weipipe.weight_pass import WeightPass
from megatron_weipipe.schedules.ir.actions import Action, Kind, Schedule

from . import collectives
from .calibration import ChunkTimes, HostCalibration
from megatron_weipipe.errors import SimulatorError
from megatron_weipipe.fpdt.config import ulysses_heads_sent
from .hardware import DeviceSpec, LinkSpec
from megatron_weipipe.shape import ModelShape

# Optimizer step on the device, bytes touched per parameter: read fp32 master, grad, two
# Adam moments; write master and moments; write the bf16 copy; the norm reads the grad
# again and zeroing writes it.
OPTIMIZER_BYTES_PER_PARAM = 4 + 4 + 8 + 12 + 2 + 4 + 4
FLASH_BACKWARD_FACTOR = 2.5  # flash attention's backward recomputes the scores: 5 matmuls vs 2


def scale_chunk(t: ChunkTimes, layers: int) -> ChunkTimes:
    """Chunk times for another number of layers from measured ones (the weight pass keeps
    its one bottom layer and adds a full backward per extra layer)."""
    per = 1.0 / t.layers
    return ChunkTimes(
        layers=layers,
        forward=t.forward * layers * per,
        backward=t.backward * layers * per,
        backward_input=t.backward_input * layers * per,
        backward_weight=t.backward_weight + (layers - t.layers) * t.backward * per,
    )


@dataclass(frozen=True)
class CostModel:
    module: ChunkTimes  # one Megatron stage chunk, called as modules
    flat: ChunkTimes  # one WeiPipe chunk, called through flat weight views
    embed_forward: float
    embed_backward: float
    head_forward: float  # final norm + output layer + loss
    head_backward: float
    optimizer_per_param: float
    recompute: float = 0.0  # share of a forward run again in each backward: 1 full, less selective (RunSpec)
    weight_pass: str = WeightPass.STORED  # how WeiPipe's runtime splits a backward (see the module doc)
    grad_add: float = 0.0  # adding a chunk's weight gradient into the gradient token
    # FSDP2's fixed CPU seconds per unit and pass (hooks, DTensor bookkeeping, each collective's
    # own cost), and the step after an FSDP iteration's microbatches (None: the optimizer over
    # the shard); measured by tools/simulator_validation/fsdp2_overhead.py on a CPU host, 0 / None for FLOP costs
    fsdp_unit_forward: float = 0.0
    fsdp_unit_backward: float = 0.0
    fsdp_step: Optional[float] = None

    def for_layers(self, layers: int) -> "CostModel":
        return replace(self, module=scale_chunk(self.module, layers), flat=scale_chunk(self.flat, layers))

    def duration(self, schedule: Schedule) -> Callable[[Action], float]:
        """Seconds of each compute action of this schedule on one rank."""
        weipipe = schedule.family == "weipipe"
        t = self.flat if weipipe else self.module
        last = schedule.num_chunks - 1
        re = t.forward * self.recompute

        def weipipe_cost(a: Action) -> float:
            first = a.chunk == 0
            if a.kind is Kind.FORWARD:
                return t.forward + (self.embed_forward if first else 0.0)
            if a.kind is Kind.LOSS:
                return self.head_forward + self.head_backward
            if a.kind is Kind.BACKWARD:
                return t.backward + re + (self.embed_backward if first else 0.0)
            if a.kind is Kind.BACKWARD_INPUT:
                i = t.backward if self.weight_pass == WeightPass.STORED else t.backward_input
                return i + re + (self.embed_backward if first else 0.0)
            if a.kind is Kind.BACKWARD_WEIGHT:
                return self.grad_add if self.weight_pass == WeightPass.STORED else t.backward_weight
            return 0.0

        def megatron_cost(a: Action) -> float:
            ends_f = (self.embed_forward if a.chunk == 0 else 0.0) + (self.head_forward if a.chunk == last else 0.0)
            ends_b = (self.embed_backward if a.chunk == 0 else 0.0) + (self.head_backward if a.chunk == last else 0.0)
            if a.kind is Kind.FORWARD:
                return t.forward + ends_f
            if a.kind is Kind.BACKWARD:
                return t.backward + re + ends_b
            if a.kind is Kind.BACKWARD_INPUT:  # zb-h1: the recompute and the ends go with I
                return t.backward_input + re + ends_b
            if a.kind is Kind.BACKWARD_WEIGHT:
                return t.backward_weight
            return 0.0

        return weipipe_cost if weipipe else megatron_cost


def from_calibration(cal: HostCalibration, layers: int, recompute: float = 0.0,
                     weight_pass: str = WeightPass.STORED) -> CostModel:
    if weight_pass == WeightPass.IDEAL:
        raise SimulatorError("--weipipe-weight-pass ideal needs FLOP-based costs (a GPU preset), not --calibrate")
    base = CostModel(cal.module, cal.flat, cal.embed_forward, cal.embed_backward, cal.head_forward,
                     cal.head_backward, cal.optimizer_per_param, recompute, weight_pass)
    return base.for_layers(layers)


@dataclass(frozen=True)
class FlopOptions:
    tp: int = 1
    cp: int = 1
    tp_link: LinkSpec = LinkSpec("none", 1e9, 0.0)
    cp_link: LinkSpec = LinkSpec("none", 1e9, 0.0)
    dtype_bytes: int = 2
    weight_pass: str = WeightPass.STORED  # one of weight_pass.SIMULATED_WEIGHT_PASSES, see the module doc
    recompute: float = 0.0  # CostModel.recompute
    extra_forward: float = 0.0  # seconds added to every layer forward (e.g. FPDT chunking)
    extra_backward: float = 0.0


def layer_times(shape: ModelShape, device: DeviceSpec, o: FlopOptions) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one layer and one microbatch."""
    split = o.tp * o.cp
    gemm = shape.layer_gemm_flops() / split / device.gemm_flops
    attn = shape.attention_flops(device.causal_fraction) / split / device.attention_rate
    tokens = shape.tokens / o.cp
    fc1 = shape.ffn * (2 if shape.swiglu else 1)
    elem = tokens * o.dtype_bytes * (16 * shape.hidden_size + 4 * fc1 / o.tp) / (device.hbm_gbs * 1e9)
    act = int(tokens * shape.hidden_size * o.dtype_bytes)
    tp_comm = 2 * collectives.all_reduce(act, o.tp, o.tp_link).seconds
    heads = ulysses_heads_sent(shape.num_attention_heads, shape.groups, o.cp, o.tp) + shape.num_attention_heads // o.tp
    a2a = int(tokens * heads * shape.head_dim * o.dtype_bytes)
    cp_comm = collectives.all_to_all(a2a, o.cp, o.cp_link).seconds
    forward = gemm + attn + elem + tp_comm + cp_comm + o.extra_forward
    backward_input = gemm + FLASH_BACKWARD_FACTOR * attn + 2 * elem + tp_comm + cp_comm + o.extra_backward
    return forward, backward_input, gemm


def from_flops(shape: ModelShape, device: DeviceSpec, layers: int, o: FlopOptions) -> CostModel:
    f, i, w = layer_times(shape, device, o)
    k = layers
    wpass = k * w if o.weight_pass == WeightPass.IDEAL else (k - 1) * (i + w) + w
    chunk = ChunkTimes(k, k * f, k * (i + w), k * i, wpass)
    module = replace(chunk, backward_weight=k * w)
    weights = k * shape.layer_params(o.tp)
    hbm = device.hbm_gbs * 1e9
    tokens = shape.tokens / o.cp
    vocab = shape.padded_vocab(o.tp) / o.tp
    head_gemm = 2.0 * tokens * shape.hidden_size * vocab / device.gemm_flops
    ce = tokens * vocab * 4 * 3 / hbm  # fp32 logits: softmax, loss, gradient
    embed = tokens * shape.hidden_size * o.dtype_bytes * 2 / hbm
    return CostModel(
        module=module, flat=chunk, embed_forward=embed, embed_backward=2 * embed,
        head_forward=head_gemm + ce, head_backward=2 * head_gemm + ce,
        optimizer_per_param=OPTIMIZER_BYTES_PER_PARAM / hbm, recompute=o.recompute,
        weight_pass=WeightPass.REPLAY if o.weight_pass == WeightPass.IDEAL else o.weight_pass,
        grad_add=weights * 4 * 3 / hbm,  # read token and gradient, write token (fp32)
    )

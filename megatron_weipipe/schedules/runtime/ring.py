"""Execute one rank's WeiPipe action list with real tensors and point-to-point messages.

The runtime is generic over the model. The caller supplies:
  - `chunk_template`: a module with the structure every decoder chunk shares; it is only
    ever called through torch.func.functional_call with views into a flat weight buffer;
  - the flat fp32 master of the chunk this ring rank owns (chunk index = ring rank);
  - `pre_fn(mb) -> hidden` and `post_fn(hidden, mb) -> loss`, replicated on every ring
    rank; their own parameters get ordinary `.grad`s, which the caller all-reduces over
    the ring after the iteration.
After `run_iteration` the owner's summed fp32 gradient of its chunk (all G*P
microbatches of the ring) is returned flat; the caller reduces it over data-parallel
replicas and steps its optimizer. Losses are backpropagated as returned by post_fn
(scale them there, e.g. by 1/num_microbatches, if a mean is wanted).

Communication is posted exactly as ir/posts.rank_posts describes for `order` (the
program tools/check_schedules.py proves deadlock-free under NCCL's rules): by default
"parity", single isend/irecv ops, a SEND posted where it stands, irecvs posted
`lookahead` ticks ahead into fresh tensors (the double buffer) on odd ring ranks and
after the tick's sends on even ones; a RECV waits for its message. Every flow has its
own tag, and receives are posted per peer in the order that peer sends, so matching
holds where tags are ignored (NCCL; `use_tags=False` runs that way on gloo too).

Backward weights are real: without recomputation the forward graph does not keep the
forward-weight buffer; the weights it saved are swapped at unpack time for views of the
backward-weight buffer the schedule names, and the weight gradient flows into a
storage-free anchor. With recomputation the forward runs without a graph and the
backward recomputes it from the backward-weight buffer. So a schedule that routes the
wrong chunk into a backward gives wrong gradients, which the parity tests would see.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from megatron_weipipe.byte_counter import ByteCounter
from megatron_weipipe.platform import detect_platform
from megatron_weipipe.config import one_of
from megatron_weipipe.weight_pass import RUNTIME_WEIGHT_PASSES, WeightPass

from megatron_weipipe.schedules.ir.actions import Action, Buffer, Flow, Kind, Schedule, ScheduleError
from megatron_weipipe.schedules.ir.posts import DEFAULT_ORDER, Post, rank_posts
from .flat import FlatViews
from .trace import ActionTracer
from .wgrad import WeightGradStore, deferring


@dataclass
class IterationResult:
    losses: list  # per local microbatch, detached, in microbatch order
    main_grad: torch.Tensor  # flat fp32 summed gradient of the owned chunk
    bytes: ByteCounter
    wgrad_peak_bytes: int = 0  # most bytes the deferred weight gradients kept at once
    wgrad_deferred: int = 0  # weight GEMMs deferred from I to W


class _Port(torch.autograd.Function):
    """Hands the forward the weight buffer's values while routing the weight gradient to
    `anchor`, a (numel,)-shaped tensor without storage of its own; the graph then holds
    no reference to the forward-weight buffer."""

    @staticmethod
    def forward(ctx, anchor, flat):
        return flat.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _WeightSwap:
    """Saved-tensor hooks: weight views saved in the forward are recorded by position
    and re-materialised from whatever backward-weight buffer `flat` names at unpack."""

    def __init__(self, storage_ptr: int):
        self.ptr = storage_ptr
        self.flat: Optional[torch.Tensor] = None

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() == self.ptr:
            return (t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple):
            if self.flat is None:
                raise RuntimeError("weipipe: backward ran without a backward-weight buffer")
            offset, size, stride = packed
            return self.flat.as_strided(size, stride, offset)
        return packed


@dataclass
class _Saved:
    """What a chunk forward leaves for its backward."""

    x: Optional[torch.Tensor]  # chunk input (detached leaf); None while offloaded to the host
    pre_out: Any = None  # chunk 0: where pre_fn's output joins its graph (a GradientEdge; no storage)
    pre_dtype: Optional[torch.dtype] = None
    y: Optional[torch.Tensor] = None  # output with graph (no recompute, or after a split backward)
    rng: Any = None  # RNG state before the forward, replayed by the recompute
    swap: Optional[_WeightSwap] = None
    anchor: Optional[torch.Tensor] = None  # where the weight gradient lands
    bwd_flat: Optional[torch.Tensor] = None  # kept alive between the input and weight passes
    dy: Optional[torch.Tensor] = None
    dw: Optional[torch.Tensor] = None  # weight gradient computed early ("stored" weight pass)
    early: Optional[dict] = None  # "deferred": gradients of the weights not deferred (norms, biases)


class WeiPipeRuntime:
    """Runs one ring rank's list of a WeiPipe schedule.

    `ring_group` is the torch.distributed group of the P ring ranks (in Megatron's
    layout, the pipeline-model-parallel group); its group rank r is ring rank r and owns
    chunk r. Peers are addressed by their global rank, looked up through the group.
    """

    def __init__(
        self,
        schedule: Schedule,
        *,
        ring_group: Optional[dist.ProcessGroup],
        chunk_template: nn.Module,
        compute_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype = torch.float32,
        recompute: bool = False,
        lookahead: int = 1,
        use_tags: bool = True,
        comm_scope: Optional[Callable[[Flow], ContextManager]] = None,
        rng: Any = None,
        weight_pass: str = WeightPass.REPLAY,
        tracer: Optional[ActionTracer] = None,
        order: str = DEFAULT_ORDER,
        offload: Any = None,
        rebind: bool = False,
    ):
        """`comm_scope(flow)`, if given, is entered around every isend/irecv of that flow
        (e.g. to attribute bytes in a process-wide counter). `rng` (get_state/set_state)
        is what a recomputed forward replays; torch's generators (the platform's
        ``rng_streams()``) by default.
        `weight_pass` says how a split backward gets its weight gradient: "replay" runs
        a second autograd pass at BACKWARD_WEIGHT over the graph BACKWARD_INPUT kept
        (a true split, but it repeats the input-gradient work of the layers above each
        weight, attention included); "stored" computes input and weight gradients in
        one pass at BACKWARD_INPUT and only adds the stored result at BACKWARD_WEIGHT
        (no repeated work, the graph freed at once; the split then exists in the action
        order and message timing only); "deferred" has the layers that call
        `wgrad.deferred_linear` compute only input gradients at BACKWARD_INPUT and run
        their weight GEMMs at BACKWARD_WEIGHT (the real split, no repeated work; norms,
        biases and any other weight get their gradient at BACKWARD_INPUT).
        `tracer` (an ActionTracer) times every action of every iteration.
        `offload` (model/layer_offload.LayerInputStore), with `recompute`: each chunk's
        input waits on the host between its forward and its backward, the input of the
        next backward on this rank's list prefetched while the current one runs.
        `rebind`: a backward binds the template to the backward-weight buffer (selective recompute)."""
        if weight_pass not in RUNTIME_WEIGHT_PASSES:
            raise ValueError(f"weight_pass must be {one_of(RUNTIME_WEIGHT_PASSES)}, not {weight_pass!r}")
        self.tracer = tracer
        self.weight_pass = weight_pass
        if schedule.family != "weipipe":
            raise ScheduleError(f"{schedule.name} is not a WeiPipe schedule")
        size = dist.get_world_size(ring_group)
        if size != schedule.num_ranks:
            raise ScheduleError(
                f"schedule {schedule.name} is for a ring of {schedule.num_ranks} ranks, the ring group has {size}"
            )
        self.schedule = schedule
        self.group = ring_group
        self.ring_rank = dist.get_rank(ring_group)
        self.global_rank = [dist.get_global_rank(ring_group, r) if ring_group is not None else r
                            for r in range(size)]
        self.template = chunk_template
        self.layout = FlatViews.from_module(chunk_template)
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype
        self.recompute = recompute
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 ticks, got {lookahead}")
        self.lookahead = lookahead
        self.use_tags = use_tags
        self.comm_scope = comm_scope or (lambda flow: contextlib.nullcontext())
        self.rng = rng if rng is not None else detect_platform().rng_streams()
        self.actions = schedule.actions(self.ring_rank)
        self.steps = rank_posts(schedule, self.ring_rank, order=order, lookahead=lookahead)
        self.batch_p2p = dist.get_backend(ring_group) == "nccl"
        self.offload, self.rebind = (offload if recompute else None), rebind
        backwards = [(a.mb, a.chunk) for a in self.actions if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)]
        self.next_backward = dict(zip(backwards, backwards[1:]))

    # ------------------------------------------------------------------ public

    def run_iteration(
        self,
        master: torch.Tensor,
        microbatches: Sequence[Any],
        pre_fn: Callable[[Any], torch.Tensor],
        post_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        *,
        main_grad: Optional[torch.Tensor] = None,
        grad_ready: Optional[Callable[[int, torch.Tensor], None]] = None,
        chunk_kwargs: Optional[Callable[[Any], dict]] = None,
    ) -> IterationResult:
        """One iteration: the rank's G microbatches through all chunks, gradients home.

        `master` is the owned chunk's flat fp32 weights (read at LOAD, never written).
        `main_grad` (flat fp32, zeroed by the caller) receives the owner's gradient; one
        is allocated if None. `grad_ready(chunk, main_grad)` is called at the schedule's
        OPTIMIZER_STEP, the moment the gradient is complete (e.g. to start a
        data-parallel all-reduce early); the runtime itself never steps.
        `chunk_kwargs(mb)` gives extra keyword arguments of the template call for that
        microbatch (attention mask, rotary embedding), the same for every chunk.
        """
        if len(microbatches) != self.schedule.microbatches:
            raise ValueError(
                f"schedule {self.schedule.name} runs {self.schedule.microbatches} microbatches per rank, "
                f"got {len(microbatches)}"
            )
        if master.numel() != self.layout.numel:
            raise ValueError(f"master has {master.numel()} elements, the chunk layout has {self.layout.numel}")
        device = master.device
        if main_grad is None:
            main_grad = torch.zeros(self.layout.numel, dtype=torch.float32, device=device)
        state = _IterationState(self, master, microbatches, pre_fn, post_fn, main_grad, grad_ready, device,
                                chunk_kwargs or (lambda mb: {}))
        state.run()
        return IterationResult(losses=[state.losses[m] for m in range(len(microbatches))],
                               main_grad=main_grad, bytes=state.bytes,
                               wgrad_peak_bytes=state.wgrad.peak_bytes, wgrad_deferred=state.wgrad.deferred)


class _IterationState:
    """Buffers, saved activations and in-flight messages of one iteration."""

    def __init__(self, rt: WeiPipeRuntime, master, microbatches, pre_fn, post_fn, main_grad, grad_ready, device,
                 chunk_kwargs):
        self.rt = rt
        self.P = rt.schedule.num_ranks
        self.master = master
        self.mbs = microbatches
        self.pre_fn = pre_fn
        self.post_fn = post_fn
        self.main_grad = main_grad
        self.grad_ready = grad_ready
        self.chunk_kwargs = chunk_kwargs
        self.device = device
        self.buffers: dict[Buffer, tuple[int, torch.Tensor]] = {}  # buffer -> (chunk, tensor)
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.next_input: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.bytes = ByteCounter()
        self.posted: dict[int, tuple[list, torch.Tensor]] = {}  # RECV index -> (works, tensor)
        self.staged: dict[int, torch.Tensor] = {}  # SEND index -> tensor handed over, not yet posted
        self.sends: list = []
        # The iteration's deferred weight gradients; the split backwards defer into it.
        self.wgrad = WeightGradStore()
        self.defer = ({(a.mb, a.chunk) for a in rt.actions if a.kind is Kind.BACKWARD_WEIGHT}
                      if rt.weight_pass == WeightPass.DEFERRED else set())
        self.handlers: dict[Kind, Callable[[int, Action], None]] = {  # (list index, action) -> None
            Kind.LOAD: self._load, Kind.DROP: self._drop, Kind.GRAD_INIT: self._grad_init,
            Kind.FORWARD: self._forward, Kind.LOSS: self._loss, Kind.BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward_input, Kind.BACKWARD_WEIGHT: self._backward_weight,
            Kind.SEND: self._send, Kind.RECV: self._recv,
            Kind.ACCUMULATE_GRAD: self._accumulate_grad, Kind.OPTIMIZER_STEP: self._optimizer_step,
        }

    # -------------------------------------------------------------- driver

    def run(self) -> None:
        tick = None
        tracer = self.rt.tracer
        try:
            for step in self.rt.steps:
                if isinstance(step, Post):
                    self._post(step)
                    continue
                a = self.rt.actions[step]
                if a.tick != tick:
                    tick = a.tick
                    self._reap_sends()
                with tracer.action(a) if tracer is not None else contextlib.nullcontext():
                    self.handlers[a.kind](step, a)
        finally:
            for works, _ in self.sends:
                for work in works:
                    work.wait()
            self.sends.clear()
        leftover = {str(b): c for b, (c, _) in self.buffers.items()}
        if leftover or self.posted or self.staged:
            raise ScheduleError(f"rank {self.rt.ring_rank} ends with live buffers {leftover} or unreceived messages")
        self.wgrad.check_empty(f"rank {self.rt.ring_rank} at the end of the iteration")

    # -------------------------------------------------------------- comm

    def _message_dtype(self, a: Action) -> torch.dtype:
        return self.rt.grad_dtype if a.flow is Flow.GRADS else self.rt.compute_dtype

    def _tag(self, a: Action) -> int:
        return a.tag if self.rt.use_tags else 0

    def _post(self, post: Post) -> None:
        """Post `post.ops` in order: one isend/irecv each, or one batch_isend_irecv."""
        ops = []
        for i in post.ops:
            a = self.rt.actions[i]
            if a.kind is Kind.SEND:
                t = self.staged.pop(i)
            else:
                t = torch.empty(self.rt.layout.numel, dtype=self._message_dtype(a), device=self.device)
            ops.append((i, a, t))
        if post.batched and self.rt.batch_p2p:  # gloo: the same posts one by one (its batch never completes here)
            c10d = dist.distributed_c10d
            works = dist.batch_isend_irecv([
                dist.P2POp(c10d.isend if a.kind is Kind.SEND else c10d.irecv, t, self.rt.global_rank[a.peer],
                           self.rt.group, self._tag(a)) for _, a, t in ops])
            per_op = [works] * len(ops)
        else:
            per_op = []
            for _, a, t in ops:
                fn = dist.isend if a.kind is Kind.SEND else dist.irecv
                with self.rt.comm_scope(a.flow):
                    per_op.append([fn(t, self.rt.global_rank[a.peer], group=self.rt.group, tag=self._tag(a))])
        for (i, a, t), works in zip(ops, per_op):
            if a.kind is Kind.SEND:
                self.sends.append((works, t))
            else:
                self.posted[i] = (works, t)

    def _reap_sends(self) -> None:
        self.sends = [(w, t) for w, t in self.sends if not all(x.is_completed() for x in w)]

    def _recv(self, i: int, a: Action) -> None:
        works, t = self.posted.pop(i)  # the program posts it before this step
        for work in works:
            work.wait()
        self.bytes.count(a.flow.value, t.numel() * t.element_size(), sent=False)
        self._put(a, t)

    def _send(self, i: int, a: Action) -> None:
        chunk, t = self.buffers.pop(a.buffer)
        if chunk != a.chunk:
            raise ScheduleError(f"{a}: buffer holds chunk {chunk}")
        self.staged[i] = t  # posted by the next Post step that names it
        self.bytes.count(a.flow.value, t.numel() * t.element_size(), sent=True)

    # -------------------------------------------------------------- buffers

    def _put(self, a: Action, t: torch.Tensor) -> None:
        if a.buffer in self.buffers:
            raise ScheduleError(f"{a}: buffer {a.buffer} is still live")
        self.buffers[a.buffer] = (a.chunk, t)

    def _get(self, a: Action, buf: Buffer) -> torch.Tensor:
        chunk, t = self.buffers[buf]
        if chunk != a.chunk:
            raise ScheduleError(f"{a}: buffer {buf} holds chunk {chunk}")
        return t

    def _load(self, i: int, a: Action) -> None:
        self._put(a, self.master.detach().to(self.rt.compute_dtype, copy=True).reshape(-1))

    def _drop(self, i: int, a: Action) -> None:
        self.buffers.pop(a.buffer)

    def _grad_init(self, i: int, a: Action) -> None:
        self._put(a, torch.zeros(self.rt.layout.numel, dtype=self.rt.grad_dtype, device=self.device))

    def _accumulate_grad(self, i: int, a: Action) -> None:
        self.main_grad.add_(self._get(a, a.buffer).to(self.main_grad.dtype))
        self.buffers.pop(a.buffer)

    def _optimizer_step(self, i: int, a: Action) -> None:
        if self.grad_ready is not None:
            self.grad_ready(a.chunk, self.main_grad)

    # -------------------------------------------------------------- compute

    def _call(self, flat: torch.Tensor, x: torch.Tensor, mb: int, chunk: int) -> torch.Tensor:
        scope = (deferring(self.wgrad, (mb, chunk)) if (mb, chunk) in self.defer and torch.is_grad_enabled()
                 else contextlib.nullcontext())
        with scope:
            return functional_call(self.rt.template, self.rt.layout.views(flat), (x,),
                                   self.chunk_kwargs(self.mbs[mb]))

    def _bound(self, flat: torch.Tensor) -> ContextManager:
        """With `rebind`, the template's parameters as views of `flat` (FlatViews.bound)."""
        return self.rt.layout.bound(self.rt.template, flat) if self.rt.rebind else contextlib.nullcontext()

    def _forward(self, i: int, a: Action) -> None:
        flat = self._get(a, a.buffer)
        pre_out = None
        if a.chunk == 0:
            pre_out = self.pre_fn(self.mbs[a.mb])
            x = pre_out.detach().to(self.rt.compute_dtype)
        else:
            x = self.next_input.pop((a.mb, a.chunk))
        x.requires_grad_(True)
        saved = _Saved(x=x)
        if pre_out is not None and pre_out.requires_grad:  # the edge alone: pre_out's storage is x's or freed
            saved.pre_out, saved.pre_dtype = torch.autograd.graph.get_gradient_edge(pre_out), pre_out.dtype
        if self.rt.recompute:
            saved.rng = self.rt.rng.get_state()
            with torch.no_grad():
                y = self._call(flat, x, a.mb, a.chunk)
            if self.rt.offload is not None:
                self.rt.offload.put((a.mb, a.chunk), x)
                saved.x = None
        else:
            swap = _WeightSwap(flat.untyped_storage().data_ptr())
            anchor = torch.zeros(1, dtype=flat.dtype, device=flat.device).expand(flat.numel()).requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(swap.pack, swap.unpack):
                y = self._call(_Port.apply(anchor, flat), x, a.mb, a.chunk)
            saved.y, saved.swap, saved.anchor = y, swap, anchor
        self.saved[(a.mb, a.chunk)] = saved
        self.next_input[(a.mb, a.chunk + 1)] = y.detach()

    def _loss(self, i: int, a: Action) -> None:
        h = self.next_input.pop((a.mb, self.P)).requires_grad_(True)
        loss = self.post_fn(h, self.mbs[a.mb])
        loss.backward()
        self.losses[a.mb] = loss.detach()
        self.saved[(a.mb, self.P - 1)].dy = h.grad

    def _backward(self, i: int, a: Action) -> None:
        self._input_pass(a, weight_too=True)

    def _backward_input(self, i: int, a: Action) -> None:
        self._input_pass(a, weight_too=False)

    def _input_pass(self, a: Action, weight_too: bool) -> None:
        s = self.saved[(a.mb, a.chunk)]
        bwd = self._get(a, a.buffer)
        if s.x is None:  # on the host since the forward; start bringing the next backward's input too
            s.x = self.rt.offload.take((a.mb, a.chunk)).requires_grad_(True)
            if (a.mb, a.chunk) in self.rt.next_backward:
                self.rt.offload.prefetch(self.rt.next_backward[(a.mb, a.chunk)])
        if self.rt.recompute:
            s.anchor = bwd.detach().requires_grad_(True)
            outer = self.rt.rng.get_state()
            self.rt.rng.set_state(s.rng)  # same dropout masks as the forward
            try:
                with torch.enable_grad():
                    s.y = self._call(s.anchor, s.x, a.mb, a.chunk)
            finally:
                self.rt.rng.set_state(outer)
        else:
            s.swap.flat = bwd
        s.bwd_flat = bwd
        want_x = a.chunk > 0 or s.pre_out is not None
        split_now = not weight_too and self.rt.weight_pass in (WeightPass.STORED, WeightPass.DEFERRED)
        both = weight_too or split_now
        inputs = ([s.x] if want_x else []) + ([s.anchor] if both else [])
        with self._bound(bwd):
            grads = torch.autograd.grad(s.y, inputs, s.dy, retain_graph=not both, allow_unused=True) if inputs else ()
        if want_x:
            self._pass_down(a, s, grads[0])
        if weight_too:
            self._add_weight_grad(a, grads[-1])
            del self.saved[(a.mb, a.chunk)]
        elif split_now:
            dw = grads[-1] if grads[-1] is not None else torch.zeros_like(s.anchor)
            if self.rt.weight_pass == WeightPass.DEFERRED:
                # Keep only the gradients of weights not deferred (norms, biases): small.
                deferred = self.wgrad.names((a.mb, a.chunk))
                s.early = {p.name: dw[p.offset:p.offset + p.numel].clone()
                           for p in self.rt.layout.params if p.name not in deferred}
            else:
                s.dw = dw
            s.x = s.y = s.dy = s.anchor = s.bwd_flat = s.swap = None  # graph and weights freed now

    def _backward_weight(self, i: int, a: Action) -> None:
        s = self.saved.pop((a.mb, a.chunk))
        if s.early is not None:  # "deferred": the weight GEMMs run now
            views = self.rt.layout.views(self._get(a, a.grad))
            dtype = self.rt.grad_dtype

            def add(name: str, g: torch.Tensor) -> None:
                views[name].add_(g.reshape(views[name].shape).to(dtype))

            for name, g in s.early.items():
                add(name, g)
            self.wgrad.flush((a.mb, a.chunk), add)
            return
        with self._bound(s.bwd_flat):
            dw = s.dw if s.dw is not None else torch.autograd.grad(s.y, [s.anchor], s.dy)[0]
        self._add_weight_grad(a, dw)

    def _pass_down(self, a: Action, s: _Saved, dx: torch.Tensor) -> None:
        if a.chunk > 0:
            self.saved[(a.mb, a.chunk - 1)].dy = dx
        else:
            torch.autograd.backward(s.pre_out, grad_tensors=dx.to(s.pre_dtype))

    def _add_weight_grad(self, a: Action, dw: torch.Tensor) -> None:
        self._get(a, a.grad).add_(dw.reshape(-1).to(self.rt.grad_dtype))

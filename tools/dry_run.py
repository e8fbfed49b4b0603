#!/usr/bin/env python
"""One real training iteration of one rank, without memory or compute: the bytes it needs.

    python -m tools.dry_run <pretrain_gpt.py flags> --world-size N [--rank R] [--json]

Rank R's real program runs once (after one optimizer step that creates Adam's state, so
the peak is that of every later iteration): its model stage, schedule (WeiPipe runtime, megatron-core
1F1B, FPDT chunks and offload), a forward/backward over its microbatches and the
optimizer step, with every tensor a FakeTensor on the CPU (shapes and dtypes, no
storage, no arithmetic) and torch's fake process group (collectives and messages return
at once). Every tensor storage the program creates is followed from allocation to
release; the peak of the live bytes that would sit on the accelerator is reported by
role: parameters, gradients (main grads and .grad), optimizer state (fp32 master copies
and Adam moments), communication buffers (WeiPipe's circulating weight / gradient
tokens and their receive buffers), FPDT chunk state brought to the device, and
activations (everything else). Host bytes are the storages offload code marks with
megatron_weipipe.residency.host_buffer (FPDT's host buffer pools, layer-input offload).
Sent bytes are the byte counter's exact point-to-point and collective payloads.
Data are synthetic tokens of the configured shape (no corpus is read). A value read
back to Python (.item(): finiteness checks, loss reporting) reads 1 / True; the
optimizer step skips the gradient-norm read and clipping.

With --json, stdout holds one JSON object: peak_accelerator_bytes, host_bytes,
sent_bytes (integers), categories (role -> bytes at the peak), category_peaks (each
role's own peak, what the estimator gives per role) and estimator (the
simulator's memory estimator and byte model for the same run, same keys). Under
--rampup-batch-size or --step-batch-size-schedule the iteration is one at the final batch
size, the largest (final_batch_note says so, and the printed line). Bad flags
exit 2. The core attention is the model's own (`--attention-backend`; `auto` is torch's
fused kernel, which keeps no s x s probabilities, as flash attention on a GPU; `unfused`
keeps them). `--attention flash|local` is shorthand for `--attention-backend flash|unfused`.

`--platform cuda` counts what a CUDA host without Transformer Engine builds (the layers
WeiPipe always builds on a GPU): the model is built for ``Platform("cuda", "nccl",
transformer_engine=False)`` (megatron-core's local layers with ``CudaSDPACoreAttention``,
GPU-only fusions' decisions, no fused masked softmax) while its tensors stay fake CPU
tensors; torch.compile'd fusions run eagerly (same tensors, no compiled graph). The
default, `--platform host`, builds for this host. TE's own layers cannot be built here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
import weakref
from dataclasses import replace
from functools import partial

warnings.filterwarnings("ignore")

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers",
              "fpdt_chunk_state")


class Ledger:
    """Live bytes per role, by storage; a storage's role is the innermost scope at its
    allocation, or what `assign` later says it is."""

    def __init__(self):
        self.scopes: list[str] = []
        self.live: dict[int, list] = {}  # id(storage) -> [role, nbytes, weakref]
        self.by_role = {c: 0 for c in CATEGORIES + ("host",)}
        self.peak = 0
        self.peak_roles = dict(self.by_role)
        self.host_peak = 0
        self.role_peaks = dict(self.by_role)
        self._last = None
        self.explain = False  # --explain: remember shapes, list the largest storages at the peak
        self.at_peak: list = []
        self.at_activation_peak: list = []

    @contextlib.contextmanager
    def scope(self, role: str):
        self.scopes.append(role)
        try:
            yield
        finally:
            self.scopes.pop()

    def note(self, t) -> None:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP): this rank's shard
        st = t.untyped_storage()
        key = id(st)
        if key in self.live and self.live[key][2]() is st:
            return
        role = self.scopes[-1] if self.scopes else "activations"
        n = int(st.nbytes())
        self.live[key] = [role, n, weakref.ref(st, lambda _r, k=key: self._free(k))]
        if self.explain:
            self.live[key].append((tuple(t.shape), str(t.dtype)[6:]))
        self._last = (key, self.peak, dict(self.peak_roles), dict(self.role_peaks))
        self.by_role[role] += n
        self._check()

    def to_host(self, t) -> None:
        """residency.host_buffer's observer: the storage just made is host memory (its
        allocation, noted a moment ago as accelerator bytes, does not count at the peak)."""
        key = id(t.untyped_storage())
        if self._last is not None and self._last[0] == key:
            _, self.peak, self.peak_roles, self.role_peaks = self._last
        self.assign([t], "host")

    def _free(self, key) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.by_role[entry[0]] -= entry[1]

    def resize(self, storage, nbytes: int) -> None:
        """A storage resized in place (FSDP frees and re-allocates gathered weights so)."""
        entry = self.live.get(id(storage))
        if entry is not None:
            self.by_role[entry[0]] += nbytes - entry[1]
            entry[1] = nbytes
            self._check()

    def assign(self, tensors, role: str) -> None:
        for t in tensors:
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP's DTensors: the shard this rank holds
            st = t.untyped_storage()
            entry = self.live.get(id(st))
            if entry is None or entry[2]() is not st:
                self.note(t)
                entry = self.live[id(st)]
            if entry[0] == "host" and role != "host":
                continue  # where a storage lives is not a role: host memory stays host memory
            self.by_role[entry[0]] -= entry[1]
            entry[0] = role
            self.by_role[role] += entry[1]
        self._check()

    def reset_peaks(self) -> None:
        """Peaks from here on: the measured iteration, not the model's construction (whose
        parameters and buffers count as activations until they are assigned their roles)."""
        self.peak = sum(v for k, v in self.by_role.items() if k != "host")
        self.peak_roles, self.role_peaks = dict(self.by_role), dict(self.by_role)
        self.host_peak = self.by_role["host"]
        self._last = None
        self.at_peak = self.at_activation_peak = []

    def _check(self) -> None:
        device = sum(v for k, v in self.by_role.items() if k != "host")
        if device > self.peak:
            self.peak, self.peak_roles = device, dict(self.by_role)
            if self.explain:
                self.at_peak = [list(e) for e in self.live.values() if e[0] != "host"]
        self.host_peak = max(self.host_peak, self.by_role["host"])
        for k, v in self.by_role.items():
            if v > self.role_peaks[k]:
                self.role_peaks[k] = v
                if self.explain and k == "activations":
                    self.at_activation_peak = [list(e) for e in self.live.values() if e[0] == k]


def _tracking_mode(ledger: Ledger):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:  # .item(): values do not exist here
                dtype = args[0].dtype
                return True if dtype is torch.bool else (1.0 if dtype.is_floating_point else 1)
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ledger.note(t)
            return out

    return Track()


def _patch_scopes(ledger: Ledger):
    """Roles the program's own structure gives: WeiPipe ring buffers, FPDT chunk state."""
    import torch

    from megatron_weipipe.fpdt import offload
    from megatron_weipipe.schedules.runtime import ring

    def scoped(cls, name, role):
        original = getattr(cls, name)

        def inner(*a, **k):
            with ledger.scope(role(a[0]) if callable(role) else role):
                return original(*a, **k)

        setattr(cls, name, inner)

    # The runtime finds saved weight views by storage address; fake storages all have
    # address 0, so find them by storage identity instead (same views, same bytes).
    current = {}

    class SwapByStorage(ring._WeightSwap):
        def __init__(self, ptr):
            super().__init__(ptr)
            self.key = current["flat"]

        def pack(self, t):
            if t.untyped_storage()._cdata == self.key:
                return (t.storage_offset(), tuple(t.size()), tuple(t.stride()))
            return t

    ring._WeightSwap = SwapByStorage
    forward = ring._IterationState._forward

    def tracked_forward(self, i, a):
        current["flat"] = self._get(a, a.buffer).untyped_storage()._cdata
        return forward(self, i, a)

    ring._IterationState._forward = tracked_forward
    for name in ("_post", "_load", "_grad_init"):
        scoped(ring._IterationState, name, "communication_buffers")

    def reap(self):  # the fake group's works never say they completed; a real isend has by the next tick
        self.sends = []

    ring._IterationState._reap_sends = reap
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    for name in ("unshard", "wait_for_unshard"):  # FSDP's all-gathered weights (in the compute dtype)
        scoped(_fsdp_param_group.FSDPParamGroup, name, "parameters")
    resize = torch.UntypedStorage.resize_

    def resized(storage, nbytes):  # storages freed and refilled in place: FSDP's gathered weights,
        out = resize(storage, nbytes)  # megatron-core's (selective) layernorm recompute
        ledger.resize(storage, int(nbytes))
        return out

    torch.UntypedStorage.resize_ = resized
    # no values to copy; a fake storage's copy_ would keep both storages alive (torch 2.13)
    torch.UntypedStorage.copy_ = lambda storage, src, non_blocking=False: storage
    init = ring._IterationState.__init__

    def state_init(self, rt, master, microbatches, pre_fn, post_fn, main_grad, *rest):
        ledger.assign([master, main_grad], "communication_buffers")  # the runtime's flat fp32 copies
        init(self, rt, master, microbatches, pre_fn, post_fn, main_grad, *rest)

    ring._IterationState.__init__ = state_init
    for name in ("prefetch", "get"):  # a store says what its device copies are (layer inputs: activations)
        scoped(offload.ChunkStore, name, lambda store: store.role)


def _local_object_collectives(dist) -> None:
    """Object collectives pickle through real tensors; in a dry run every rank is this one."""
    def all_gather_object(out, obj, group=None):
        for i in range(len(out)):
            out[i] = obj

    dist.all_gather_object = all_gather_object
    dist.broadcast_object_list = lambda objs, *a, **k: None

    class _Handle:  # fake tensors have no coalesced collectives: each runs on its own
        works: list = []

        def wait(self):
            pass

    @contextlib.contextmanager
    def coalescing(*a, **k):
        yield _Handle()

    from megatron.core.distributed import param_and_grad_buffer

    param_and_grad_buffer._coalescing_manager = coalescing


def _quiet_rng() -> None:
    """megatron-core's RNG tracker compares CPU RNG states by value around each fork; a dry
    run has no values (and its dropout masks need none)."""
    from megatron.core.tensor_parallel import random as mr

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    mr.CudaRNGStatesTracker.fork = fork


def _synthetic_batches(cfg, n: int, vocab: int):
    import torch

    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    out = []
    for _ in range(n):
        tokens = torch.zeros(b, s, dtype=torch.long)
        out.append({"tokens": tokens, "labels": tokens.clone(), "loss_mask": torch.ones(b, s),
                    "position_ids": torch.arange(s).expand(b, s).clone()})
    return out


def _layers_platform(name: str):
    """The Platform the model is built for: this host's, or a CUDA host's without TE."""
    from megatron_weipipe.platform import Platform, detect_platform

    if name == "cuda":
        return Platform("cuda", "nccl", transformer_engine=False, fused_softmax=False)
    return detect_platform()


def _model_provider(platform, cfg, vocab_size, pre_process=True, post_process=True, vp_stage=None):
    """pretrain_gpt.py's model_provider, for ``platform``."""
    from megatron_weipipe.model.gpt import build_gpt_model

    return build_gpt_model(cfg, vocab_size, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                           platform=platform)


def dry_run(argv, world_size: int, rank: int, explain: bool = False, platform: str = "host") -> dict:
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), str(rank)
    os.environ.setdefault("LOCAL_RANK", "0")
    from megatron_weipipe.arguments import parse_config

    cfg = parse_config(argv, world_size)
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_weipipe.initialize import initialize_distributed
    from megatron_weipipe.simulator.report import final_batch_note
    from megatron_weipipe.data.tokenizers import build_tokenizer
    from megatron_weipipe.shape import padded_vocab_size
    from megatron_weipipe.schedules import registry
    from megatron_weipipe.training.optimizer import build_optimizer
    import pretrain_gpt

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _local_object_collectives(dist)
    swap = torch.utils.swap_tensors

    def swap_or_set(t1, t2):  # module.to(bf16) swaps fake parameters, which the fake mode holds weakly
        try:
            swap(t1, t2)
        except RuntimeError:
            t1.data = t2.detach()

    torch.utils.swap_tensors = swap_or_set
    _quiet_rng()
    ctx = initialize_distributed(cfg)
    ledger = Ledger()
    ledger.explain = explain
    _patch_scopes(ledger)
    tokenizer = build_tokenizer(cfg.data)
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, ctx.groups.tp_size)
    started = time.time()
    from megatron_weipipe import residency

    layers_platform = _layers_platform(platform)
    if layers_platform.is_cuda:
        import torch._dynamo

        torch._dynamo.config.disable = True  # megatron-core's torch.compile'd fusions: eager on fake tensors

    with FakeTensorMode(allow_non_fake_inputs=True), _tracking_mode(ledger), residency.observing(ledger.to_host):
        schedule = registry.train_class(cfg.schedule_name)(cfg, ctx)
        provider = partial(_model_provider, layers_platform) if platform == "cuda" else pretrain_gpt.model_provider
        chunks = schedule.build_model(partial(provider, cfg, vocab))
        params = [p for m in chunks for p in m.parameters()]
        ledger.assign(params, "parameters")
        ledger.assign([getattr(p, "main_grad", None) for p in params], "gradients")
        if cfg.parallel.use_torch_fsdp2:  # FSDP's gradients exist after a backward only: Adam's state needs them
            for p in params:
                p.grad = torch.zeros_like(p)
        with ledger.scope("optimizer_state"):
            optimizer = build_optimizer(cfg, chunks)
            optimizer.prepare_grads()
            optimizer.step_with_ready_grads()  # Adam's moments exist from the first step on: steady state
        _, _, n_mb = schedule.data_shard()
        batches = _synthetic_batches(cfg, n_mb, vocab)
        ctx.bytes.reset()
        schedule.zero_grad()
        optimizer.zero_grad()
        ledger.reset_peaks()
        schedule.forward_backward(pretrain_gpt_forward_step(), batches)
        ledger.assign([p.grad for p in params], "gradients")
        with ledger.scope("optimizer_state"):
            optimizer.prepare_grads()
            optimizer.step_with_ready_grads()
    sent = sum(ctx.bytes.sent.values())
    if explain:
        _explain(ledger)
    estimated = estimate(cfg, ctx.groups.pp_rank, tokenizer.vocab_size, layers_platform)
    roles = {c: int(ledger.peak_roles[c]) for c in CATEGORIES}
    return {"rank": rank, "world_size": world_size, "schedule": cfg.schedule_name, "platform": platform,
            "peak_accelerator_bytes": int(ledger.peak), "host_bytes": int(ledger.host_peak),
            "sent_bytes": int(sent), "categories": roles, "seconds": round(time.time() - started, 1),
            "category_peaks": {c: int(ledger.role_peaks[c]) for c in CATEGORIES}, "estimator": estimated,
            # one iteration at the final batch size of a --rampup-batch-size / --step-batch-size-schedule
            "final_batch_note": final_batch_note(cfg)}


def _explain(ledger: Ledger) -> None:
    """--explain: the storages live at the accelerator peak, grouped by role, shape, dtype."""
    for title, entries in (("the accelerator peak", ledger.at_peak),
                           ("the activations' own peak", ledger.at_activation_peak)):
        groups: dict = {}
        for role, n, _ref, (shape, dtype) in entries:
            g = groups.setdefault((role, shape, dtype), [0, 0])
            g[0] += 1
            g[1] += n
        print(f"live at {title} ({sum(g[1] for g in groups.values())} bytes):", file=sys.stderr)
        for (role, shape, dtype), (count, n) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"  {n:>16} {count:>5} x {role:<22} {dtype:<9} {list(shape)}", file=sys.stderr)


def estimate(cfg, pp_rank: int, vocab: int, platform=None) -> dict:
    """The simulator's memory estimator and byte model for the same run and pipeline rank,
    in the dry run's roles (megatron-core's local layers, with the core attention the
    platform resolves --attention-backend to: flash mode for torch's fused SDPA)."""
    from megatron_weipipe.simulator.fpdt import analyse
    from megatron_weipipe.simulator.hardware import HOST_LINKS, Cluster, device_preset, link_preset
    from megatron_weipipe.simulator.project import counter_bytes, rank_memory, state_split
    from megatron_weipipe.simulator.run_spec import spec_from_config

    cfg = replace(cfg, data=replace(cfg.data, vocab_size=vocab))  # the tokenizer's ids, before padding
    from megatron_weipipe.model.sdpa_attention import SDPA_BACKENDS, requested_backend
    from megatron_weipipe.platform import detect_platform

    fused = (platform or detect_platform()).attention_backend(requested_backend(cfg)) in SDPA_BACKENDS
    spec = spec_from_config(cfg, attention_impl="unfused+flash" if fused else "unfused")
    schedule = spec.build_schedule()
    fp = None
    if spec.fpdt is not None:
        cluster = Cluster(device_preset("a100"), link_preset("nvlink3"), link_preset("ib"), host_link=HOST_LINKS["pcie4"])
        fp = analyse(spec.shape, spec.fpdt, cluster, cp=spec.layout.cp, tp=spec.layout.tp,
                     dtype_bytes=spec.compute_bytes)
    mem = rank_memory(spec, schedule, fp)[pp_rank]
    split = state_split(spec)  # on the device by role, and on the host (--optimizer-cpu-offload)
    roles = {
        "parameters": mem.params * split.parameters + mem.gathered,
        "gradients": mem.params * split.gradients,
        "optimizer_state": mem.params * split.optimizer_state,
        "activations": mem.activations + mem.transient,
        "communication_buffers": mem.buffers,
        "fpdt_chunk_state": mem.chunk_state,
    }
    roles = {k: int(v) for k, v in roles.items()}
    return {"peak_accelerator_bytes": int(mem.total + mem.chunk_state), "categories": roles,
            "host_bytes": int(mem.host),
            "sent_bytes": int(sum(counter_bytes(spec, schedule)[pp_rank].values()))}


def pretrain_gpt_forward_step():
    from megatron_weipipe.model.gpt_step import forward_step

    return forward_step


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from megatron_weipipe.flags import FlagParser

    ap = FlagParser(add_help=False)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--attention", choices=("local", "flash"), default=None)
    ap.add_argument("--explain", action="store_true")
    ap.add_argument("--platform", choices=("host", "cuda"), default="host")
    own, rest = ap.parse_known_args(argv)
    if own.attention is not None:
        rest += ["--attention-backend", "flash" if own.attention == "flash" else "unfused"]
    if own.world_size < 1 or not 0 <= own.rank < own.world_size:
        print(f"dry_run: --rank must be in 0..{own.world_size - 1} and --world-size >= 1", file=sys.stderr)
        return 2
    from megatron_weipipe.config import ConfigError

    try:
        with contextlib.redirect_stdout(sys.stderr):  # the program's own prints stay off stdout
            out = dry_run(rest, own.world_size, own.rank, own.explain, own.platform)
    except ConfigError as e:
        print(f"dry_run: {e}", file=sys.stderr)
        return 2
    if own.json:
        print(json.dumps(out))
        return 0
    print(f"dry run of rank {own.rank} of {own.world_size} ({out['schedule']}, layers for {own.platform}), "
          f"{out['seconds']} s{out['final_batch_note']}:")
    est = out["estimator"]
    print("| role | at the peak (bytes) | at the peak | own peak | estimator | estimator / own peak |\n"
          "|---|---|---|---|---|---|")
    rows = [(c, out["categories"][c], out["category_peaks"][c], est["categories"][c]) for c in CATEGORIES]
    rows += [(name, out[key], out[key], est[key]) for name, key in (
        ("**accelerator peak**", "peak_accelerator_bytes"), ("host (offload)", "host_bytes"),
        ("sent per iteration", "sent_bytes"))]
    for name, got, own, want in rows:
        ratio = f"{want / own:.3f}" if own else ("-" if not want else "inf")
        print(f"| {name} | {got} | {_gib(got)} | {_gib(own)} | {_gib(want)} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

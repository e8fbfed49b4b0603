"""FPDT chunked Ulysses self-attention, and plain Ulysses attention from the same pieces.

Inputs follow Megatron: hidden states [s_local, b, hidden] in the FPDT token layout
(fpdt.token_layout), linear_qkv weight [groups*(heads_per_group+2)*head_dim, hidden] whose
output is, per query group, [q heads of the group..., k, v] (exactly Megatron's
get_query_key_value_tensors split, so checkpoints load unchanged), linear_proj weight
[hidden, heads*head_dim]. With tensor parallelism these are the TP-local shards and the
result is summed over the TP group (row-parallel output, no sequence parallelism).

FPDT forward, chunk i of u (FPDT.md steps 2-3): project local chunk i, one all-to-all of
the mixed q|k|v (split along query groups, so each rank receives whole groups; with
fewer KV heads than ranks, spread_kv gives each rank a share of one group's query heads
and the group's k, v), rotary
with global positions [iC, (i+1)C), attention of q_i against k_j, v_j for j <= i (causal
mask on j = i only), online-softmax merge in the accumulation dtype, reverse all-to-all,
output projection. The next chunk's all-to-all is in flight while this chunk computes.

Backward (step 4): do of every chunk first (proj backward + all-to-all), then KV chunks
in the outer loop and query chunks q >= i in the inner loop streaming q, o, lse, do, dq;
dk/dv accumulate on the device, dq in the store (host memory with offload); when the
inner loop ends dq_i, dk_i, dv_i are complete and go through the rotary backward, the
reverse all-to-all, and the linear_qkv weight/input gradients from the saved input X_i.

Weight gradients are this rank's share (its tokens): summing over the context-parallel
group is the data-parallel reducer's job, as in Megatron (dp x cp gradient reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_weipipe.fpdt.config import AttentionSpec, FPDTConfig
from megatron_weipipe.fpdt.documents import CAUSAL, FULL, SKIP, Documents, as_documents
from megatron_weipipe.fpdt.kernels import acc_dtype, accumulate_matmul, merge, select_kernel
from megatron_weipipe.fpdt.offload import ChunkStore, HostBufferPool, OffloadStats
from megatron_weipipe.fpdt.packed import DEFAULT_TILE, DocumentAttention, block_backward, block_forward
from megatron_weipipe.fpdt.rotary import RotaryTable, apply_rotary_backward, rotary, apply_rotary
from megatron_weipipe.fpdt.tp import all_reduce_, copy_to_tp, reduce_from_tp
from megatron_weipipe.fpdt.ulysses import (
    CommCounter,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    gather_kv,
    group_size,
    heads_to_seq_async,
    seq_to_heads_async,
    spread_kv,
)


@dataclass
class _Plan:
    """Non-tensor arguments of one FPDT attention call."""

    spec: AttentionSpec
    cp_group: Any
    tp_group: Any
    num_chunks: int
    kernel: Any
    offload: bool
    overlap: bool
    pool: HostBufferPool | None
    stats: OffloadStats | None
    counter: CommCounter | None
    save: bool = True  # False under no_grad / inference: keep only what the forward needs
    docs: Documents | None = None  # packed documents: block masks and skipped chunk pairs
    replicas: int = 1  # ranks sharing each KV head (spec.kv_replicas): spread_kv / gather_kv around the all-to-all

    def kind(self, qi: int, kj: int, C: int, count: bool = False) -> str:
        """How chunk pair (query chunk qi, KV chunk kj <= qi) is computed (fpdt.documents)."""
        if self.docs is None:
            return CAUSAL if qi == kj else FULL
        kind = self.docs.classify(qi * C, (qi + 1) * C, kj * C, (kj + 1) * C)
        if count:
            self.docs.counts[kind] += 1
        return kind


def _table(spec: AttentionSpec, start: int, length: int, dtype, device):
    if spec.rotary is None:
        return None
    return RotaryTable(spec.rotary, spec.head_dim, start, length, dtype, device)


def _split_heads(mixed_h: torch.Tensor, g: int, d: int):
    """[S, b, groups_local, (g+2)d] -> q [b, hq_local, S, d], k, v [b, groups_local, S, d]
    (g: query heads per KV head in the received slabs, spread_kv's g/R)."""
    S, b, ngl = mixed_h.shape[:3]
    q, k, v = mixed_h.split([g * d, d, d], dim=-1)
    q = q.reshape(S, b, ngl * g, d)
    return tuple(t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))


def _join_heads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dtype):
    """Inverse of _split_heads for gradients: -> [S, b, groups_local, (g+2)d]."""
    b, hql, S, d = dq.shape
    ngl = dk.shape[1]
    dq = dq.permute(2, 0, 1, 3).reshape(S, b, ngl, hql // ngl * d)
    dk = dk.permute(2, 0, 1, 3)
    dv = dv.permute(2, 0, 1, 3)
    return torch.cat([dq.to(dtype), dk.to(dtype), dv.to(dtype)], dim=-1)


def _add(acc, blk, dtype):
    """Running sum that leaves a single contribution untouched (u = 1 costs no cast)."""
    if acc is None:
        return blk
    return acc.to(dtype) + blk.to(dtype)


class FPDTAttentionFunction(torch.autograd.Function):
    """Explicit forward/backward over the chunk pipeline (no autograd graph inside)."""

    @staticmethod
    def forward(ctx, x, w_qkv, b_qkv, w_proj, b_proj, plan: _Plan):
        spec, group, u = plan.spec, plan.cp_group, plan.num_chunks
        P = group_size(group)
        s_l, b, _ = x.shape
        L = s_l // u  # local tokens per chunk (C / P)
        C = L * P
        acc = acc_dtype(x.dtype)
        ng, g, d = spec.groups, spec.heads_per_group, spec.head_dim
        store = ChunkStore(x.device, plan.offload, plan.pool, stats=plan.stats)
        kern, scale = plan.kernel, spec.scale

        def launch(i):
            mixed = F.linear(x[i * L : (i + 1) * L], w_qkv, b_qkv).view(L, b, ng, (g + 2) * d)
            return seq_to_heads_async(spread_kv(mixed, plan.replicas, d), group, plan.counter)

        out = torch.empty(s_l, b, w_proj.shape[0], dtype=x.dtype, device=x.device)
        olocal_pending = None

        def finish_o(item):
            j, pend = item
            o_local = pend.wait().reshape(L, b, -1)
            if plan.save:
                store.put("olocal", j, o=o_local)
            torch.matmul(o_local, w_proj.t(), out=out[j * L : (j + 1) * L])

        pending = launch(0)
        for i in range(u):
            mixed_h = pending.wait()
            if i + 1 < u and plan.overlap:
                pending = launch(i + 1)
            q, k, v = _split_heads(mixed_h, g // plan.replicas, d)
            del mixed_h
            table = _table(spec, i * C, C, q.dtype, q.device)
            if table is not None:
                q, k = apply_rotary(q, table), apply_rotary(k, table)
            if plan.offload and plan.save:
                store.put("x", i, x=x[i * L : (i + 1) * L])
            store.put("kv", i, k=k, v=v)
            kinds = {j: plan.kind(i, j, C, count=True) for j in range(i)}
            earlier = [j for j in range(i) if kinds[j] != SKIP]  # chunk pairs no document spans: no compute, no fetch
            if earlier:
                store.prefetch("kv", earlier[0])
            rng = (i * C, (i + 1) * C)
            o, lse = block_forward(kern, q, k, v, plan.kind(i, i, C, count=True), plan.docs, rng + rng, scale)
            if earlier:
                o = o.to(acc)
                for n, j in enumerate(earlier):
                    if n + 1 < len(earlier):
                        store.prefetch("kv", earlier[n + 1])
                    kv = store.get("kv", j)
                    o_b, l_b = block_forward(kern, q, kv["k"], kv["v"], kinds[j], plan.docs, rng + (j * C, (j + 1) * C), scale)
                    o, lse = merge(o, lse, o_b, l_b)
                    del kv
                    store.release("kv", j)
                o = o.to(x.dtype)
            if plan.save:
                store.put("q", i, q=q, o=o, lse=lse)
            del k, v
            if olocal_pending is not None:
                finish_o(olocal_pending)
            olocal_pending = (i, heads_to_seq_async(o.permute(2, 0, 1, 3), group, plan.counter))
            if not plan.overlap:
                finish_o(olocal_pending)
                olocal_pending = None
                if i + 1 < u:
                    pending = launch(i + 1)
            del q, o, lse
        if olocal_pending is not None:
            finish_o(olocal_pending)
        all_reduce_(out, plan.tp_group)
        if b_proj is not None:
            out += b_proj
        if not plan.save:
            store.close()
            return out

        ctx.plan, ctx.store = plan, store
        ctx.shape = (s_l, b, L, C)
        ctx.save_for_backward(None if plan.offload else x, w_qkv, b_qkv, w_proj, b_proj)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w_qkv, b_qkv, w_proj, b_proj = ctx.saved_tensors
        need = ctx.needs_input_grad[:5]
        bwd = _Backward(ctx.plan, ctx.store, ctx.shape, x, w_qkv, b_qkv, w_proj, need, dout)
        dout = dout.contiguous()
        dw_proj = bwd.output_projection(dout)
        db_proj = dout.sum(dim=(0, 1)) if (b_proj is not None and need[4]) else None
        dx, dw_qkv, db_qkv = bwd.qkv_projection()
        bwd.store.close()
        ctx.store = None
        if dx is not None:
            all_reduce_(dx, ctx.plan.tp_group)

        def cast(t, like):
            return None if t is None else t.to(like.dtype)

        return (
            dx,
            cast(dw_qkv, w_qkv),
            cast(db_qkv, b_qkv) if b_qkv is not None else None,
            cast(dw_proj, w_proj),
            cast(db_proj, b_proj) if b_proj is not None else None,
            None,
        )


class _Backward:
    """The attention backward in two phases over the chunk store: the output projection
    (and ``do`` of every chunk in head layout), then KV chunks outer, query chunks inner."""

    def __init__(self, plan: _Plan, store: ChunkStore, shape, x, w_qkv, b_qkv, w_proj, need, dout):
        self.plan, self.store, self.spec = plan, store, plan.spec
        self.group, self.u = plan.cp_group, plan.num_chunks
        self.s_l, self.b, self.L, self.C = shape
        self.x, self.w_qkv, self.b_qkv, self.w_proj = x, w_qkv, b_qkv, w_proj
        self.need_x, self.need_wq, self.need_bq, self.need_wp, _ = need
        self.dtype, self.device, self.acc = dout.dtype, dout.device, acc_dtype(dout.dtype)

    def output_projection(self, dout):
        """Phase 1: the projection's weight gradient; ``do`` of each chunk into the store."""
        plan, store, L, b, u = self.plan, self.store, self.L, self.b, self.u
        dw_proj = None
        pend = None

        def finish_do(item):
            j, p = item
            store.put("q", j, do=p.wait().permute(1, 2, 0, 3).contiguous())

        for j in range(u):
            dy = dout[j * L : (j + 1) * L]
            if self.need_wp:
                if j + 1 < u:
                    store.prefetch("olocal", j + 1)
                ol = store.get("olocal", j)["o"]
                dw_proj = accumulate_matmul(dw_proj, dy.flatten(0, 1).t(), ol.flatten(0, 1))
                del ol
            store.drop("olocal", j)
            d_ol = torch.matmul(dy, self.w_proj).view(L, b, self.spec.num_heads, self.spec.head_dim)
            if pend is not None:
                finish_do(pend)
            pend = (j, seq_to_heads_async(d_ol, self.group, plan.counter))
            if not plan.overlap:
                finish_do(pend)
                pend = None
        if pend is not None:
            finish_do(pend)
        return dw_proj

    def qkv_projection(self):
        """Phase 2: each KV chunk's q/k/v gradients, back through the QKV projection."""
        plan, L, b = self.plan, self.L, self.b
        dx = torch.empty(self.s_l, b, self.w_qkv.shape[1], dtype=self.dtype, device=self.device) if self.need_x else None
        grads = {"dw_qkv": None, "db_qkv": None}
        pend = None

        def finish_qkv(item):
            i, p = item
            dm = gather_kv(p.wait(), plan.replicas, self.spec.head_dim).reshape(L, b, -1)
            if self.need_x:
                torch.matmul(dm, self.w_qkv, out=dx[i * L : (i + 1) * L])
            if self.need_wq:
                xi = self.store.get("x", i)["x"] if plan.offload else self.x[i * L : (i + 1) * L]
                grads["dw_qkv"] = accumulate_matmul(grads["dw_qkv"], dm.flatten(0, 1).t(), xi.flatten(0, 1))
                del xi
            if self.b_qkv is not None and self.need_bq:
                grads["db_qkv"] = _add(grads["db_qkv"], dm.sum(dim=(0, 1)), self.acc)
            self.store.drop("x", i)

        for i in range(self.u):
            d_mixed = self.kv_chunk(i)
            if pend is not None:
                finish_qkv(pend)
            pend = (i, heads_to_seq_async(d_mixed, self.group, plan.counter))
            del d_mixed
            if not plan.overlap:
                finish_qkv(pend)
                pend = None
        if pend is not None:
            finish_qkv(pend)
        return dx, grads["dw_qkv"], grads["db_qkv"]

    def kv_chunk(self, i: int) -> torch.Tensor:
        """KV chunk ``i`` against every later query chunk: its dk, dv and the finished dq of
        query chunk ``i``, in the mixed QKV layout."""
        plan, store, spec, u, C, acc = self.plan, self.store, self.spec, self.u, self.C, self.acc
        if plan.offload and self.need_wq:
            store.prefetch("x", i)
        kv = store.get("kv", i)
        dk = dv = dq_i = None
        later = [qi for qi in range(i, u) if plan.kind(qi, i, C) != SKIP]  # always holds i
        store.prefetch("q", i)
        for n, qi in enumerate(later):
            if n + 1 < len(later):
                store.prefetch("q", later[n + 1])
            elif i + 1 < u:
                store.prefetch("kv", i + 1)
            c = store.get("q", qi)
            rng = (qi * C, (qi + 1) * C, i * C, (i + 1) * C)
            dq_b, dk_b, dv_b = block_backward(
                plan.kernel, c["do"], c["q"], kv["k"], kv["v"], c["o"], c["lse"], plan.kind(qi, i, C), plan.docs, rng,
                spec.scale,
            )
            dq = _add(c.get("dq"), dq_b, acc)
            if qi == i:
                dq_i = dq
            else:
                store.put("q", qi, dq=dq)
            dk, dv = _add(dk, dk_b, acc), _add(dv, dv_b, acc)
            del c, dq, dq_b, dk_b, dv_b
            store.release("q", qi)
        del kv
        store.drop("q", i)
        store.drop("kv", i)
        table = _table(spec, i * C, C, dq_i.dtype, dq_i.device)
        if table is not None:
            dq_i, dk = apply_rotary_backward(dq_i, table), apply_rotary_backward(dk, table)
        return _join_heads(dq_i, dk, dv, self.dtype)


def fpdt_attention(
    hidden_states: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor | None,
    spec: AttentionSpec,
    config: FPDTConfig,
    cp_group=None,
    tp_group=None,
    *,
    pool: HostBufferPool | None = None,
    stats: OffloadStats | None = None,
    counter: CommCounter | None = None,
    num_chunks: int | None = None,
    documents: Documents | torch.Tensor | None = None,
) -> torch.Tensor:
    """FPDT self-attention of this rank's tokens ([s_local, b, hidden], FPDT layout).

    Returns [s_local, b, hidden], summed over ``tp_group``, with ``proj_bias`` added when
    given (pass None and add it yourself for Megatron's skip-bias-add). ``pool`` keeps
    host buffers across calls (one per layer). ``num_chunks`` is what ``config.validate``
    returned, from callers that checked ``spec`` and ``config`` once up front (the model
    does at start-up); None checks them here. ``documents``: boundaries of packed
    documents (``fpdt.documents``, global positions); attention stays inside each one.
    """
    P = group_size(cp_group)
    if num_chunks is None:
        spec.validate(P)
        num_chunks = config.validate(hidden_states.shape[0] * P, P)
    u = num_chunks
    _check_shapes(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, spec)
    C = hidden_states.shape[0] * P // u  # one block is [b, heads / P, C, C]
    block = (hidden_states.shape[1], spec.num_heads // P, C, C)
    kernel = select_kernel(config.kernel, hidden_states.device, hidden_states.dtype, spec.head_dim, block)
    if config.offload and pool is None:
        pool = HostBufferPool(pin_memory=hidden_states.is_cuda)
    tensors = (hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    docs = as_documents(documents)
    _check_documents(docs, hidden_states.shape[0] * P, hidden_states.shape[1])
    plan = _Plan(spec, cp_group, tp_group, u, kernel, config.offload, config.overlap_comm, pool, stats, counter, save,
                 docs, spec.kv_replicas(P))
    return FPDTAttentionFunction.apply(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, plan)


class _BlockAttention(torch.autograd.Function):
    """One causal kernel call as an autograd node (for the plain Ulysses path)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale):
        o, lse = kernel.forward(q, k, v, True, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.kernel, ctx.scale = kernel, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(do.contiguous(), q, k, v, o, lse, True, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ulysses_attention(
    hidden_states: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor | None,
    spec: AttentionSpec,
    cp_group=None,
    tp_group=None,
    *,
    kernel: str = "auto",
    counter: CommCounter | None = None,
    documents: Documents | torch.Tensor | None = None,
    doc_tile: int = DEFAULT_TILE,
    recompute=None,
) -> torch.Tensor:
    """Plain Ulysses self-attention (contiguous sharding, whole sequence per head),
    built from autograd pieces: the baseline FPDT is measured against. With
    ``documents`` attention stays inside each document, computed in tiles of ``doc_tile``
    tokens that skip what no document spans (``fpdt.packed.DocumentAttention``).
    ``recompute`` (megatron-core's ``tensor_parallel.checkpoint`` or one of its signature)
    runs the core attention under it: q, k, v kept, its output and log-sum-exp rebuilt in
    backward (--recompute-modules core_attn)."""
    P = group_size(cp_group)
    spec.validate(P)
    _check_shapes(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, spec)
    s_l, b, _ = hidden_states.shape
    S = s_l * P
    docs = as_documents(documents)
    T = S if docs is None else min(doc_tile, S)  # one block is [b, heads / P, T, T]
    kern = select_kernel(kernel, hidden_states.device, hidden_states.dtype, spec.head_dim, (b, spec.num_heads // P, T, T))
    x = copy_to_tp(hidden_states, tp_group)
    mixed = F.linear(x, qkv_weight, qkv_bias).view(s_l, b, spec.groups, -1)
    R = spec.kv_replicas(P)
    mixed = spread_kv(mixed, R, spec.head_dim)  # autograd sums the replicas' dk, dv (gather_kv)
    q, k, v = _split_heads(all_to_all_seq_to_heads(mixed, cp_group, counter), spec.heads_per_group // R, spec.head_dim)
    table = _table(spec, 0, S, q.dtype, q.device)
    if table is not None:
        q, k = rotary(q, table), rotary(k, table)
    _check_documents(docs, S, b)

    def core(q, k, v):
        if docs is None:
            return _BlockAttention.apply(q, k, v, kern, spec.scale)
        return DocumentAttention.apply(q, k, v, kern, spec.scale, docs, doc_tile)

    o = core(q, k, v) if recompute is None else recompute(core, False, q, k, v)
    o = all_to_all_heads_to_seq(o.permute(2, 0, 1, 3), cp_group, counter).reshape(s_l, b, -1)
    out = reduce_from_tp(F.linear(o, proj_weight), tp_group)
    return out + proj_bias if proj_bias is not None else out


def _check_documents(docs: Documents | None, S: int, b: int) -> None:
    if docs is not None and (docs.seq_len != S or docs.batch != b):
        raise ValueError(f"document offsets cover {docs.batch} samples of {docs.seq_len} tokens, "
                         f"the batch has {b} of {S}")


def _check_shapes(x, w_qkv, b_qkv, w_proj, b_proj, spec: AttentionSpec) -> None:
    if x.dim() != 3:
        raise ValueError(f"hidden states must be [s, b, hidden], got shape {tuple(x.shape)}")
    if tuple(w_qkv.shape) != (spec.qkv_size, spec.hidden_size):
        raise ValueError(
            f"linear_qkv weight has shape {tuple(w_qkv.shape)}, expected {(spec.qkv_size, spec.hidden_size)}"
        )
    if b_qkv is not None and tuple(b_qkv.shape) != (spec.qkv_size,):
        raise ValueError(f"linear_qkv bias has shape {tuple(b_qkv.shape)}, expected {(spec.qkv_size,)}")
    if tuple(w_proj.shape) != (spec.hidden_size, spec.proj_input_size):
        raise ValueError(
            f"linear_proj weight has shape {tuple(w_proj.shape)}, expected {(spec.hidden_size, spec.proj_input_size)}"
        )
    if b_proj is not None and tuple(b_proj.shape) != (spec.hidden_size,):
        raise ValueError(f"linear_proj bias has shape {tuple(b_proj.shape)}, expected {(spec.hidden_size,)}")
    if x.shape[-1] != spec.hidden_size:
        raise ValueError(f"hidden size {x.shape[-1]} does not match spec.hidden_size={spec.hidden_size}")

"""Memory per rank: model state, activations in flight, circulating weight buffers.

Activations are counted tensor by tensor from what one TransformerLayer saves for its
backward, for two attention implementations: "unfused" (megatron-core's local spec, the
CPU path: the s x s probabilities are stored) and "flash" (Transformer Engine / flash
attention on GPUs: only a log-sum-exp per query). How many (microbatch, chunk) pairs a
rank holds at once, and how many chunk-sized weight / gradient buffers a WeiPipe rank
has alive (including irecvs posted ahead and isends not yet reaped), is read off the
schedule's own action lists, walked with the runtime's rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from megatron_weipipe.schedules.ir.actions import Flow, Kind, Schedule
from megatron_weipipe.schedules.ir.posts import DEFAULT_ORDER, Post, pair_messages, rank_posts

from megatron_weipipe.fpdt.config import kv_heads_per_rank
from megatron_weipipe.residency import pool_bytes
from megatron_weipipe.shape import ModelShape


@dataclass(frozen=True)
class ActivationOptions:
    impl: str = "flash"  # "flash" (GPU) or "unfused" (megatron-core local spec, CPU)
    dtype_bytes: int = 2
    dropout: bool = True
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    flash_attention: Optional[bool] = None  # None: with impl "flash"; True with "unfused": local layers, fused SDPA core
    # selective recomputation (--recompute-modules): what every layer rebuilds in backward
    # instead of keeping: "core_attn", "mlp", "layernorm"
    recompute: tuple[str, ...] = ()


def layer_activation_bytes(shape: ModelShape, o: ActivationOptions) -> float:
    """Bytes one layer saves for its backward, one microbatch, one rank. Under selective
    recomputation (megatron-core's, measured tensor by tensor on local layers): core_attn
    keeps only the core attention's inputs (q and k as rotated, the QKV projection's output
    that v views) and none of its scores, probabilities, masks or log-sum-exp (a fused
    kernel keeps about its inputs anyway: only the log-sum-exp goes); mlp keeps
    only the MLP's input (on Transformer Engine layers, whose fc1 holds the pre-MLP norm,
    also none of that norm's output and statistics); layernorm keeps each norm's input,
    not its output, statistics or normalised copy (TE layers' norms are inside their
    linears: nothing there)."""
    b, s, h = shape.micro_batch_size, shape.seq_length / o.cp, shape.hidden_size
    a, g, d = shape.num_attention_heads, shape.groups, shape.head_dim
    e, tp = o.dtype_bytes, o.tp
    sb = s * b
    unfused = o.impl == "unfused"
    flash = not unfused if o.flash_attention is None else o.flash_attention
    rope = shape.position_embedding_type == "rope"
    mask = e if unfused else 1  # dropout masks: float on the CPU path, bool on GPUs
    core_attn, mlp = "core_attn" in o.recompute, "mlp" in o.recompute
    norms = "layernorm" in o.recompute and unfused
    stats = (2 if shape.normalization == "LayerNorm" else 1) * 4  # one norm's fp32 statistics
    # replicated over TP unless sequence parallel: layer input, norm outputs, residual
    per_token = (2 if norms else 4) * h * e
    if not norms:
        per_token += 2 * stats
        if unfused and shape.normalization == "RMSNorm":
            per_token += 2 * h * e  # the unfused RMSNorm keeps its normalised input too
    if mlp and not unfused:
        per_token -= h * e + stats  # TE's fc1 holds the pre-MLP norm: its output recomputed with it
    if o.dropout:
        per_token += 2 * h * mask
    replicated = sb * per_token / (tp if o.sequence_parallel else 1)
    # split over TP: attention inputs/outputs, MLP intermediates
    split_tok = a * d * e  # attention output (projection input)
    if unfused and core_attn and not flash:
        split_tok += (shape.qkv_width + ((a + g) * d if rope else 0)) * e  # the checkpoint's q, k, v
    elif unfused:
        qkv = 0.0 if (rope and g < a) else shape.qkv_width
        if rope:
            qkv += a * d + (g * d if g == a else 0)  # rotated q (and k)
        if g < a and not flash:
            qkv += 2 * a * d  # k, v expanded to every head before the matmuls
        split_tok += qkv * e
    else:
        split_tok += shape.qkv_width * e
    f = shape.ffn
    if mlp:
        pass  # the MLP's input is the pre-MLP norm's output, counted above
    elif shape.swiglu:
        split_tok += (5 if unfused else 3) * f * e
    else:
        split_tok += 2 * f * e
    split = sb * split_tok / tp
    heads = a / tp  # with Ulysses each rank holds a/cp heads over the whole sequence
    full_s = shape.seq_length
    if core_attn:
        attn = 0.0
    elif not flash:
        # the probabilities for the matmul; below fp32 also megatron-core's fp32 softmax
        # output (attention_softmax_in_fp32) that the softmax saves for its backward
        fp32_softmax = 4 if e < 4 else 0
        attn = b * heads / o.cp * full_s * full_s * (e + fp32_softmax + (2 * e if o.dropout else 0))
    else:
        attn = b * heads / o.cp * full_s * 4  # log-sum-exp
    rope_tables = 4 * s * d * e if (rope and unfused) else 0.0
    return replicated + split + attn + rope_tables


def recomputed_bytes(shape: ModelShape, o: ActivationOptions, per_layer=None) -> float:
    """Selective recomputation: the most one recomputed module of one layer holds again
    during its backward (the saved tensors it did not keep), transient. ``per_layer``: the
    function giving a layer's bytes for options (``layer_activation_bytes`` by default)."""
    per_layer = per_layer or layer_activation_bytes
    kept = per_layer(shape, replace(o, recompute=()))
    return max((kept - per_layer(shape, replace(o, recompute=(m,))) for m in o.recompute), default=0.0)


def attention_scratch_bytes(shape: ModelShape, o: ActivationOptions) -> float:
    """Unfused attention's backward of one layer: the gradient of the probabilities and of
    the fp32 softmax, s x s per head, transient (flash attention works in tiles: none)."""
    if o.impl != "unfused" or o.flash_attention:
        return 0.0
    return shape.micro_batch_size * shape.num_attention_heads / o.tp / o.cp * shape.seq_length ** 2 * (o.dtype_bytes + 4)


def layer_input_bytes(shape: ModelShape, o: ActivationOptions) -> float:
    """What full recomputation keeps per layer (or per chunk, for WeiPipe's runtime): its input."""
    tokens = shape.tokens / o.cp / (o.tp if o.sequence_parallel else 1)
    return tokens * shape.hidden_size * o.dtype_bytes


def logits_bytes(shape: ModelShape, tp: int = 1, cp: int = 1) -> float:
    """fp32 logits and their gradient at the loss, transient on the rank that computes it."""
    return 2.0 * shape.tokens / cp * shape.padded_vocab(tp) / tp * 4


def _norm_saved_per_token(shape: ModelShape, o: ActivationOptions, chunked: bool) -> float:
    """What one norm keeps for backward per local token: in sequence chunks under
    checkpointing (FPDT, fpdt/chunked.py) its bf16 input; whole, torch's composite
    rms_norm its fp32 input copy and fp32 normalised output (8h) and the fp32 1/rms (4),
    LayerNorm (native kernel) its input and two fp32 statistics."""
    if chunked:
        return shape.hidden_size * o.dtype_bytes
    if shape.normalization == "RMSNorm":
        return 8 * shape.hidden_size + 4
    return shape.hidden_size * o.dtype_bytes + 8


def long_context_layer_bytes(shape: ModelShape, o: ActivationOptions, mode: str, norm_chunks: int = 1) -> float:
    """Bytes one layer of the long-context path (model/long_context.py: CP > 1 or FPDT, local
    layers) saves for its backward, one microbatch, one rank; ``mode`` "ulysses", "fpdt"
    or "offload" (FPDT with --fpdt-offload); ``norm_chunks``: FPDT's chunk count, in which
    the norms run. Per local token, from the code:
    - each of the two norms keeps `_norm_saved_per_token`; its bf16 output is saved by the
      linear that reads it (attention input: not with offload, where fpdt_attention keeps
      the input chunks on the host; MLP input: always);
    - Ulysses (ulysses_attention): rotated q, k, v and o in head layout, o again in
      sequence layout (the projection's input), the fp32 log-sum-exp; megatron-core's MLP:
      fc1 output (2f), the sigmoid and silu of its first half and their product (3f);
    - FPDT without offload: its ChunkStore keeps q, o, k, v, the fp32 log-sum-exp and the
      output chunks in sequence layout on the device; the chunked MLP keeps only its input.
    Selective recomputation: layernorm keeps each norm's input only (outputs freed);
    core_attn (Ulysses) keeps the kernel's q, k, v, not its output in head layout nor the
    log-sum-exp; mlp (Ulysses) keeps only the MLP's input (FPDT's chunked MLP does already)."""
    b, s, h = shape.micro_batch_size, shape.seq_length / o.cp, shape.hidden_size
    a, d, f = shape.num_attention_heads / o.tp, shape.head_dim, shape.ffn / o.tp
    g = o.cp * kv_heads_per_rank(shape.groups, o.cp, o.tp)  # per local token: a shared KV head is on each of its ranks
    e = o.dtype_bytes
    norm = _norm_saved_per_token(shape, o, norm_chunks > 1)
    outputs = (1 if mode == "offload" else 2) * h * e
    if "layernorm" in o.recompute:
        norm, outputs = h * e, 0.0
    per_token = 2 * norm + outputs
    if mode == "ulysses":
        per_token += (a + 2 * g) * d * e + a * d * e  # q, k, v in head layout; o in sequence layout
        if "core_attn" not in o.recompute:
            per_token += a * d * e + 4 * a  # o in head layout and the log-sum-exp
        if "mlp" not in o.recompute:
            per_token += (5 * f if shape.swiglu else 2 * f) * e
    elif mode == "fpdt":
        per_token += (3 * a + 2 * g) * d * e + 4 * a
    return s * b * per_token


def long_context_norm_scratch_bytes(shape: ModelShape, o: ActivationOptions, norm_chunks: int = 1) -> float:
    """The composite rms_norm's backward: four fp32 tensors of the norm's input size alive at
    once beside what the layer saved (gradient upcast, its product with the weight, and the
    two terms of the input gradient); in sequence chunks, of one chunk, plus what the
    recomputed chunk saved (8h + 4 per token)."""
    if shape.normalization != "RMSNorm":
        return 0.0
    tokens = shape.micro_batch_size * shape.seq_length / o.cp
    if norm_chunks > 1:
        return tokens / norm_chunks * (4 * 4 * shape.hidden_size + 8 * shape.hidden_size + 4)
    return 4 * 4 * tokens * shape.hidden_size


def unchunked_loss_bytes(shape: ModelShape, o: ActivationOptions) -> float:
    """megatron-core's loss on the long-context path without FPDT (Ulysses), at its peak:
    the output layer's logits in the compute dtype and the cross entropy's fp32 copy
    (s x V each), beside what the final norm saved (as a layer's norm) and its output."""
    b, s, h = shape.micro_batch_size, shape.seq_length / o.cp, shape.hidden_size
    v, e = shape.padded_vocab(o.tp) / o.tp, o.dtype_bytes
    final_norm = 8 * h + 4 if shape.normalization == "RMSNorm" else 8
    return s * b * (v * (e + 4) + final_norm + h * e)


def chunked_mlp_scratch_bytes(shape: ModelShape, o: ActivationOptions, chunks: int) -> float:
    """FPDT's chunked MLP backward (fpdt/mlp.py): the input gradient (s x h), the fp32
    weight-gradient accumulators (fc1 and fc2), and of one chunk of s/chunks tokens the
    recomputed fc1 output and its gradient (2 x 2f with SwiGLU) and four f-wide tensors
    (sigmoid, silu, product, their gradient)."""
    b, s, h, f, e = shape.micro_batch_size, shape.seq_length / o.cp, shape.hidden_size, shape.ffn / o.tp, o.dtype_bytes
    wide = 2 * f if shape.swiglu else f
    return s * b * h * e + (wide + f) * h * 4 + s / chunks * b * (2 * wide + 4 * f) * e


def chunked_loss_bytes(shape: ModelShape, o: ActivationOptions, chunks: int, norm_chunks: int = 1) -> float:
    """FPDT's chunked cross entropy (fpdt/loss.py) on the rank holding the loss: what the
    final norm saved (as a layer's norm), its output and the fp32 log-sum-exp, plus the larger of its forward (one chunk of
    c = s/chunks tokens: fp32 logits z, z - max and its exp, 12 bytes per token and vocab
    entry) and its backward (input gradient s x h, fp32 weight-gradient accumulator V x h,
    and of one chunk the fp32 probabilities, their product with the loss gradient and its
    cast: 8 + e bytes per token and vocabulary entry)."""
    b, s, h = shape.micro_batch_size, shape.seq_length / o.cp, shape.hidden_size
    v, e = shape.padded_vocab(o.tp) / o.tp, o.dtype_bytes
    chunk = s / chunks * b * v
    final_norm = _norm_saved_per_token(shape, o, norm_chunks > 1)  # saved as in a layer's norms
    return s * b * (h * e + 4 + final_norm) + max(12 * chunk, s * b * h * e + v * h * 4 + (8 + e) * chunk)


# ---------------------------------------------------------------- read off the lists

def _per_schedule(fn):
    """Memoize a pure reading of a schedule by the schedule object (kept alive while cached,
    so its id stays its own): run_spec builds one Schedule per size and shares it."""
    cache: dict = {}

    def wrapper(schedule, *args, **kwargs):
        key = (id(schedule), args, tuple(sorted(kwargs.items())))
        hit = cache.get(key)
        if hit is None or hit[0] is not schedule:
            if len(cache) > 512:
                cache.clear()
            hit = cache[key] = (schedule, fn(schedule, *args, **kwargs))
        return hit[1]

    wrapper.__doc__, wrapper.__name__, wrapper.__wrapped__ = fn.__doc__, fn.__name__, fn
    return wrapper


@_per_schedule
def peak_in_flight(schedule: Schedule, freed_at_input: bool = False) -> tuple[int, ...]:
    """Per rank, the most (microbatch, chunk) forwards whose backward has not finished (a
    split backward frees them at W, or at I when I computes both gradients)."""
    out = []
    for acts in schedule.ranks:
        live, peak = set(), 0
        split = not freed_at_input and any(a.kind is Kind.BACKWARD_WEIGHT for a in acts)
        for a in acts:
            if a.kind is Kind.FORWARD:
                live.add((a.mb, a.chunk))
                peak = max(peak, len(live))
            elif a.kind is Kind.BACKWARD or (a.kind is Kind.BACKWARD_WEIGHT if split
                                                else a.kind is Kind.BACKWARD_INPUT):
                live.discard((a.mb, a.chunk))
        out.append(peak)
    return tuple(out)


@_per_schedule
def pool_sets(schedule: Schedule, freed_at_input: bool = False) -> tuple[tuple[int, ...], ...]:
    """Per rank, for each of its model chunks, the most microbatches that chunk had in
    flight at once: how many forward sets the chunks' own host pools (FPDT offload: one
    per built model, so one per virtual pipeline stage) keep, as each stays at its peak."""
    out = []
    for acts in schedule.ranks:
        live: dict = {}
        peak: dict = {}
        split = not freed_at_input and any(a.kind is Kind.BACKWARD_WEIGHT for a in acts)
        for a in acts:
            if a.kind is Kind.FORWARD:
                live.setdefault(a.chunk, set()).add(a.mb)
                peak[a.chunk] = max(peak.get(a.chunk, 0), len(live[a.chunk]))
            elif a.kind is Kind.BACKWARD or (a.kind is Kind.BACKWARD_WEIGHT if split
                                                else a.kind is Kind.BACKWARD_INPUT):
                live.get(a.chunk, set()).discard(a.mb)
        out.append(tuple(peak[c] for c in sorted(peak)))
    return tuple(out)


def model_chunks(schedule: Schedule, rank: int) -> int:
    """How many model chunks (virtual pipeline stages) ``rank`` runs."""
    return max(1, len({a.chunk for a in schedule.ranks[rank]}))


def _sets(forward: Mapping[int, int], backward: Mapping[int, int], n_forward: int, n_backward: int) -> float:
    """Host bytes of one pool holding ``n_forward`` forward and ``n_backward`` backward sets."""
    sizes: dict = {}
    for buffers, n in ((forward, n_forward), (backward, n_backward)):
        for nbytes, count in buffers.items():
            sizes[int(nbytes)] = sizes.get(int(nbytes), 0) + n * count
    return float(pool_bytes(sizes))


def shared_pool_bytes(forward: Mapping[int, int], backward: Mapping[int, int], layers: int, *, recompute: bool,
                      weipipe: bool, in_flight: int, chunk_sets: Sequence[int], models: int) -> float:
    """Host bytes of FPDT offload's pools, each shared by a built model's attention layers
    and as large as the most buffers live in it at once, laid out in power-of-two slabs as
    the pool lays them out (``residency.pool_bytes``: what the pinned allocator really
    gives). ``forward``/``backward``: one layer's forward set and its backward-only extra,
    {buffer bytes: how many} (simulator/fpdt.py ``pool_buffers``); ``layers`` per chunk;
    ``chunk_sets``: each model chunk's most microbatches in flight (``pool_sets``).
    Full recomputation: one layer's pair per pool (Megatron recomputes one layer at a
    time: models pools of forward + backward); WeiPipe recomputes a whole chunk before its
    backward: layers x forward + backward. Without it: every in-flight (microbatch,
    chunk)'s forward sets plus one backward set, the finished backwards' buffers taken
    again: WeiPipe (one model) in_flight x layers x forward + backward, Megatron per
    chunk's pool its peak x layers x forward + backward."""
    if weipipe:
        return _sets(forward, backward, layers if recompute else in_flight * layers, 1)
    if recompute:
        return models * _sets(forward, backward, 1, 1)
    return sum(_sets(forward, backward, peak * layers, 1) for peak in chunk_sets)


def offloaded_inputs_host_bytes(kept: float, per_input: float) -> float:
    """Host bytes of --offload-layer-inputs' pool holding ``kept`` bytes of layer inputs of
    ``per_input`` each, in its power-of-two slabs (``residency.pool_bytes``)."""
    if kept <= 0 or per_input <= 0:
        return 0.0
    return float(pool_bytes({int(per_input): round(kept / per_input)}))


@dataclass(frozen=True)
class BufferPeak:
    weights: int  # chunk-sized tensors in the compute dtype
    grads: int  # chunk-sized tensors in the gradient dtype


@_per_schedule
def peak_buffers(schedule: Schedule, lookahead: int = 1) -> tuple[BufferPeak, ...]:
    """Per rank, the most chunk-sized tensors WeiPipeRuntime holds at once: buffers,
    irecvs from the moment the runtime's posting program (plan.posts: parity order at
    lookahead 1, receive-first otherwise) posts them, and isends kept until the next
    tick starts."""
    order = DEFAULT_ORDER if lookahead == 1 else "recv-first"
    pairs = pair_messages(schedule)
    out = []
    for rank, acts in enumerate(schedule.ranks):
        tick = None
        held = {"w": 0, "g": 0}
        sending: list[str] = []
        peak = (0, 0)
        best = -1

        def kind_of(flow: Optional[Flow]) -> str:
            return "g" if flow is Flow.GRADS else "w"

        def note():
            nonlocal peak, best
            w = held["w"] + sum(1 for k in sending if k == "w")
            g = held["g"] + sum(1 for k in sending if k == "g")
            total = w + 2 * g  # rank by bytes with fp32 gradients as the common case
            if total > best:
                best, peak = total, (w, g)

        for step in rank_posts(schedule, rank, order=order, lookahead=lookahead, pairs=pairs):
            if isinstance(step, Post):
                for i in step.ops:
                    if acts[i].kind is Kind.RECV:
                        held[kind_of(acts[i].flow)] += 1
                note()
                continue
            a = acts[step]
            if a.tick != tick:
                tick = a.tick
                sending.clear()
            if a.kind is Kind.LOAD:
                held["w"] += 1
            elif a.kind is Kind.GRAD_INIT:
                held["g"] += 1
            elif a.kind is Kind.SEND:
                k = kind_of(a.flow)
                held[k] -= 1
                sending.append(k)
            elif a.kind is Kind.DROP:
                held["w"] -= 1
            elif a.kind is Kind.ACCUMULATE_GRAD:
                held["g"] -= 1
            note()
        out.append(BufferPeak(*peak))
    return tuple(out)


# ---------------------------------------------------------------- model state

@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model state."""

    param: int = 2  # compute-dtype weights the model runs on
    grad: int = 4  # megatron-core DDP keeps fp32 main grads
    optimizer: int = 12  # fp32 master + Adam moments (0 extra master when params are fp32)
    optimizer_shards: int = 1  # distributed optimizer: data x context parallel ranks / optimizer instances
    param_shards: int = 1  # ZeRO-3 style: weights and grads sharded too

    def per_param(self) -> float:
        return (self.param + self.grad) / self.param_shards + self.optimizer / self.optimizer_shards


def fsdp2_state_bytes(shards: int) -> StateBytes:
    """model/fsdp.py: fp32 weights (the master), fp32 grads (reduce dtype) and
    Adam's two fp32 moments, every one sharded."""
    return StateBytes(param=4, grad=4, optimizer=8, optimizer_shards=shards, param_shards=shards)


def fsdp2_root_params(shape: ModelShape, tp: int) -> int:
    """The FSDP2 root unit's parameters: the final norm and the untied output layer (the
    embedding and each layer are units of their own)."""
    return shape.norm_params() + (shape.word_embedding_params(tp) if shape.untie_embeddings_and_output_weights else 0)


def fsdp2_option_bytes(params: int, root_params: int, compute_bytes: int, fsdp, microbatches: int) -> float:
    """What FSDP2's options keep beyond the shards and `fsdp2_gathered_bytes`, as
    model/fsdp_memory.py's per-unit form counts it: without reshard after forward every
    unit's gathered weights stay until its backward (the root's and one layer's are counted
    already); with gradient sync once per iteration the unsharded gradients accumulate
    across microbatches in the reduce dtype."""
    out = 0.0
    if not fsdp.reshard_after_forward:
        out += (params - root_params) * compute_bytes
    if not fsdp.grad_sync_per_microbatch and microbatches > 1:
        out += params * fsdp.grad_bytes
    return out


def fsdp2_gathered_bytes(shape: ModelShape, tp: int, compute_bytes: int) -> float:
    """FSDP2's gathered weights at the peak (the start of the backward), in the compute
    dtype: the root unit and one layer."""
    return (fsdp2_root_params(shape, tp) + shape.layer_params(tp)) * compute_bytes


def state_bytes_for(compute_bytes: int) -> StateBytes:
    """Megatron mixed precision (bf16 weights, fp32 master + Adam) or plain fp32 (CPU)."""
    if compute_bytes >= 4:
        return StateBytes(param=4, grad=4, optimizer=8)  # the fp32 weights are the master
    return StateBytes(param=compute_bytes, grad=4, optimizer=12)


@dataclass(frozen=True)
class RankMemory:
    params: int  # parameters held by this rank (model state counts these)
    model_state: float
    activations: float
    buffers: float  # WeiPipe circulating weights/gradients, runtime flat copies
    transient: float  # the largest short-lived allocation (logits, one recomputed chunk)
    host: float = 0.0  # offload's host buffers (FPDT's pool, shared by a model's layers)
    chunk_state: float = 0.0  # FPDT chunks brought back from the host (offload)
    gathered: float = 0.0  # FSDP2: the unit's weights gathered in the compute dtype

    @property
    def total(self) -> float:
        return self.model_state + self.gathered + self.activations + self.buffers + self.transient

"""WeiPipe runtime parity on gloo: losses, every chunk's summed gradient and parameters
after 3 optimizer steps equal a single-process reference that runs all G*P microbatches
through the full model, for every schedule, P in {2, 3, 4}, G in {1, 2, 3}, chunks
initialised differently. One spawned run per ring size covers all its configurations.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from megatron_weipipe.schedules.generate.weipipe import generate
from megatron_weipipe.schedules.timing.closed_forms import expected_messages
from megatron_weipipe.schedules.registry import weipipe_names
from megatron_weipipe.schedules.runtime.flat import FlatViews
from megatron_weipipe.schedules.runtime.ring import WeiPipeRuntime
from harness import run_distributed

VOCAB, HIDDEN, SEQ, BATCH, LAYERS_PER_CHUNK = 13, 8, 5, 2, 2
STEPS, LR = 3, 0.05


class Block(nn.Module):
    """Residual MLP block; LayerNorm gives the chunk more than one kind of saved weight."""

    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def make_chunk(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(HIDDEN) for _ in range(LAYERS_PER_CHUNK)])


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, h, labels):
        logits = self.out(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_replicated():
    torch.manual_seed(7)
    return nn.Embedding(VOCAB, HIDDEN), Head()


def microbatch(step: int, global_mb: int):
    g = torch.Generator().manual_seed(10_000 * step + global_mb)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, labels


def reference(P: int, G: int):
    """Single process: per step, all G*P microbatches through the full model, gradients
    summed, plain SGD. Returns per-step losses, step-1 gradients and final parameters."""
    template = make_chunk(0)
    layout = FlatViews.from_module(template)
    flats = [layout.flatten(make_chunk(1000 + c)).requires_grad_() for c in range(P)]
    emb, head = make_replicated()
    params = list(emb.parameters()) + list(head.parameters())
    losses, first_grads = [], None
    for step in range(STEPS):
        step_losses = []
        for gm in range(G * P):
            tokens, labels = microbatch(step, gm)
            h = emb(tokens)
            for c in range(P):
                h = functional_call(template, layout.views(flats[c]), (h,))
            loss = head(h, labels)
            loss.backward()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses))
        if step == 0:
            first_grads = ([f.grad.clone() for f in flats], [p.grad.clone() for p in params])
        with torch.no_grad():
            for t in flats + params:
                t -= LR * t.grad
                t.grad = None
    return losses, first_grads, ([f.detach() for f in flats], [p.detach() for p in params])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _train_ring(name, G, recompute, ring_group, ring_rank, P, data_offset=0):
    """What a training loop does around the runtime, for one ring."""
    template = make_chunk(0)
    layout = FlatViews.from_module(template)
    master = layout.flatten(make_chunk(1000 + ring_rank))  # only the owned chunk lives here
    emb, head = make_replicated()
    replicated = list(emb.parameters()) + list(head.parameters())
    rt = WeiPipeRuntime(generate(name, P, G), ring_group=ring_group, chunk_template=template,
                        recompute=recompute)
    losses, grads, counters = [], None, []
    for step in range(STEPS):
        mbs = [microbatch(step, data_offset + ring_rank * G + m) for m in range(G)]
        result = rt.run_iteration(
            master, mbs,
            pre_fn=lambda mb: emb(mb[0]),
            post_fn=lambda h, mb: head(h, mb[1]),
        )
        for p in replicated:  # embedding and head are replicated on the ring: sum their grads
            dist.all_reduce(p.grad, group=ring_group)
        if step == 0:
            grads = (result.main_grad.clone(), [p.grad.clone() for p in replicated])
        with torch.no_grad():  # the owner steps its chunk, every rank its replicas
            master -= LR * result.main_grad
            for p in replicated:
                p -= LR * p.grad
                p.grad = None
        losses.append(torch.stack(result.losses))
        counters.append(result.bytes.as_dict())
    return losses, grads, (master, [p.detach() for p in replicated]), counters


def _parity_worker(rank, world_size, configs):
    P = world_size
    ring = dist.new_group(list(range(P)))
    report = []
    for name, G, recompute in configs:
        ref_losses, (ref_chunk_grads, ref_rep_grads), (ref_flats, ref_rep) = reference(P, G)
        losses, (grad, rep_grads), (master, rep), counters = _train_ring(name, G, recompute, ring, rank, P)
        errs = {
            "loss": max(_rel(losses[s], ref_losses[s][rank * G:(rank + 1) * G]) for s in range(STEPS)),
            "chunk_grad": _rel(grad, ref_chunk_grads[rank]),
            "replicated_grad": max(_rel(a, b) for a, b in zip(rep_grads, ref_rep_grads)),
            "chunk_param": _rel(master, ref_flats[rank]),
            "replicated_param": max(_rel(a, b) for a, b in zip(rep, ref_rep)),
        }
        report.append(((name, G, recompute), errs, counters[0]))
    return report


def _configs(P):
    # recomputation alternates with G so every schedule runs both ways
    return [(name, G, G == 2) for name in weipipe_names() for G in (1, 2, 3)]


@pytest.mark.distributed
@pytest.mark.parametrize("P", [2, 3, 4])
def test_runtime_matches_single_process_reference(P):
    reports = run_distributed(_parity_worker, P, _configs(P), timeout=240)
    numel = FlatViews.from_module(make_chunk(0)).numel
    for rank, report in enumerate(reports):
        for (name, G, recompute), errs, counter in report:
            for key, err in errs.items():
                assert err < 1e-5, f"{name} P={P} G={G} recompute={recompute} rank {rank}: {key} rel err {err:.2e}"
            want = expected_messages(name, P, G, rank)
            sent = {flow.value: n * numel * 4 for flow, n in want.items()}  # fp32 weights and grads
            assert counter["sent"] == sent, (name, P, G, rank, counter["sent"], sent)
            assert counter["messages_sent"] == {flow.value: n for flow, n in want.items()}


def _two_rings_worker(rank, world_size):
    """World of 4 = two data-parallel rings {0, 2} and {1, 3}: peers are addressed through
    the ring group, and each owner all-reduces its chunk gradient over its DP group."""
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring, dp = rings[rank % 2], dps[rank // 2]
    ring_rank = dist.get_rank(ring)
    P, G = 2, 2
    template = make_chunk(0)
    layout = FlatViews.from_module(template)
    master = layout.flatten(make_chunk(1000 + ring_rank))
    emb, head = make_replicated()
    rt = WeiPipeRuntime(generate("weipipe-zb", P, G), ring_group=ring, chunk_template=template)
    mbs = [microbatch(0, (rank % 2) * P * G + ring_rank * G + m) for m in range(G)]
    pending = []
    result = rt.run_iteration(master, mbs, pre_fn=lambda mb: emb(mb[0]), post_fn=lambda h, mb: head(h, mb[1]),
                              grad_ready=lambda c, g: pending.append(dist.all_reduce(g, group=dp, async_op=True)))
    for w in pending:
        w.wait()
    return ring_rank, result.main_grad, result.bytes.total_sent


@pytest.mark.distributed
def test_two_data_parallel_rings_match_reference():
    out = run_distributed(_two_rings_worker, 4, timeout=120)
    # the reference over both rings' data is the P=2 reference with 2*G microbatches per rank,
    # reordered: ring k's rank r holds global microbatches k*P*G + r*G + m
    template = make_chunk(0)
    layout = FlatViews.from_module(template)
    flats = [layout.flatten(make_chunk(1000 + c)).requires_grad_() for c in range(2)]
    emb, head = make_replicated()
    for gm in range(8):
        tokens, labels = microbatch(0, gm)
        h = emb(tokens)
        for c in range(2):
            h = functional_call(template, layout.views(flats[c]), (h,))
        head(h, labels).backward()
    for ring_rank, grad, _ in out:
        assert _rel(grad, flats[ring_rank].grad) < 1e-5


class _Ring:
    """What every option check of one rank shares: the ring, the reference, the inputs."""

    def __init__(self, rank: int, world_size: int, G: int):
        self.rank, self.P, self.G = rank, world_size, G
        self.group = dist.new_group(list(range(world_size)))
        self.ref_losses, (self.ref_chunk_grads, _), _ = reference(world_size, G)
        self.template = make_chunk(0)
        self.layout = FlatViews.from_module(self.template)
        self.emb, self.head = make_replicated()
        self.mbs = [microbatch(0, rank * G + m) for m in range(G)]

    def run(self, name: str, post_fn=None, **options):
        """One iteration of schedule ``name`` from fresh chunk weights and zero replicated grads."""
        for p in list(self.emb.parameters()) + list(self.head.parameters()):
            p.grad = None
        master = self.layout.flatten(make_chunk(1000 + self.rank))
        rt = WeiPipeRuntime(generate(name, self.P, self.G), ring_group=self.group, chunk_template=self.template,
                            **options)
        return rt.run_iteration(master, self.mbs, pre_fn=lambda mb: self.emb(mb[0]),
                                post_fn=post_fn or (lambda h, mb: self.head(h, mb[1])))

    def loss_error(self, res) -> float:
        return _rel(torch.stack(res.losses), self.ref_losses[0][self.rank * self.G:(self.rank + 1) * self.G])

    def grad_error(self, res) -> float:
        return _rel(res.main_grad, self.ref_chunk_grads[self.rank])


def _skewed_backward_weights(ring: _Ring) -> dict:
    """Perturb only what is loaded into bwd_weights, with and without recomputation:
    (loss error, gradient error) of each."""
    from megatron_weipipe.schedules.ir.actions import Flow
    from megatron_weipipe.schedules.runtime import ring as rt_mod

    original_load = rt_mod._IterationState._load

    def skewed_load(self, i, a):
        original_load(self, i, a)
        if a.buffer.flow is Flow.BWD_WEIGHTS:
            self.buffers[a.buffer][1].mul_(1.5)

    rt_mod._IterationState._load = skewed_load
    out = {}
    try:
        for recompute in (False, True):
            res = ring.run("weipipe-interleave", recompute=recompute)
            out[recompute] = (ring.loss_error(res), ring.grad_error(res))
    finally:
        rt_mod._IterationState._load = original_load
    return out


def _untagged(ring: _Ring) -> dict:
    """Tags off (NCCL ignores them): the gradient error of each lookahead and posting order
    (parity is the default; grouped batches; recv-first is gloo-only)."""
    out = {}
    for name, lookahead, order in (("weipipe-naive", 0, "recv-first"), ("weipipe-interleave", 3, "recv-first"),
                                   ("weipipe-zb", 1, "grouped"), ("weipipe-interleave", 1, "parity")):
        res = ring.run(name, use_tags=False, lookahead=lookahead, order=order)
        out[f"{name} {order}"] = ring.grad_error(res)
    return out


def _wrong_ring(ring: _Ring) -> str | None:
    """The error a schedule for another ring size raises, or None."""
    try:
        WeiPipeRuntime(generate("weipipe-zb", ring.P + 1, ring.G), ring_group=ring.group,
                       chunk_template=ring.template)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return str(e)
    return None


def _bf16(ring: _Ring) -> tuple:
    """bf16 compute and bf16 gradient messages: (loss error, grad error, main-grad dtype, bytes sent)."""
    res = ring.run("weipipe-zb", post_fn=lambda h, mb: ring.head(h.float(), mb[1]),
                   compute_dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    return ring.loss_error(res), ring.grad_error(res), res.main_grad.dtype, res.bytes.as_dict()["sent"]


def _options_worker(rank, world_size):
    """Every option check on one ring of 2, G = 2; each test below reads its own entry."""
    ring = _Ring(rank, world_size, G=2)
    return {"skewed": _skewed_backward_weights(ring), "untagged": _untagged(ring), "wrong ring": _wrong_ring(ring),
            "bf16": _bf16(ring)}


@pytest.fixture(scope="module")
def options_runs():
    """Per-rank results of _options_worker: one spawned run for the four option tests."""
    return run_distributed(_options_worker, 2, timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
def test_backward_reads_the_backward_weight_buffer(options_runs, recompute):
    """Perturbing only what is loaded into bwd_weights leaves the losses exact and breaks the gradients."""
    for out in options_runs:
        loss_err, grad_err = out["skewed"][recompute]
        assert loss_err < 1e-6, "forward must not read the backward-weight buffer"
        assert grad_err > 1e-2, "backward must read the backward-weight buffer"


@pytest.mark.distributed
def test_untagged_receives_keep_flows_apart(options_runs):
    """Receives posted in the sender's order keep the flows apart even on a ring of 2 where,
    in list order, they would cross; any lookahead and every posting order."""
    for out in options_runs:
        untagged = out["untagged"]
        assert len(untagged) == 4 and all(v < 1e-5 for v in untagged.values()), untagged


@pytest.mark.distributed
def test_schedule_for_another_ring_size_is_refused(options_runs):
    for out in options_runs:
        assert out["wrong ring"] == "schedule weipipe-zb is for a ring of 3 ranks, the ring group has 2"


@pytest.mark.distributed
def test_bf16_compute_and_gradient_messages(options_runs):
    """bf16 compute / bf16 gradient messages run, stay close to the reference, keep an fp32
    main gradient, and the byte counter sees 2-byte elements."""
    P, G = 2, 2
    numel = FlatViews.from_module(make_chunk(0)).numel
    for rank, out in enumerate(options_runs):
        loss_err, grad_err, dtype, sent = out["bf16"]
        assert loss_err < 3e-2 and grad_err < 6e-2, (loss_err, grad_err)
        assert dtype == torch.float32
        want = expected_messages("weipipe-zb", P, G, rank)
        assert sent == {flow.value: n * numel * 2 for flow, n in want.items()}

"""Measure this host: time real megatron-core layers of the run's shape, in one process.

What is timed is what the runtimes execute per microbatch:
- a decoder chunk of k layers called as modules (Megatron's 1F1B stages: backward into
  .grad, megatron-core DDP's hooks adding it to main_grad) and through flat weight views
  with torch.func.functional_call (WeiPipe's runtime: one grad call, the weight gradient
  added to a token): forward, full backward, input-gradient pass and the weight-gradient
  pass after it;
- the embedding, and the final norm + output layer + loss (forward and backward);
- megatron-core's optimizer step (gradient norm, clipping, Adam) per parameter.
Times are CPU seconds (process time), medians of repeats after a warm-up, single-
threaded (torchrun starts each rank with OMP_NUM_THREADS=1): on a shared host they do
not depend on what else runs. What else runs is recorded as `cpu_share`, the CPU time
the calibrating process got per wall second; the replay turns it into background load
(see cluster_replay.py). `gloo_link` times gloo send/recv between two processes (TCP on one
host) and the CPU time they spend per byte, which competes with compute on a host with
few cores. `python -m tools.simulate` hands this module to the simulator for --calibrate and
--measure-host; the simulator itself only reads calibrations
(megatron_weipipe/simulator/calibration.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, replace

from megatron_weipipe.shape import ModelShape
from megatron_weipipe.simulator.calibration import HostCalibration, calibration_fields, load, save
from megatron_weipipe.simulator.hardware import LinkSpec

# calibrate_concurrently's workers run this module (its __main__), from the folder that holds the package
_WORKER = "megatron_weipipe.training.host_calibration"
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pretrain_config_for(shape: ModelShape, num_layers: int, world_size: int = 1):
    """A PretrainConfig of this shape on CPU (fp32, dropout off): one process, or each rank of
    an already started group timing on its own (data parallel, nothing shared)."""
    from megatron_weipipe.config import PretrainConfig, TrainingConfig
    from megatron_weipipe.model_config import ModelConfig

    model = ModelConfig.from_shape(replace(shape, num_layers=num_layers), hidden_dropout=0.0,
                                   attention_dropout=0.0, transformer_impl="local")
    training = TrainingConfig(micro_batch_size=shape.micro_batch_size,
                              global_batch_size=shape.micro_batch_size * world_size)
    return PretrainConfig(model=model, training=training, world_size=world_size)


class single_process_megatron:
    """Context: a one-rank gloo group and megatron-core's parallel state, torn down after
    (only what it set up itself)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.owned = False

    def __enter__(self):
        import torch.distributed as dist

        from megatron_weipipe.initialize import initialize_distributed

        self.owned = not dist.is_initialized()
        initialize_distributed(self.cfg)
        return self

    def __exit__(self, *exc):
        from megatron.core import parallel_state

        from megatron_weipipe.initialize import destroy_model_parallel_groups, shutdown_distributed

        if self.owned:
            shutdown_distributed()
        elif parallel_state.model_parallel_is_initialized():
            destroy_model_parallel_groups()  # their gloo threads would share the core with what is timed next
        return False


def calibrate(shape: ModelShape, layers_per_chunk: int, *, repeats: int = 5, threads: int = 1,
              time_optimizer: bool = True, min_seconds: float = 0.0) -> HostCalibration:
    """Time one microbatch of `shape` through a chunk of `layers_per_chunk` layers and the ends:
    `repeats` rounds, more while the rounds took less than `min_seconds` (a short sequence's
    timings are milliseconds each, and a few of them scatter by tens of percent).

    In a process whose group is already started (a link-testbed rank), every rank times on
    its own; time_optimizer=False there, since megatron-core DDP's step would all-reduce."""
    import torch
    import torch.distributed as dist

    from megatron_weipipe.model.gpt import build_gpt_model
    from megatron_weipipe.schedules.runtime.flat import FlatViews

    torch.set_num_threads(threads)
    shape.validate()
    k = layers_per_chunk
    cfg = pretrain_config_for(shape, k, dist.get_world_size() if dist.is_initialized() else 1)
    with single_process_megatron(cfg):
        vocab = shape.padded_vocab()
        model = build_gpt_model(cfg, vocab, pre_process=True, post_process=True)
        b, s, h = shape.micro_batch_size, shape.seq_length, shape.hidden_size
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, shape.vocab_size, (b, s), generator=gen)
        labels = torch.randint(0, shape.vocab_size, (b, s), generator=gen)
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        rotary = model.rotary_pos_emb(s) if shape.position_embedding_type == "rope" else None
        stack = _stack(list(model.decoder.layers), rotary)
        layout = FlatViews.from_module(stack)
        x0 = torch.randn(s, b, h, generator=gen)
        dy = torch.randn(s, b, h, generator=gen)
        token = torch.zeros(layout.numel)

        def megatron_backward(y, x, ws):  # autograd.backward: .grad, then DDP's hooks add it to main_grad
            torch.autograd.backward(y, dy)

        def weipipe_backward(y, x, ws):  # WeiPipeRuntime: one grad call, the result added to the token
            _, dw = torch.autograd.grad(y, [x] + ws, dy)
            token.add_(dw)

        probes = {
            "embed": _embedding_probe(model, tokens, positions),
            "module": _chunk_probe(lambda x, ws: stack(x), lambda: list(stack.parameters()), x0, dy,
                                   megatron_backward),
            "flat": _chunk_probe(
                lambda x, ws: torch.func.functional_call(stack, layout.views(ws[0]), (x,)),
                lambda: [layout.flatten(stack).requires_grad_(True)], x0, dy, weipipe_backward),
            "head": _head_probe(model, x0, labels),
        }
        if time_optimizer:  # wraps the model in megatron-core's DDP: its grad hooks then run in "module"
            probes["optimizer"], n_params = _optimizer_probe(cfg, model)
        _SHARE["wall"] = _SHARE["cpu"] = 0.0
        before = cpu_jiffies()
        samples = _rounds(probes, repeats, min_seconds)
        share = _SHARE["cpu"] / _SHARE["wall"] if _SHARE["wall"] > 0 else 1.0
        others = others_cores(before, cpu_jiffies(), share, os.cpu_count() or 1)
    medians = {key: {clock: statistics.median(t[i] for t in v) for i, clock in enumerate(("cpu", "wall"))}
               for key, v in samples.items()}
    if time_optimizer:
        medians["params"] = {"cpu": float(n_params), "wall": float(n_params)}
    spread = {key: round((max(t[0] for t in v) - min(t[0] for t in v)) / medians[key]["cpu"], 3)
              if medians[key]["cpu"] else 0.0 for key, v in samples.items()}
    cpu = {k: v["cpu"] for k, v in medians.items()}
    return HostCalibration(
        shape=shape, repeats=len(next(iter(samples.values()))), spread=spread, cpu_share=min(1.0, share),
        others_cores=others,
        host_cores=os.cpu_count() or 1, medians=medians,
        **calibration_fields(cpu, k, time_optimizer, float(n_params) if time_optimizer else 1.0),
    )


def _rounds(probes: dict, repeats: int, min_seconds: float = 0.0, most: int = 50) -> dict[str, list[float]]:
    """One warm-up, then rounds of every probe in turn, so that a drift in the machine's
    load (it is shared) hits every quantity alike: `repeats` of them, and more (up to
    `most`) while they have taken less than `min_seconds`."""
    for probe in probes.values():
        probe()
    out: dict[str, list] = {}
    start, done = time.perf_counter(), 0
    while done < repeats or (done < most and time.perf_counter() - start < min_seconds):
        for name, probe in probes.items():
            for key, t in probe().items():
                out.setdefault(f"{name}.{key}", []).append(t)
        done += 1
    return out


_SHARE = {"wall": 0.0, "cpu": 0.0}


def _clock(fn) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of fn; both are also summed to measure
    the share of a core the process got while the host was shared."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    _SHARE["wall"] += wall
    _SHARE["cpu"] += cpu
    return cpu, wall


def _embedding_probe(model, tokens, positions):
    import torch

    def probe() -> dict:
        out = {}
        box = {}
        out["forward"] = _clock(lambda: box.setdefault("y", model.embedding(input_ids=tokens, position_ids=positions)))
        y = box["y"]
        out["backward"] = _clock(lambda: y.backward(torch.ones_like(y)))
        return out

    return probe


def _chunk_probe(run, weights, x0, dy, full_backward):
    """Forward; full backward (as the runtime runs it); then again with an input-only pass
    and the weight pass after it."""
    import torch

    def probe() -> dict:
        out, box = {}, {}
        fwd = []
        for split in (False, True):
            x = x0.detach().requires_grad_(True)
            ws = weights()
            fwd.append(_clock(lambda: box.__setitem__("y", run(x, ws))))
            y = box["y"]
            if split:
                out["backward_input"] = _clock(lambda: torch.autograd.grad(y, [x], dy, retain_graph=True))
                out["backward_weight"] = _clock(lambda: torch.autograd.grad(y, ws, dy))
            else:
                out["backward"] = _clock(lambda: full_backward(y, x, ws))
        out["forward"] = min(fwd)
        return out

    return probe


def _head_probe(model, x0, labels):
    def probe() -> dict:
        box = {}
        xin = x0.detach().requires_grad_(True)
        f = _clock(lambda: box.__setitem__("loss", _head_loss(model, xin, labels)))
        return {"forward": f, "backward": _clock(lambda: box["loss"].backward())}

    return probe


def _stack(layers, rotary):
    """k TransformerLayers called in turn: WeiPipe's DecoderChunk without the RNG fork."""
    import torch

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)

        def forward(self, x):
            for layer in self.layers:
                x, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary)
            return x

    return Stack()


def _head_loss(model, hidden, labels):
    from megatron.core.utils import make_viewless_tensor

    norm = model.decoder.final_layernorm
    if norm is not None:
        hidden = make_viewless_tensor(inp=norm(hidden), requires_grad=True, keep_graph=True)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=None)
    return model.compute_language_model_loss(labels, logits).float().mean()


def _optimizer_probe(cfg, model):
    """megatron-core's optimizer after a backward: DDP's grad sync, norm, clip, Adam step,
    zeroing the buffers (what pretrain() runs once per iteration)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron_weipipe.schedules.gpt.megatron_schedules import ddp_config
    from megatron_weipipe.training.optimizer import build_optimizer

    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config(cfg), module=model)
    optimizer = build_optimizer(cfg, [ddp])
    params = list(model.parameters())

    def refill():
        with torch.no_grad():
            for p in params:
                p.main_grad.normal_(0, 1e-3)

    def step():
        ddp.finish_grad_sync()
        optimizer.prepare_grads()
        norm = optimizer.get_grad_norm()
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if opt.get_parameters():
                clip_grad_by_total_norm_fp32(opt.get_parameters(), max_norm=1.0, total_norm=norm)
        optimizer.step_with_ready_grads()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()

    def probe() -> dict:
        refill()
        return {"step": _clock(step)}

    return probe, sum(p.numel() for p in params)


def calibrate_concurrently(shape: ModelShape, layers_per_chunk: int, ranks: int, *,
                           repeats: int = 5) -> HostCalibration:
    """`ranks` processes calibrate at the same time, as the ranks of a run on this host
    compute at the same time; their medians are averaged. The structured fields hold CPU
    seconds (with the cache and memory contention of `ranks` processes in them); the wall
    seconds stay in `medians`, and `cpu_share` (the CPU each process got per wall second)
    tells the replay how much else ran."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spec = os.path.join(d, "shape.json")
        with open(spec, "w") as f:
            json.dump(asdict(shape), f)
        procs = []
        for i in range(ranks):
            env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(20000 + (os.getpid() * 7 + i) % 20000))
            out = os.path.join(d, f"cal{i}.json")
            procs.append((subprocess.Popen([sys.executable, "-m", _WORKER, spec,
                                            str(layers_per_chunk), str(repeats), out], env=env, cwd=_PACKAGE_PARENT,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out))
        cals = []
        for p, out in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError("calibration worker failed: " + (err.strip().splitlines() or ["?"])[-1])
            cals.append(load(out))
    keys = set.intersection(*(set(c.medians) for c in cals))
    medians = {k: {clock: statistics.mean(c.medians[k][clock] for c in cals) for clock in ("cpu", "wall")}
               for k in keys}
    first = cals[0]
    merged = replace(first, medians=medians, ranks=ranks,
                     cpu_share=statistics.mean(c.cpu_share for c in cals),
                     others_cores=statistics.mean(c.others_cores for c in cals))
    return merged.in_clock("cpu")


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host from /proc/stat ((0, 0) where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def others_cores(before: tuple[int, int], after: tuple[int, int], own_share: float, cores: int) -> float:
    """Cores other processes kept busy between two /proc/stat readings, own process excluded."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    return max(0.0, busy / total * cores - own_share)





_PINGPONG = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    rank, path, sizes, reps = int(sys.argv[1]), sys.argv[2], [int(v) for v in sys.argv[3].split(",")], int(sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
    out, cpu = {}, {}
    for n in sizes:
        t = torch.zeros(n // 4)
        for i in range(reps + 1):
            if i == 1:
                dist.barrier(); t0 = time.perf_counter(); c0 = time.process_time()
            if rank == 0:
                dist.send(t, 1); dist.recv(t, 1)
            else:
                dist.recv(t, 0); dist.send(t, 0)
        out[n] = (time.perf_counter() - t0) / reps / 2
        cpu[n] = (time.process_time() - c0) / reps / 2
    print(json.dumps({"time": out, "cpu": cpu}))
    dist.destroy_process_group()
""")


def gloo_link(small: int = 1 << 12, large: int = 1 << 24, reps: int = 10) -> LinkSpec:
    """Latency and bandwidth of one gloo message between two processes on this host."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        sizes = f"{small},{large}"
        procs = [subprocess.Popen([sys.executable, "-c", _PINGPONG, str(r), path, sizes, str(reps)],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                 for r in range(2)]
        outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    times = {int(k): v for k, v in outs[0]["time"].items()}
    t_small, t_large = times[small], times[large]
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 0.0)
    # CPU both processes spent per message byte (sender and receiver together)
    cpu = sum(o["cpu"][str(large)] for o in outs) / large
    return LinkSpec("gloo-loopback", bandwidth / 1e9, latency * 1e6, cpu_s_per_byte=cpu)


if __name__ == "__main__":  # worker of calibrate_concurrently: shape.json layers repeats out.json
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    with open(sys.argv[1]) as f:
        _shape = ModelShape(**json.load(f))
    save(calibrate(_shape, int(sys.argv[2]), repeats=int(sys.argv[3])), sys.argv[4])

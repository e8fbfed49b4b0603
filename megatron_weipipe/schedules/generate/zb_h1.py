"""Zero-bubble 1F1B (ZB-H1, Qi et al. 2023) as per-rank action lists: a baseline to compare with.

An activation pipeline whose backward is split into I (input gradient, what the stage
below waits for) and W (weight gradient, needed by nobody until the optimizer step). W
is deferred to fill the gaps 1F1B leaves idle, under 1F1B's peak memory: no stage holds
more than min(P, N) microbatches whose W has not run (1F1B's first stage holds that
many; a microbatch's activations are freed at its W), the bound of ZB-H1.

The order is built by list scheduling for given costs (default F = I = W = 1, the
setting ZB-H1 is drawn for; the simulator passes the stage's own; no wire time): whenever
a stage is free it runs the first ready of (1) the I of its oldest microbatch whose
output gradient has arrived, (2) the F of its next microbatch if its input has arrived
and the memory bound allows, (3) its oldest pending W. In the steady state that is F, I, W; in the cool-down the W's fill the time 1F1B
spends waiting for gradients. Nothing here trains: megatron-core has no split backward,
so the lists exist for the simulator (simulator/) and the validator, family "megatron".
"""

from __future__ import annotations

from megatron_weipipe.schedules.ir.actions import Action, Flow, Kind, Schedule, ScheduleError

NAME = "zb-h1"


def _order(P: int, N: int, costs: tuple[float, float, float]) -> list[list[tuple[str, int, float]]]:
    """Per stage, ("F" | "I" | "W", microbatch, start time) in execution order."""
    dur = dict(zip("FIW", costs))
    fwd_done = [[None] * N for _ in range(P)]  # when F(r, m) ends
    inp_done = [[None] * N for _ in range(P)]  # when I(r, m) ends
    nf, ni, nw = [0] * P, [0] * P, [0] * P
    clock = [0.0] * P
    out: list[list[tuple[str, int, float]]] = [[] for _ in range(P)]
    bound = min(P, N)
    eps = 1e-9 * max(costs)  # times are sums of floats along different paths

    def ready(r: int) -> tuple[str, float]:
        """The action stage r runs next if it starts at its clock, or ("", when to look again)."""
        t, later = clock[r], []
        m = ni[r]
        if m < nf[r]:
            at = 0.0 if r == P - 1 else inp_done[r + 1][m]
            if at is not None and at <= t + eps:
                return "I", t
            later.append(at)
        if nf[r] < N and nf[r] - nw[r] < bound:
            at = 0.0 if r == 0 else fwd_done[r - 1][nf[r]]
            if at is not None and at <= t + eps:
                return "F", t
            later.append(at)
        if nw[r] < ni[r]:
            return "W", t
        known = [x for x in later if x is not None]
        others = [clock[q] for q in range(P) if q != r and nw[q] < N and clock[q] > t + eps]
        return "", min(known + others, default=t)

    for _ in range(3 * N * P * (P + 2) + 8):
        live = [r for r in range(P) if nw[r] < N]
        if not live:
            return out
        r = min(live, key=lambda q: (clock[q], q))
        kind, t = ready(r)
        if not kind:
            clock[r] = t if t > clock[r] + eps else min(
                (clock[q] for q in live if clock[q] > clock[r] + eps), default=clock[r] + max(costs))
            continue
        m = {"F": nf, "I": ni, "W": nw}[kind][r]
        out[r].append((kind, m, t))
        clock[r] = t + dur[kind]
        if kind == "F":
            fwd_done[r][m] = clock[r]
            nf[r] += 1
        elif kind == "I":
            inp_done[r][m] = clock[r]
            ni[r] += 1
        else:
            nw[r] += 1
    raise ScheduleError(f"{NAME}: list scheduling did not finish (P={P}, N={N})")


def zb_h1_timeline(P: int, N: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Schedule:
    """ZB-H1 over P stages and N microbatches (one model chunk per stage), ordered for
    `costs` = (F, I, W) seconds of one stage (ticks: the order's unit-cost steps)."""
    if P < 1 or N < 1:
        raise ScheduleError(f"{NAME}: need P, N >= 1, got P={P} N={N}")
    if min(costs) < 0 or max(costs) <= 0:
        raise ScheduleError(f"{NAME}: costs (F, I, W) must be non-negative and not all zero, got {costs}")
    ranks = []
    for r, steps in enumerate(_order(P, N, costs)):
        acts: list[Action] = []
        for i, (kind, m, _) in enumerate(steps):
            t = i  # ticks only order a rank's actions (the async replay posts receives a tick ahead)
            if kind == "F":
                if r > 0:
                    acts.append(Action(Kind.RECV, r, t, mb=m, chunk=r, peer=r - 1, flow=Flow.ACTIVATIONS,
                                       tag=Flow.ACTIVATIONS.tag))
                acts.append(Action(Kind.FORWARD, r, t, mb=m, chunk=r))
                if r < P - 1:
                    acts.append(Action(Kind.SEND, r, t, mb=m, chunk=r, peer=r + 1, flow=Flow.ACTIVATIONS,
                                       tag=Flow.ACTIVATIONS.tag))
                else:
                    acts.append(Action(Kind.LOSS, r, t, mb=m, chunk=r))
            elif kind == "I":
                if r < P - 1:
                    acts.append(Action(Kind.RECV, r, t, mb=m, chunk=r, peer=r + 1, flow=Flow.ACTIVATION_GRADS,
                                       tag=Flow.ACTIVATION_GRADS.tag))
                acts.append(Action(Kind.BACKWARD_INPUT, r, t, mb=m, chunk=r))
                if r > 0:
                    acts.append(Action(Kind.SEND, r, t, mb=m, chunk=r, peer=r - 1, flow=Flow.ACTIVATION_GRADS,
                                       tag=Flow.ACTIVATION_GRADS.tag))
            else:
                acts.append(Action(Kind.BACKWARD_WEIGHT, r, t, mb=m, chunk=r))
        ranks.append(tuple(acts))
    return Schedule(name=NAME, family="megatron", num_ranks=P, num_chunks=P, microbatches=N, ranks=tuple(ranks))

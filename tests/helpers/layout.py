"""Ranks simulated by threads: a small in-memory all-reduce (``ThreadComm``), partitions cut the way
ZeRO stage 2 and 3 cut them, and the runs that step parameters whole or as those partitions."""
import math
import threading

import torch

from ds_q8.optim.layout import Comm, Segment, StateLayout, shared_blocks


class ThreadComm(Comm):
    """All-reduce between threads standing in for ranks."""

    def __init__(self, world, rank, shared):
        self.world, self.rank, self.shared = world, rank, shared

    def _reduce(self, t, fn):
        self.shared["buf"][self.rank] = t.detach().clone()
        self.shared["barrier"].wait()
        out = fn(torch.stack(self.shared["buf"]))
        self.shared["barrier"].wait()
        t.copy_(out)
        self.shared["calls"][self.rank] += 1

    def all_reduce_max(self, t):
        self._reduce(t, lambda s: s.max(dim=0).values)

    def all_reduce_sum(self, t):
        self._reduce(t, lambda s: s.sum(dim=0))


def run_ranks(world, body, shared):
    """``body(rank)`` in one thread per rank; the first error of any rank is raised here (the others are
    released from the barrier they wait at)."""
    errors = []

    def run(r):
        try:
            body(r)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def partitions(sizes, world, stage):
    """Per rank: [(param_index, param_start, numel, start_in_partition)] and the partition length."""
    out = [[] for _ in range(world)]
    if stage == 3:
        lengths = [0] * world
        for i, n in enumerate(sizes):
            part = math.ceil(n / world)
            for r in range(world):
                held = max(0, min(part, n - r * part))
                if held:
                    out[r].append((i, r * part, held, lengths[r]))
                lengths[r] += part
        return out, lengths
    total = sum(sizes)
    ps = math.ceil(total / world)
    offset = 0
    for i, n in enumerate(sizes):
        for r in range(world):
            a, b = max(r * ps, offset), min((r + 1) * ps, offset + n)
            if a < b:
                out[r].append((i, a - offset, b - a, a - r * ps))
        offset += n
    return out, [ps] * world


def make_params(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]


def grads_for(step, sizes):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) * 10.0 ** (step % 3 - 1) for n in sizes]


def run_plain(cls, sizes, steps, kw, bits=None):
    params = make_params(sizes)
    for p, b in zip(params, bits or [8] * len(sizes)):
        if b == 32:
            p.ds_q8_optim_bits = 32
    opt = cls(params, **kw)
    for s in range(steps):
        for p, g in zip(params, grads_for(s, sizes)):
            p.grad = g.clone()
        opt.step()
    return params, opt


def run_sharded(cls, sizes, world, stage, steps, kw, bits=None, setup=None):
    """Each 'rank' steps its flat partition in its own thread; returns the parameters reassembled
    plus each parameter's dequantized state, and the per-rank optimizers. ``setup(opt)`` runs on each
    rank's optimizer before its first step."""
    bits = bits or [8] * len(sizes)
    parts, lengths = partitions(sizes, world, stage)
    masters = make_params(sizes)
    group_kw = dict(kw)
    probe = cls([torch.nn.Parameter(torch.zeros(1))], **group_kw).param_groups[0]
    segs = []
    for r in range(world):
        segs.append([Segment(start, numel, i, pstart, sizes[i],
                             bits[i] == 8 and probe["optim_bits"] in (4, 8) and sizes[i] >= probe["min_8bit_size"],
                             f"p{i}") for i, pstart, numel, start in parts[r]])
    union = sorted({b for r in range(world) for b in shared_blocks(segs[r], probe["block_size"])})
    slots = {b: i for i, b in enumerate(union)}
    shared = {"buf": [None] * world, "barrier": threading.Barrier(world), "calls": [0] * world}
    flats, opts = [], []
    for r in range(world):
        flat = torch.nn.Parameter(torch.zeros(lengths[r]))
        for i, pstart, numel, start in parts[r]:
            flat.data[start:start + numel] = masters[i].data[pstart:pstart + numel]
        opt = cls([flat], **kw)
        layout = StateLayout(flat.shape, segs[r], probe["block_size"], comm=ThreadComm(world, r, shared),
                             slots=slots, num_slots=len(slots), num_params=len(sizes),
                             state_bits=4 if probe["optim_bits"] == 4 else 8)
        opt.register_layout(flat, layout)
        if setup is not None:
            setup(opt)
        flats.append(flat)
        opts.append(opt)

    def rank_loop(r):
        for s in range(steps):
            full = grads_for(s, sizes)
            g = torch.zeros(lengths[r])
            for i, pstart, numel, start in parts[r]:
                g[start:start + numel] = full[i][pstart:pstart + numel]
            flats[r].grad = g
            opts[r].step()

    run_ranks(world, rank_loop, shared)
    out = [torch.zeros(n) for n in sizes]
    states = [{name: torch.zeros(n) for name in opts[0].state_names} for n in sizes]
    for r in range(world):
        dq = opts[r].dequantized_state(flats[r])
        for i, pstart, numel, start in parts[r]:
            out[i][pstart:pstart + numel] = flats[r].data[start:start + numel]
            for name in dq:
                states[i][name][pstart:pstart + numel] = dq[name][start:start + numel]
    return out, states, opts, flats, shared


SIZES = [37, 300, 5, 129, 64, 1000, 77, 3]  # blocks of 64: most partition edges fall inside blocks
KW = dict(block_size=64, min_8bit_size=60)

"""The decode server's passes on its own team of spinning threads (``SpinTeam``) give what the fused
kernel gives called directly, bit for bit, for float and Q8_0 stacks and any number of threads:
packets driven from the host, as ``scripts/time_served_handoff.py`` drives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.engine import cpu_kernel

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="needs the fused CPU kernel (a C++ compiler)")

E, H, FFN, K = 6, 64, 96, 4


def stacks(fmt: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if fmt == "q8_0":
        q13 = torch.randint(-127, 128, (E, 2 * FFN, H), dtype=torch.int8, generator=g)
        q2 = torch.randint(-127, 128, (E, H, FFN), dtype=torch.int8, generator=g)
        d13 = (torch.rand(E, 2 * FFN, H // 32, generator=g) * 1e-3).to(torch.float16)
        d2 = (torch.rand(E, H, FFN // 32, generator=g) * 1e-3).to(torch.float16)
        return [q13, d13, q2, d2]
    return [(torch.randn(E, 2 * FFN, H, generator=g) * 0.05).to(torch.bfloat16),
            (torch.randn(E, H, FFN, generator=g) * 0.05).to(torch.bfloat16)]


def direct(fmt: str, w: list[torch.Tensor], x: torch.Tensor, rows: list[int], wt: list[float]) -> torch.Tensor:
    if fmt == "q8_0":
        return cpu_kernel.moe_decode_q8(x, *w, rows, wt)
    return cpu_kernel.moe_decode(x, w[0], w[1], rows, wt)


@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
@pytest.mark.parametrize("threads,own_team,chunks", [(1, True, 1), (3, True, 1), (4, True, 1), (3, False, 1),
                                                     (3, True, 4), (4, True, 3)])
def test_served_packets_equal_the_direct_kernel(fmt, threads, own_team, chunks):
    """``chunks``: each pass cut into that many parts per thread, taken in turn (the same sums)."""
    w = stacks(fmt)
    layers = []
    srv = cpu_kernel.server(threads, spin_us=200, own_team=own_team, chunks=chunks)
    for _ in range(2):
        bufs = [torch.zeros(2 * K + H), torch.zeros(1, dtype=torch.int64), torch.zeros(H),
                torch.zeros(1, dtype=torch.int64)]
        srv.add_layer(0 if fmt == "bf16" else 1, w, 0, 0, FFN, K, *bufs, *cpu_kernel.act_args(("silu",)))
        layers.append(bufs)
    srv.start()
    rng = np.random.default_rng(1)
    try:
        for step in range(1, 7):
            for packet, flag_in, out, flag_out in layers:
                n = int(rng.integers(0, K + 1))
                rows = [int(r) for r in rng.choice(E, size=n, replace=False)]
                wt = [float(v) for v in rng.random(n)]
                x = torch.from_numpy(rng.standard_normal(H).astype(np.float32))
                packet[:K] = -1.0
                packet[:n] = torch.tensor(rows, dtype=torch.float32)
                packet[K:K + n] = torch.tensor(wt)
                packet[2 * K:] = x
                flag_in.fill_(step)
                while int(flag_out[0]) != step:
                    pass
                want = direct(fmt, w, x, rows, wt) if n else torch.zeros(H)
                assert torch.equal(out, want), (step, n)
        assert srv.errors() == 0 and srv.served() == 12
    finally:
        srv.stop()
        cpu_kernel.server(1, chunks=1)  # the process-wide setting back to its default


@pytest.mark.parametrize("woken", [True, False])
def test_an_idle_server_waits_on_its_condition_and_still_serves(woken):
    """After ``idle_us`` without a packet the thread stops polling and waits on its condition (no
    wake-ups every 50 µs while a prompt runs or the app idles); a packet is still served, at once
    after ``wake`` and within its 1 ms wait without it; ``stop`` ends the thread while it waits."""
    import time

    w = stacks("bf16")
    srv = cpu_kernel.server(2, spin_us=100, own_team=True, idle_us=2000)
    packet, flag_in, out, flag_out = bufs = [torch.zeros(2 * K + H), torch.zeros(1, dtype=torch.int64),
                                             torch.zeros(H), torch.zeros(1, dtype=torch.int64)]
    srv.add_layer(0, w, 0, 0, FFN, K, *bufs, *cpu_kernel.act_args(("silu",)))
    srv.start()
    try:
        time.sleep(0.05)  # well past idle_us: waiting on the condition, 1 ms at a time
        waits = srv.idle_waits()
        assert 5 <= waits <= 60  # ~48 timed waits in 48 ms, not ~1,000 polls
        x = torch.ones(H)
        packet[:K] = -1.0
        packet[0], packet[K], packet[2 * K:] = 2.0, 0.5, x
        if woken:
            srv.wake()
        flag_in.fill_(1)
        t = time.perf_counter()
        while int(flag_out[0]) != 1:
            assert time.perf_counter() - t < 1.0, "the packet was not served"
        assert torch.equal(out, cpu_kernel.moe_decode(x, w[0], w[1], [2], [0.5]))
        assert srv.errors() == 0 and srv.served() == 1
    finally:
        t = time.perf_counter()
        srv.stop()
        assert time.perf_counter() - t < 0.5


def first_units(fmt: str, w: list[torch.Tensor], units: int) -> list[torch.Tensor]:
    """The stacks of the experts' first ``units`` intermediate units, as contiguous stacks of their own."""
    def rows13(t):
        return torch.cat([t[:, :units], t[:, FFN:FFN + units]], dim=1).contiguous()
    if fmt == "q8_0":
        q13, d13, q2, d2 = w
        return [rows13(q13), rows13(d13), q2[:, :, :units].contiguous(), d2[:, :, :units // 32].contiguous()]
    return [rows13(w[0]), w[1][:, :, :units].contiguous()]


@pytest.mark.parametrize("fmt,units", [("bf16", 40), ("bf16", FFN), ("q8_0", 32), ("q8_0", 64)])
def test_a_layer_set_to_its_first_units_computes_those_alone(fmt, units):
    """``set_units``: the thread computes each expert's first ``units`` intermediate units (the decode
    server's unit split; the accelerator adds the others), bit for bit what the direct kernel gives
    on stacks cut to those units; a units count off the blocks, or past ``I``, is refused."""
    w = stacks(fmt)
    part = first_units(fmt, w, units)
    bufs = [torch.zeros(2 * K + H), torch.zeros(1, dtype=torch.int64), torch.zeros(H), torch.zeros(1, dtype=torch.int64)]
    srv = cpu_kernel.server(3, spin_us=200, own_team=True)
    index = srv.add_layer(0 if fmt == "bf16" else 1, w, 0, 0, FFN, K, *bufs, *cpu_kernel.act_args(("silu",)))
    for bad in (0, FFN + 32, 31 if fmt == "q8_0" else -1):
        with pytest.raises(RuntimeError, match="units"):
            srv.set_units(index, bad)
    srv.set_units(index, units)
    packet, flag_in, out, flag_out = bufs
    srv.start()
    rng = np.random.default_rng(2)
    try:
        for step in range(1, 5):
            rows = [int(r) for r in rng.choice(E, size=step % K + 1, replace=False)]
            wt = [float(v) for v in rng.random(len(rows))]
            x = torch.from_numpy(rng.standard_normal(H).astype(np.float32))
            packet[:K] = -1.0
            packet[:len(rows)] = torch.tensor(rows, dtype=torch.float32)
            packet[K:K + len(rows)] = torch.tensor(wt)
            packet[2 * K:] = x
            flag_in.fill_(step)
            while int(flag_out[0]) != step:
                pass
            assert torch.equal(out, direct(fmt, part, x, rows, wt)), step
        assert srv.errors() == 0
    finally:
        srv.stop()

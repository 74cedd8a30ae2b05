"""Time the fused CPU kernel on an S1-like prompt CPU share against the cost model's CPU lane."""
import sys, time, numpy as np, torch
sys.path.insert(0, '/work/main')
from workbench.engine import cpu_kernel
from workbench.engine.calibrate import random_stacks
from workbench.core.costmodel import cpu_prompt_reads, prompt_pair_reads
from workbench.core.hardware import HardwareProfile
from workbench.engine.experts import _background_threads

prof = HardwareProfile.load(sys.argv[1])
fmt = sys.argv[2]
H, I, E = 2048, 768, 128
assert cpu_kernel.available()
st = random_stacks(fmt, E, H, I)
params = 3 * H * I
nbytes = params * (2 if fmt == 'bf16' else 34 / 32)
rate = prof.cpu_expert_throughput[fmt]
pair = prompt_pair_reads(prof, fmt.upper(), params, nbytes)
print('rate GB/s', rate / 1e9, 'pair_reads', pair, 'bg threads', _background_threads(), 'torch threads', torch.get_num_threads())
rng = np.random.default_rng(0)
x = torch.randn(512, H, dtype=torch.float32) * 0.1
if fmt == 'bf16':
    x = x.to(torch.bfloat16)

def call(rows, toks, w, bg):
    res = torch.empty(512, H, dtype=torch.float32)
    f = cpu_kernel.moe_decode if fmt == 'bf16' else cpu_kernel.moe_decode_q8
    f(x, *st, rows, w, background=bg, tokens=toks, out=res)
    if bg:
        cpu_kernel.wait()

for counts_desc, counts in [('8 experts x 16', np.full(8, 16)), ('40 experts x 1', np.full(40, 1)),
                            ('40 experts x 4', np.full(40, 4)), ('40 experts x 8', np.full(40, 8)),
                            ('40 experts x 16', np.full(40, 16)), ('S1 cold 40 (5-17)', rng.integers(5, 18, 40))]:
    experts = rng.choice(E, len(counts), replace=False)
    rows = torch.from_numpy(np.repeat(experts, counts).astype(np.int64))
    toks = torch.from_numpy(np.concatenate([rng.choice(512, c, replace=False) for c in counts]).astype(np.int64))
    w = torch.full((len(rows),), 0.1)
    pred = float((nbytes / rate * cpu_prompt_reads(counts, pair, gemm=False)).sum())
    for bg, name in ((0, 'fg'), (_background_threads(), 'bg')):
        call(rows, toks, w, bg)
        ts = []
        for _ in range(3):
            # touch other memory to evict caches
            t = time.perf_counter(); call(rows, toks, w, bg); ts.append(time.perf_counter() - t)
        print(f'{counts_desc:20s} {name} measured {1e3*min(ts):7.2f} ms  model {1e3*pred:7.2f} ms  ratio {min(ts)/pred:5.2f}')

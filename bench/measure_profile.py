"""Where a SNIP measurement's time goes, in process CPU time on one thread (llama_tiny, micro-batch
8: bench/overhead.py's model and measurement), per part, in BF16-step equivalents.

Timers wrap the measurement's parts: the passes (Megatron's schedule, hooks included), the
statistics hooks, the quantization errors, the noise blocks, the chunk Grams of ||G_W||^2 and the
AdamW statistics. With --bare the planned linears' hooks do nothing (no statistics, no noise):
what the passes alone cost, the floor of the method's two forward-backward passes.

    OMP_NUM_THREADS=1 python bench/measure_profile.py [rounds] [--bare]
"""
import sys, time, collections, functools, statistics
import torch
torch.set_num_threads(1)
from snip_megatron.config import SnipConfig
from snip_megatron.plan import Plan
from snip_megatron.stats import measure_step, noise, tokens, weights
from snip_megatron.stats import collector as C, measure as M, adam as A
from snip_megatron.train.config import TrainConfig
from snip_megatron.train.loop import Trainer
clk = time.process_time
T = collections.Counter()
ON = [True]
def timed(name, f):
    @functools.wraps(f)
    def w(*a, **k):
        s = clk()
        try: return f(*a, **k)
        finally: T[name] += clk() - s
    return w
def timed_gen(name, f):
    @functools.wraps(f)
    def w(*a, **k):
        it = f(*a, **k)
        while True:
            s = clk()
            try: v = next(it)
            except StopIteration: T[name] += clk() - s; return
            T[name] += clk() - s
            yield v
    return w
orig_plain = C._plain
C._plain = lambda fn, errors=None, where="": timed("hooks", orig_plain(fn, errors, where))
M._run_pass = timed("passes", M._run_pass)
M.adam.adam_statistics = timed("adam", A.adam_statistics)
ofe = M.formats_error_fn
M.formats_error_fn = lambda *a, **k: timed("quant_errors", ofe(*a, **k))
noise.NoiseField.chunks = timed_gen("noise", noise.NoiseField.chunks)
tokens.WgradNormEstimate.__init__ = timed("gw_grams", tokens.WgradNormEstimate.__init__)
if "--bare" in sys.argv:  # hooks that do nothing: the passes alone
    C.LinearProbe._pre = lambda self, m, a: None
    C.LinearProbe._post = lambda self, m, a, o: None
    C.LinearProbe.weight_stats = lambda self: None
tr = Trainer(TrainConfig(model="llama_tiny", steps=60, micro_batch_size=8, global_batch_size=8, eval_interval=None, progress=False))
snip = SnipConfig(); config = snip.measure_config()
n = tr.shape.num_layers
def step():
    tr.set_plan(Plan.uniform(n, "bf16")); s = clk(); tr.train_step(); return clk() - s
def meas():
    tr.set_plan(Plan.uniform(n, snip.initial_precision))
    tr.current_batch = tr.reader.take(tr.num_microbatches)
    s = clk()
    measure_step(tr, config)
    t = clk() - s; tr.current_batch = None; return t
step(); meas(); T.clear()
R = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 5
st, ms = [], []
for _ in range(R):
    st.append(step()); ms.append(meas())
S = statistics.median(st); Mm = statistics.median(ms)
print(f"BF16 step {S:.3f}s  measurement {Mm:.3f}s  ratio(median/median) {Mm/S:.2f}  ratio-of-medians {statistics.median([m/s for m,s in zip(ms,st)]):.2f}")
tot = sum(ms) / R
missing = [k for k in ("passes", "hooks", "quant_errors", "noise", "gw_grams", "adam") if not T[k]]
if missing and "--bare" not in sys.argv:  # a wrapped name moved: say so, do not print zeros
    raise SystemExit(f"measure_profile: no time recorded for {', '.join(missing)}; update the timers")
for k in ("passes", "hooks", "quant_errors", "noise", "gw_grams", "adam"):
    v = T[k] / R
    print(f"  {k:14s} {v:.3f}s  {v/S:.2f} steps  {v/tot*100:5.1f}% of measurement")

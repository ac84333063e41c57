"""Where a decode step's time goes for the full model and two Keyformer settings at 2k (Llama-MHA-350M shape, bf16,
batch 1), each Keyformer run twice in one process: ``.venv/bin/python assets/results/profile_decode.py``."""
import sys, time, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))
from skipkey.models import load
from skipkey.engine import Engine
from skipkey.config import GenerationSettings
from skipkey.kv_policies import make_kv_policy, parse_policy_spec

lm = load("random:llama-mha-350m", dtype="bfloat16")
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 30000, (2048,), generator=g).tolist()
settings = GenerationSettings(max_new_tokens=24, ignore_eos=True)
for spec in ["full", "keyformer", "keyformer:observe=8,pool=7", "keyformer", "keyformer:observe=8,pool=7"]:
    name, opts = parse_policy_spec(spec)
    kv = None if name == "full" else make_kv_policy(name, 0.5, **opts)
    eng = Engine(lm, kv=kv)
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for ev in eng.generate([prompt], settings):
            if ev.step > 0:
                times.append(ev.seconds)
    dec = sorted(times)[len(times)//2]
    print(f"== {spec}: decode median {dec*1000:.1f} ms/step, mean {sum(times)/len(times)*1000:.1f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

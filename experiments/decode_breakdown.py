"""Where a decode step's time goes, per KV policy: wall time inside each part of SkipKey's attention path,
summed over the layers and averaged over decode steps (the first three steps are left out).

    python -m experiments.decode_breakdown --batch 1 --prompt-tokens 2048 > assets/results/decode_breakdown_b1.txt

Each part is a public function of ``skipkey.core.attention`` / ``skipkey.kv.scoring`` / ``skipkey.core.cache`` / ``skipkey.core.kernels`` /
``skipkey.kv.policies`` wrapped with a timer (a few microseconds per call), on the Llama-MHA-350M shape (random
weights, bf16), one policy after another in one process. Parts nest: "attention" contains "write", "mask" (an
explicit mask built from positions), "SDPA" or "fused decode attention" (the C++ kernel's ``attend_score``: a
scoring policy's attention and score in one read, or an unscored evicting layer's attention alone), and the eager
path's "score contribution", which contains "Gumbel noise". "eviction" (the policy's ``evict``, or a sliding layer's
trim to its window) runs after each layer. The recorded ``decode_breakdown_b*.txt`` predate this column set (they
timed the engine's internals); rerun for today's.
A profile, not a benchmark: the speed ratios are bench's (lockstep); read this for where a step's milliseconds go.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time

import torch

import skipkey.core.attention as attention
import skipkey.kv.scoring as scoring
import skipkey.core.cache as cache
from skipkey.core import kernels
from skipkey.core.engine import Engine
from skipkey.config import GenerationSettings
from skipkey.kv.policies import make_kv_policy, parse_policy_spec
from skipkey.models import load
from skipkey.provenance import machine_description

spent: dict[str, float] = collections.defaultdict(float)
timing = [False]


def timed(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        if not timing[0]:
            return inner(*args, **kwargs)
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


PARTS = [(attention, "skipkey_attention", "attention"), (cache.LayerCache, "write", "write"),
         (attention, "allowed_keys", "mask"), (attention, "sdpa_attention_forward", "SDPA"),
         (scoring.ScoreContribution, "__call__", "score contribution"),
         (scoring, "gumbel_noise", "Gumbel noise"), (cache.LayerCache, "trim_to_window", "eviction")]


def timed_kernel(for_tensors):
    """``kernels.for_tensors`` hands out the compiled extension; time every ``attend_score`` call made on it
    (a scoring policy's decode attention and score, or an unscored evicting layer's attention alone)."""
    @functools.wraps(for_tensors)
    def wrapper(*tensors):
        fused = for_tensors(*tensors)
        if fused is None or not timing[0]:
            return fused

        class Timed:
            def __getattr__(self, name):
                return getattr(fused, name)

            def attend_score(self, *args):
                start = time.perf_counter()
                try:
                    return fused.attend_score(*args)
                finally:
                    spent["fused decode attention"] += time.perf_counter() - start
        return Timed()
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--policies", nargs="+",
                        default=["full", "window", "streaming", "h2o", "keyformer", "tova",
                                 "keyformer:observe=8,pool=7"])
    args = parser.parse_args()
    for owner, name, label in PARTS:
        timed(owner, name, label)
    kernels.for_tensors = timed_kernel(kernels.for_tensors)
    evicting = {next(c for c in type(make_kv_policy(spec.split(":")[0], 0.5)).__mro__ if "evict" in vars(c))
                for spec in args.policies if spec != "full"}
    for owner in evicting:  # the class that defines each policy's eviction, timed once
        timed(owner, "evict", "eviction")
    from transformers import AttentionInterface
    AttentionInterface.register(attention.ATTENTION_NAME, attention.skipkey_attention)  # the timed one

    lm = load("random:llama-mha-350m", dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.batch)]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    print(f"# {' '.join(sys.argv)}\n# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{machine_description(lm.device)}; llama-mha-350m bf16, batch {args.batch}, "
          f"prompt {args.prompt_tokens}, KV budget 50% unless the spec says; ms per decode step, summed over the 24 layers")
    labels = [label for _, _, label in PARTS] + ["fused decode attention"]
    print(f"{'policy':<32}{'step':>8}" + "".join(f"{label:>{max(9, len(label) + 2)}}" for label in labels))
    for spec in args.policies:
        name, options = parse_policy_spec(spec)
        budget = options.pop("budget", 0.5)  # ``window:budget=1.0``: the kernel with nothing evicted
        kv = None if name == "full" else make_kv_policy(name, budget, **options)
        engine = Engine(lm, kv=kv)
        spent.clear()
        steps = []
        for event in engine.generate(prompts, settings):
            timing[0] = event.step >= 3  # from the fourth decode step on
            if event.step > 3:
                steps.append(event.seconds)
        timing[0] = False
        n = len(steps)
        print(f"{spec:<32}{sum(steps) / n * 1e3:>8.1f}"
              + "".join(f"{spent[label] / n * 1e3:>{max(9, len(label) + 2)}.2f}" for label in labels), flush=True)


if __name__ == "__main__":
    main()

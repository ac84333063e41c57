"""Where a decode step's time goes, per KV policy: wall time inside each part of SkipKey's attention path,
summed over the layers and averaged over decode steps (the first three steps are left out).

    .venv/bin/python assets/results/decode_breakdown.py --batch 1 --prompt-tokens 2048 > assets/results/decode_breakdown_b1.txt

Each part is a function of ``skipkey.core.attention`` / ``skipkey.core.cache`` / ``skipkey.kv.policies`` / ``skipkey.core.engine``
wrapped with a timer (a few microseconds per call), on the Llama-MHA-350M shape (random weights, bf16), one policy
after another in one process. Parts nest: "attention" contains "write", "mask", "SDPA" or "decode attention + score",
and that contains "score contribution", which contains "Gumbel noise" (eager path only: the fused kernel of
``skipkey.core.kernels`` does both inside "decode attention + score"); "decode attention alone" is the same kernel without
the score (an unscored policy's evicting layers: window, streaming). "eviction" runs after each layer.
A profile, not a benchmark: the speed ratios are bench's (lockstep); read this for where a step's milliseconds go.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import skipkey.core.attention as attention  # noqa: E402
import skipkey.core.cache as cache  # noqa: E402
import skipkey.core.engine as engine_module  # noqa: E402
from skipkey.config import GenerationSettings  # noqa: E402
from skipkey.kv.policies import make_kv_policy, parse_policy_spec  # noqa: E402
from skipkey.models import load  # noqa: E402
from skipkey.provenance import machine_description  # noqa: E402

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
         (attention, "_mask_for_output", "mask"), (attention, "sdpa_attention_forward", "SDPA"),
         (attention, "_attend_and_score", "decode attention + score"),
         (attention, "_attend_fused", "decode attention alone"),
         (attention.ScoreContribution, "__call__", "score contribution"),
         (attention, "gumbel_noise", "Gumbel noise"), (engine_module._Retention, "after", "eviction")]


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
    from transformers import AttentionInterface
    AttentionInterface._global_mapping[attention.ATTENTION_NAME] = attention.skipkey_attention  # the timed one

    lm = load("random:llama-mha-350m", dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.batch)]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    print(f"# {' '.join(sys.argv)}\n# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{machine_description(lm.device)}; llama-mha-350m bf16, batch {args.batch}, "
          f"prompt {args.prompt_tokens}, KV budget 50% unless the spec says; ms per decode step, summed over the 24 layers")
    labels = [label for _, _, label in PARTS]
    print(f"{'policy':<32}{'step':>8}" + "".join(f"{label:>{max(9, len(label) + 2)}}" for label in labels))
    for spec in args.policies:
        name, options = parse_policy_spec(spec)
        budget = options.pop("budget", 0.5)  # ``window:budget=1.0``: the kernel with nothing evicted
        kv = None if name == "full" else make_kv_policy(name, budget, **options)
        engine = engine_module.Engine(lm, kv=kv)
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

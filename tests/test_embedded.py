"""The engine on the real embedded model (Gemma 3 270M): token-for-token what ``generate`` gives.

The first run on a machine converts the GGUF once (about 1.5 minutes); later runs load in seconds.
"""

import pytest
import torch

from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.quality.prompts import long_text_ids
from skipkey.core.trace import Trace

pytestmark = pytest.mark.embedded

PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(items):\n",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Ingredients for a chocolate cake: flour, sugar,",
]


@pytest.fixture(scope="module")
def embedded():
    from conftest import TEST_DEVICE
    from skipkey.core.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield load_model("embedded", device=TEST_DEVICE, dtype="float32", progress=False)
    torch.set_num_threads(threads)


def hf_greedy(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids], device=lm.device),
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
                            max_new_tokens=n, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = [lm.model.generation_config.eos_token_id]
    eos = eos[0] if isinstance(eos[0], list) else eos
    end = next((i for i, t in enumerate(new) if t in eos), None)
    return new if end is None else new[: end + 1]


def test_full_mode_matches_generate_on_embedded_model(embedded):
    prompts = [embedded.tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts.append(long_text_ids(embedded.tokenizer, 700))  # past Gemma's 512-token sliding window
    for ids in prompts:
        trace = Trace.collect(Engine(embedded), [ids], GenerationSettings(max_new_tokens=64))
        assert trace.tokens() == hf_greedy(embedded, ids, 64), f"prompt of {len(ids)} tokens"
        assert len(trace.tokens()) >= 8


def test_batch_rows_match_solo_on_embedded_model(embedded):
    settings = GenerationSettings(max_new_tokens=16)
    batch = Trace.collect(Engine(embedded), PROMPTS, settings)
    for row, prompt in enumerate(PROMPTS):
        assert batch.tokens(row) == Trace.collect(Engine(embedded), [prompt], settings).tokens()


def test_the_committed_adapter_fits_the_embedded_model_and_lowers_skipping_perplexity(embedded):
    """assets/skipdecode-lora loads onto the embedded model (the app's 'tuned weights') and does what it was
    trained for: the full model's own continuation is far more likely under the tuned skipping model."""
    from skipkey.serving.models import EMBEDDED_ADAPTER
    from skipkey.quality.evaluate import EvalConfig, perplexity_and_accuracy
    from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
    from skipkey.skipdecode.plan import make_skipdecode

    tuned = load_tuned(embedded, EMBEDDED_ADAPTER)
    policy, shapes = adapter_schedule(read_metadata(EMBEDDED_ADAPTER))  # served as trained
    assert tuned.model.get_input_embeddings().weight is embedded.model.get_input_embeddings().weight
    settings = GenerationSettings(max_new_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:3]
    reference = Trace.collect(Engine(embedded), prompts, settings)
    refs = [reference.tokens(r) for r in range(len(prompts))]
    skip = make_skipdecode(embedded.num_layers, 23, target=2.0, policy=policy, shapes=shapes)
    untuned_ppl, _ = perplexity_and_accuracy(embedded, EvalConfig(f"{policy} 2x", skip=skip), prompts, refs)
    tuned_ppl, _ = perplexity_and_accuracy(embedded, EvalConfig(f"{policy} 2x tuned", skip=skip, model=tuned),
                                           prompts, refs)
    assert tuned_ppl < untuned_ppl / 10, (tuned_ppl, untuned_ppl)


FILLER = [
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river runs past the old mill.", "A cat sleeps on the warm wall.", "The market opens at dawn.",
    "Clouds drift over the quiet hills.", "The baker lights the oven early.",
]


def secret_code_prompt(tokenizer) -> str:
    """About 1,020 tokens of filler with "The secret code is 58213." at about 40% depth, asked at the end."""
    import random

    rng = random.Random(0)

    def filler(tokens):
        parts, count = [], 0
        while count < tokens:
            sentence = rng.choice(FILLER)
            parts.append(sentence)
            count += len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
        return " ".join(parts)

    return filler(400) + " The secret code is 58213. " + filler(590) + "\nWhat is the secret code? The secret code is"


def test_query_aware_keyformer_keeps_the_whole_secret_code_at_half_the_cache(embedded):
    """The paper's Keyformer sums scores over every prompt query and may lose the digits the question needs
    (it answers "5."); the recommended options (the question's queries, pooled) keep all five."""
    from skipkey.kv.policies import RECOMMENDED_OPTIONS, make_kv_policy

    ids = embedded.tokenizer(secret_code_prompt(embedded.tokenizer))["input_ids"]
    assert 1000 <= len(ids) <= 1050
    settings = GenerationSettings(max_new_tokens=6)
    recorded = Engine(embedded).prompt_pass([ids])

    def answer(kv):
        return "".join(e.texts[0] for e in Engine(embedded, kv=kv).generate([ids], settings, prompt_pass=recorded))

    assert "58213" in answer(None)
    assert "58213" in answer(make_kv_policy("keyformer", 0.5, **RECOMMENDED_OPTIONS))
    paper = answer(make_kv_policy("keyformer", 0.5))  # allowed to lose it, and on this model it does
    assert "58213" not in paper

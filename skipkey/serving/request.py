"""The request edge: the controls declared once, and raw values made into one frozen request.

* ``Controls`` declares the controls once: each field is a control, in the
  order of the ``/compare`` API's parameters, with its default and its range.
  ``app.py`` adds how each looks (``app.WIDGETS``) and names the API from it;
  tests build it. Presets and examples are ``Controls`` values too.
* ``build_request`` is the edge: raw ``Controls`` (from the page or from any API
  client) become one frozen ``ComparisonRequest``, or an ``InputError`` that
  says what is allowed. The ranges are the library's own checks.
* ``AppLimits`` are the server's own caps (prompt tokens, seconds a request),
  from the environment; ``check_prompt`` refuses a prompt before anything runs.
* ``budget_summary`` and ``shown_options``: the prompt line and which options apply.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Mapping, Sequence

from skipkey.config import GenerationSettings, decode_steps, require_float, require_int
from skipkey.core.engine import Engine
from skipkey.core.loading import EMBEDDED, LoadedModel
from skipkey.errors import InputError
from skipkey.kv.policies import KV_POLICIES, KVPolicy, KVSpec, make_kv_policy, policy_options
from skipkey.skipdecode.exact import DEFAULT_DRAFT_VOCAB, DRAFT_K_CAP, ExactDecoding
from skipkey.skipdecode.plan import LAYER_POLICIES, SkipDecode, SkipDecodeSpec
from skipkey.skipdecode.schedules import SCHEDULE_KINDS

DECODING = ("greedy", "sample")
SET_BY = ("layers", "target speedup")
# The KV registry's policies, newest method first ("full" is the left column, not a choice).
KV_CHOICES = tuple(name for name in reversed(KV_POLICIES) if name != "full")
# The embedded model answers it right, full and at 1.5x tuned alike (the screenshot: the page at its defaults).
DEFAULT_PROMPT = "Photosynthesis is the process by which plants"
DEFAULT_NEW_TOKENS = 48  # light enough that the embedded model answers within seconds on a small CPU
DEFAULT_TARGET = 1.5  # SkipDecode's default nominal speedup (README, "SkipDecode fine-tuning": the frontier)
MAX_NEW_TOKENS_UI = 512
# Exact SkipDecode's draft head: the full LM head, or the rows of the most frequent tokens
# (skipkey.skipdecode.exact.DRAFT_VOCAB_FILE ranks them for the embedded model's tokenizer).
DRAFT_VOCAB_TOKENS = DEFAULT_DRAFT_VOCAB
DRAFT_HEADS: Mapping[str, int] = MappingProxyType({"full head": 0,
                                                   f"{DRAFT_VOCAB_TOKENS:,} most frequent tokens": DRAFT_VOCAB_TOKENS})
# Chosen on Spec-Bench's validation half (docs/results/exact.md, exact_val_length.json): k <= 3 with the 32k-token
# head and prompt lookup was the fastest (1.79x generate, bf16); k <= 4 and k <= 6 measured 1.72x, so the page offers
# k up to 4 only.
DEFAULT_DRAFT_K = ExactDecoding.draft_k
DEFAULT_DRAFT_HEAD = f"{DRAFT_VOCAB_TOKENS:,} most frequent tokens"
APP_DRAFT_K_MAX = 4


# -- the controls, declared once ----------------------------------------------------------
@dataclass(frozen=True)
class Control:
    """What serving knows of one of the ``Controls``: its range or choices, and whether it shapes the schedule.

    ``minimum``/``maximum`` bound a number, ``choices`` a choice: what the API accepts,
    checked for every control of every request (``check_controls``), used or not; a
    value within them may still be refused where it does not fit the model or the
    other settings (the library's checks, in ``build_request``). ``step`` is the
    page's slider step. ``preview``: the schedule preview redraws when it changes.
    How a control looks (widget, label, panel) is the page's business: ``app.WIDGETS``.
    """

    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple[str, ...] | None = None
    preview: bool = False

    def bounds(self) -> dict:
        """The range as keyword arguments (``minimum``, ``maximum``, ``step``, ``choices``), only those set."""
        given = dict(minimum=self.minimum, maximum=self.maximum, step=self.step, choices=self.choices)
        return {key: value for key, value in given.items() if value is not None}

    def check(self, name: str, kind: str, value):
        """``value`` as the control's type (``kind``: bool, str, int or float) within its range, or an
        InputError naming what is allowed. Numbers may come as text or as 6.0 for 6."""
        if kind == "bool":
            return _flag(name, value)
        if kind == "str":
            if not isinstance(value, str):
                raise InputError(f"{name} must be text, got {type(value).__name__}")
            return _choice(name, value, self.choices) if self.choices is not None else value
        if kind == "int":
            return require_int(name, as_number(value), int(self.minimum), _maybe_int(self.maximum))
        return require_float(name, as_number(value), self.minimum, self.maximum)


def _control(default, *, preview: bool = False, **bounds):
    return field(default=default, metadata={"control": Control(preview=preview, **bounds)})


def _maybe_int(value: float | None) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Controls:
    """The raw values of the page's controls, which are also ``/compare``'s parameters, in this order.

    Raw: as the page or an API client sends them (6.0 for 6, a string for a
    number); ``build_request`` checks them. Defaults are the page's, except that
    the page selects the layer policy the default model's adapter was trained
    with (``app.Handlers.defaults``). To add a control, add a field here (it
    appears in the API), a widget for it in ``app.WIDGETS`` (it appears on the
    page), and read it in ``build_request``.
    """

    prompt: str = _control(DEFAULT_PROMPT)
    model: str = _control(EMBEDDED, preview=True)
    max_new_tokens: int = _control(DEFAULT_NEW_TOKENS, preview=True, minimum=1, maximum=MAX_NEW_TOKENS_UI, step=1)
    decoding: str = _control("greedy", choices=DECODING)
    temperature: float = _control(0.8, minimum=0.05, maximum=2.0, step=0.05)
    seed: int = _control(0, minimum=0, maximum=2**31 - 1)
    skip_on: bool = _control(True)
    layer_policy: str = _control("top", preview=True, choices=LAYER_POLICIES)
    schedule: str = _control("linear", preview=True, choices=SCHEDULE_KINDS)
    set_by: str = _control("target speedup", preview=True, choices=SET_BY)
    b_max: int = _control(18, preview=True, minimum=2, maximum=64, step=1)
    b_min: int = _control(12, preview=True, minimum=2, maximum=64, step=1)
    horizon: int = _control(DEFAULT_NEW_TOKENS, preview=True, minimum=0, maximum=MAX_NEW_TOKENS_UI, step=1)
    warmup: int = _control(1, preview=True, minimum=0, maximum=63, step=1)
    exponent: float = _control(2.0, preview=True, minimum=0.25, maximum=4.0, step=0.25)
    target_speedup: float = _control(DEFAULT_TARGET, preview=True, minimum=1.0, maximum=32.0, step=0.05)
    kv_on: bool = _control(False)
    kv_policy: str = _control("keyformer", choices=KV_CHOICES)
    kv_budget_pct: float = _control(50, minimum=1, maximum=100, step=1)
    kv_recent_pct: float = _control(30, minimum=0, maximum=100, step=1)
    tau_init: float = _control(1.0, minimum=0.1, maximum=5.0, step=0.1)
    tau_end: float = _control(2.0, minimum=0.1, maximum=5.0, step=0.1)
    kv_observe: int = _control(0, minimum=0, maximum=512, step=1)
    kv_pool: int = _control(1, minimum=1, maximum=15, step=2)
    kv_normalize: bool = _control(False)
    tuned: bool = _control(True)
    hold: int = _control(0, preview=True, minimum=0, maximum=MAX_NEW_TOKENS_UI, step=1)
    exact: bool = _control(False)
    draft_k: int = _control(DEFAULT_DRAFT_K, minimum=1, maximum=APP_DRAFT_K_MAX, step=1)
    draft_head: str = _control(DEFAULT_DRAFT_HEAD, choices=tuple(DRAFT_HEADS))


CONTROLS: Mapping[str, Control] = MappingProxyType({f.name: f.metadata["control"] for f in fields(Controls)})
# Each control's type, as its field declares it: bool, str, int or float.
CONTROL_KINDS: Mapping[str, str] = MappingProxyType({f.name: str(f.type) for f in fields(Controls)})
assert set(CONTROL_KINDS.values()) <= {"bool", "str", "int", "float"}, CONTROL_KINDS
PREVIEW_CONTROLS = tuple(name for name, control in CONTROLS.items() if control.preview)


def check_controls(controls: Controls) -> Controls:
    """Every control's value checked against its declaration (type, range, choices), used by the settings or not,
    and typed (6.0 -> 6, "0.5" -> 0.5); the first one out of bounds is an InputError naming what is allowed."""
    return Controls(**{name: control.check(name, CONTROL_KINDS[name], getattr(controls, name))
                       for name, control in CONTROLS.items()})


@dataclass(frozen=True)
class ComparisonRequest:
    """One validated comparison: the prompt, how to decode, and SkipKey's two methods."""

    model: str
    prompt: str
    settings: GenerationSettings
    skip: SkipDecode | None
    kv: KVPolicy | None
    tuned: bool = False  # SkipKey's side decodes with the model's SkipDecode-tuned weights
    exact: ExactDecoding | None = None  # SkipDecode drafts, the full model verifies: the full model's tokens

    def hint(self) -> str:
        """What to try next, where the request shows one of the product's own additions."""
        if self.kv is not None and self.kv.name in ("h2o", "keyformer") and self.kv.prompt_observe:
            return (f" Set **observe** to 0 to see the paper's {self.kv.name}: it scores the prompt from every "
                    f"query and can drop what the question asks for.")
        return ""

    def describe(self) -> str:
        parts = [self.skip.describe() if self.skip else "no layer skipping",
                 f"KV {self.kv.describe()}" if self.kv else "full KV cache"]
        if self.exact:
            parts.insert(1, self.exact.describe())
        if self.tuned:
            parts.append("SkipDecode-tuned weights")
        return "; ".join(parts)


def as_number(value):
    """A numeric string from an API client as a number; anything else unchanged for the checks to refuse."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false, got {value!r}")
    return value


def _choice(name: str, value, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _percent(value):
    value = as_number(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value / 100
    return value


def _budget_percent(value):
    """The app's KV budget, a percentage of the prompt, as the library's fraction; above 100 is refused
    (as a fraction it would be a whole number, which the library reads as a token count)."""
    value = as_number(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 100:
        raise InputError(f"KV budget must be in (0, 100] % of the prompt, got {value}")
    return _percent(value)


def build_request(num_layers: int, controls: Controls, shapes: dict | None = None) -> ComparisonRequest:
    """The edge: raw control values -> a frozen ``ComparisonRequest``, or an ``InputError``.

    Every control is checked against its declaration first (``check_controls``: type,
    range, choices), whether the settings use it or not; then the library checks how
    the used ones fit the model and each other (``GenerationSettings``,
    ``SkipDecodeSpec``, ``KVSpec``). Here only the unit conversions (% -> fraction).
    For a constant schedule ``b_min`` is its number of layers. A target speedup takes
    the measured-best shape: ``shapes`` (the model's adapter's table, so that tuned and
    untuned weights run the same schedule) or ``schedules.MEASURED_SHAPES``.
    """
    c = check_controls(controls)
    sample = c.decoding == "sample"
    settings = GenerationSettings(max_new_tokens=c.max_new_tokens, do_sample=sample, temperature=c.temperature,
                                  seed=c.seed)
    skip = None
    if c.skip_on:
        gen_len = decode_steps(settings.max_new_tokens)
        common = dict(kind=c.schedule, policy=c.layer_policy, warmup=c.warmup, exponent=c.exponent)
        if c.set_by == "target speedup":
            spec = SkipDecodeSpec(target=c.target_speedup, policy=c.layer_policy, shapes=shapes)
        elif c.schedule == "constant":
            spec = SkipDecodeSpec(layers=c.b_min, **common)
        else:
            spec = SkipDecodeSpec(b_max=c.b_max, b_min=c.b_min, horizon=c.horizon, hold=c.hold, **common)
        skip = spec.build(num_layers, gen_len)
    kv = None
    if c.kv_on:
        try:
            options = dict(tau_init=c.tau_init, tau_end=c.tau_end, observe=c.kv_observe, pool=c.kv_pool,
                           normalize=c.kv_normalize)
            # Each method takes its own options; the page shows them all.
            known = policy_options(c.kv_policy)
            kv = KVSpec(c.kv_policy, _percent(c.kv_budget_pct), _percent(c.kv_recent_pct), seed=c.seed,
                        options={k: v for k, v in options.items() if k in known}).build()
        except InputError as error:
            raise InputError(f"{error} (the app's KV budget and recent window are in %: 50 means 0.5)") from None
    return ComparisonRequest(model=c.model, prompt=c.prompt, settings=settings, skip=skip, kv=kv, tuned=c.tuned,
                             exact=exact_decoding(c, skip, kv, sample))


def exact_decoding(c: Controls, skip: SkipDecode | None, kv: KVPolicy | None, sample: bool) -> ExactDecoding | None:
    """The exact-mode controls (checked: ``check_controls``) as an ``ExactDecoding`` (None when off), or an
    InputError saying why not."""
    if not c.exact:
        return None
    if skip is None:
        raise InputError("exact mode drafts with SkipDecode's layers: turn SkipDecode on (or turn exact off)")
    if kv is not None and kv.evicts:
        raise InputError(f"exact mode cannot be combined with KV eviction ({kv.describe()}): an evicted token "
                         "never comes back, so a rejected draft would change what the full model keeps; turn KV "
                         "eviction off (or turn exact off)")
    if sample:
        raise InputError("exact mode is greedy only: it keeps a draft where it equals the full model's greedy "
                         "token; set decoding to greedy (or turn exact off)")
    return ExactDecoding(c.draft_k, draft_vocab=DRAFT_HEADS[c.draft_head])


def preview_schedule(num_layers: int, controls: Controls, shapes: dict | None = None):
    """The schedule the controls describe and its decode steps, through the same edge as a run.

    Only the ``preview`` controls count: the rest are set so that nothing else is checked.
    """
    request = build_request(num_layers, dataclasses.replace(
        controls, prompt="", decoding="greedy", temperature=1.0, seed=0, skip_on=True, kv_on=False,
        tuned=False, exact=False), shapes)
    return request.skip.schedule, decode_steps(request.settings.max_new_tokens)


# -- the server's own limits --------------------------------------------------------------
MAX_PROMPT_TOKENS_ENV, REQUEST_SECONDS_ENV = "SKIPKEY_MAX_PROMPT_TOKENS", "SKIPKEY_REQUEST_SECONDS"


@dataclass(frozen=True)
class AppLimits:
    """What one request may ask of this server, whatever the model allows.

    ``max_prompt_tokens``: a longer prompt is refused before anything runs (the
    prompt pass is the request's largest single cost). ``request_seconds``: a run
    still going after this long is stopped, and says so. Both from the
    environment (``from_env``), so a shared Space can be tighter than a laptop.
    """

    max_prompt_tokens: int = 8192
    request_seconds: float = 600.0

    def __post_init__(self):
        if isinstance(self.max_prompt_tokens, bool) or not isinstance(self.max_prompt_tokens, int) \
                or not 1 <= self.max_prompt_tokens <= 10**7:
            raise InputError(f"the prompt-token cap must be an integer in 1..10000000, "
                             f"got {self.max_prompt_tokens!r}")
        seconds = self.request_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
            raise InputError(f"the request time limit must be a number of seconds in (0, 86400], got {seconds!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AppLimits":
        """``$SKIPKEY_MAX_PROMPT_TOKENS`` and ``$SKIPKEY_REQUEST_SECONDS`` (unset: the defaults)."""
        env = os.environ if env is None else env
        given = {}
        for name, variable, parse in (("max_prompt_tokens", MAX_PROMPT_TOKENS_ENV, int),
                                      ("request_seconds", REQUEST_SECONDS_ENV, float)):
            text = (env.get(variable) or "").strip()
            if text:
                try:
                    given[name] = parse(text)
                except ValueError:
                    raise InputError(f"{variable}={text!r} is not a number") from None
        try:
            return cls(**given)
        except InputError as error:
            raise InputError(f"{error} (from {MAX_PROMPT_TOKENS_ENV}, {REQUEST_SECONDS_ENV})") from None


def check_prompt(loaded: LoadedModel, prompt, max_new_tokens: int, limits: AppLimits) -> int:
    """The prompt's token count, or an InputError: empty, over the model's context, or over the server's cap.

    Tokenised as the engine does (``Engine.encode``), so the count is the one the run will see.
    """
    if not isinstance(prompt, str):
        raise InputError(f"prompt must be text, got {type(prompt).__name__}")
    count = len(Engine(loaded).encode([prompt], max_new_tokens)[0])
    if count > limits.max_prompt_tokens:
        raise InputError(f"the prompt has {count} tokens; this server takes at most {limits.max_prompt_tokens} "
                         f"(allowed: 1..{limits.max_prompt_tokens} prompt tokens, set by {MAX_PROMPT_TOKENS_ENV})")
    return count


def prompt_tokens(loaded: LoadedModel, prompt: str) -> int:
    """How many tokens ``prompt`` is, as the engine encodes it (0 for an empty one)."""
    return len(loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]) if prompt.strip() else 0


def budget_summary(prompt_token_count: int, controls: Controls) -> str:
    """The prompt's size, and what the KV controls keep of it in tokens, with a warning where that is nothing useful.

    Under a budget of ``k`` tokens the newest ``w`` always stay (the recent window) and the
    policy's scores choose the other ``k - w``; a budget no larger than its window leaves the
    scores nothing to choose (and a short prompt a budget of a few tokens).
    """
    text = f"Prompt: **{prompt_token_count}** tokens"
    if controls.kv_on is not True or prompt_token_count == 0:
        return text + " · full KV cache"
    try:
        policy = make_kv_policy(controls.kv_policy, _budget_percent(controls.kv_budget_pct),
                                _percent(controls.kv_recent_pct))
    except InputError as error:
        return f"{text} · KV: {error}"
    keep = policy.budget_tokens(prompt_token_count)
    recent = min(keep, policy.recent_tokens(keep))
    text += (f" · KV budget **{keep}** tokens: the newest **{recent}** (recent window) plus **{keep - recent}** "
             f"chosen by {policy.name}")
    if keep - recent < 1 and policy.name != "window":
        text += (f"  \n⚠ The budget keeps no more than its recent window: {policy.name}'s scores choose nothing "
                 f"here, so this runs as a sliding window. Raise the budget or lower the recent window.")
    return text


def shown_options(decoding, kv_policy) -> dict[str, bool]:
    """Which option controls apply to the chosen decoding and KV policy (the page hides the rest)."""
    known = set(policy_options(kv_policy)) if kv_policy in KV_POLICIES else set()
    return dict(temperature=decoding == "sample", tau_init="tau_init" in known, tau_end="tau_end" in known,
                kv_observe="observe" in known, kv_pool="pool" in known, kv_normalize="normalize" in known)


def fmt(value: float | None, pattern: str, missing: str = "–") -> str:
    """A number as the page writes it (``missing`` where there is none or it is not finite)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return pattern.format(value)

"""What a fine-tuning run is: ``FinetuneConfig``, validated once, and the settings a checkpoint must
share with the run that resumes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from skipkey.config import MAX_NEW_TOKENS_CAP, decode_steps, require_float, require_int
from skipkey.errors import InputError
from skipkey.skipdecode.adapter import APPLIES_AT, SAVE_DTYPES, SKIPPING_STEPS, applies_at
from skipkey.provenance import command_line
from skipkey.quality.prompt_file import read_prompts
from skipkey.skipdecode.plan import LAYER_POLICIES


# generic: ``prompts.training_prompts`` (topic templates, code openers, help text); categories:
# ``splits.train_category_prompts`` (the test set's categories, other texts). Anything else ``--prompts`` names is
# a prompts file people wrote (``skipkey.training.prompt_source``).
PROMPT_SETS = ("generic", "categories")
# top-k: KL over the teacher's stored top-k log-probs plus one bucket for the rest (a lower bound);
# full-vocab: the full model's whole distribution, recomputed at every position of every step.
KL_OVER = ("top-k", "full-vocab")
# batch: the ``importance`` policy ranks a batch's layers on all its prompts (as a batched engine does);
# prompt: each sequence's own ranking from its prompt alone (as the app and ``generate`` serve one prompt).
IMPORTANCE_FROM = ("batch", "prompt")


@dataclass(frozen=True)
class FinetuneConfig:
    """Everything that defines a run; ``command`` rebuilds the CLI line from it."""

    model: str = "embedded"
    out: str = "assets/skipdecode-lora"
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 8
    min_lr_ratio: float = 0.1
    rank: int = 8
    alpha: float = 16.0
    kl_weight: float = 1.0
    kl_over: str = "top-k"  # KL_OVER: the teacher's stored top-k (plus a bucket), or its full vocabulary online
    targets: tuple[float, ...] = (1.5, 3.0)  # one value: fixed; two: uniform range, drawn per batch
    skip_policy: str = "top"  # the layer policy in the forward pass (and the one the adapter is for)
    importance_from: str = "batch"  # IMPORTANCE_FROM: rank layers on the batch's prompts, or on each prompt alone
    gen_len: int = 64  # continuation tokens; the schedule covers their decode steps
    sequences: int = 320  # the full model's continuations of training prompts
    prompts: str = "generic"  # PROMPT_SETS, or a prompts file: which training prompts those continue
    prompts_sha256: str | None = None  # a prompts file's SHA-256: read from it, or given and then checked against it
    spec_bench: str | None = None  # the Spec-Bench questions a prompts file must not meet (default: beside the repo)
    overlap_check: bool = True  # False (--no-overlap-check): a prompts file trains unchecked, and the adapter says so
    text_sequences: int = 0  # windows of offline text (help topics, stdlib source), the teacher's log-probs on them
    text_prompt_len: int = 32  # a text window's tokens before its continuation
    max_prompt_tokens: int = 0  # a longer prompt is continued from its last tokens (with its BOS); 0 = whole prompts
    full_depth_share: float = 0.0  # share of batches run at full depth: keeps the tuned model's every-layer path
    applies_at: str = SKIPPING_STEPS  # where the delta applies: only at skipping steps, or at every step
    min_skipped: int = 1  # a skip-only adapter applies at steps that skip at least this many layers
    train_dtype: str | None = None  # the student's dtype (default: --dtype); the teacher data stays in --dtype
    seed: int = 0
    init_adapter: str | None = None  # start from this adapter's LoRA weights (same modules, policy, gating, scale)
    shapes_from: str | None = None  # train with this adapter's serving shapes (default: MEASURED_SHAPES)
    save_dtype: str = "float32"  # the stored LoRA weights' dtype (SAVE_DTYPES)
    checkpoint_every: int = 10
    device: str | None = None
    dtype: str = "float32"

    def __post_init__(self):
        require_int("steps", self.steps, 1, 1_000_000)
        require_int("batch_size", self.batch_size, 1, 256)
        require_float("lr", self.lr, 0.0, 1.0, lo_open=True)
        require_int("warmup_steps", self.warmup_steps, 0, 1_000_000)
        require_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        require_int("rank", self.rank, 1, 1024)
        require_float("alpha", self.alpha, 0.0, 1e4, lo_open=True)
        require_float("kl_weight", self.kl_weight, 0.0, 100.0)
        require_int("gen_len", self.gen_len, 2, MAX_NEW_TOKENS_CAP)
        require_int("sequences", self.sequences, 0, 1_000_000)
        require_int("text_sequences", self.text_sequences, 0, 1_000_000)
        if self.sequences + self.text_sequences < self.batch_size:
            raise InputError(f"sequences + text_sequences must be at least the batch size ({self.batch_size}), "
                             f"got {self.sequences} + {self.text_sequences}")
        require_int("text_prompt_len", self.text_prompt_len, 1, 4096)
        if self.max_prompt_tokens:
            require_int("max_prompt_tokens", self.max_prompt_tokens, 2, 1_000_000)
        require_float("full_depth_share", self.full_depth_share, 0.0, 1.0)
        if self.skip_policy not in LAYER_POLICIES:
            raise InputError(f"skip_policy must be one of {', '.join(LAYER_POLICIES)}, got {self.skip_policy!r}")
        if self.applies_at not in APPLIES_AT:
            raise InputError(f"applies_at must be one of {', '.join(APPLIES_AT)}, got {self.applies_at!r}")
        require_int("min_skipped", self.min_skipped, 1, 1024)
        if self.applies_at != SKIPPING_STEPS and self.min_skipped != 1:
            raise InputError("--min-skipped is for an adapter applied at skipping steps only")
        if self.applies_at == SKIPPING_STEPS and self.full_depth_share:
            raise InputError("--full-depth-share trains the full-depth path, which an adapter applied only at "
                             "skipping steps leaves as the original model; use it with --applies-at every-step")
        require_int("seed", self.seed, 0, 2**31 - 1)
        self._check_prompts()
        for name, value, allowed in (("kl_over", self.kl_over, KL_OVER),
                                     ("importance_from", self.importance_from, IMPORTANCE_FROM)):
            if value not in allowed:
                raise InputError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.importance_from != "batch" and self.skip_policy != "importance":
            raise InputError("--importance-from is for --skip-policy importance")
        if self.save_dtype not in SAVE_DTYPES:
            raise InputError(f"save_dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        require_int("checkpoint_every", self.checkpoint_every, 1, 1_000_000)
        targets = tuple(float(require_float("target", t, 1.0, 100.0)) for t in self.targets)
        if len(targets) not in (1, 2) or targets[0] > targets[-1]:
            raise InputError(f"targets must be one speedup (fixed) or two, low then high (a range), got {self.targets}")
        object.__setattr__(self, "targets", targets)

    def _check_prompts(self) -> None:
        """A prompt set by name, or a prompts file that reads (``read_prompts``' refusals, naming file and line),
        holds ``sequences`` prompts and, where ``prompts_sha256`` is given, is that file still. Whether it meets
        Spec-Bench's test half is checked before a run starts (``prompt_source.check_prompt_file``)."""
        is_file = self.prompts not in PROMPT_SETS
        for name, value in (("--prompts-sha256", self.prompts_sha256), ("--spec-bench", self.spec_bench),
                            ("--no-overlap-check", not self.overlap_check)):
            if value and not is_file:
                raise InputError(f"{name} is for a prompts file (--prompts FILE), not the prompt set {self.prompts!r}")
        if not self.overlap_check and self.spec_bench:
            raise InputError("--spec-bench and --no-overlap-check exclude each other")
        if not is_file:
            return
        if not Path(self.prompts).exists():
            raise InputError(f"prompts must be one of {', '.join(PROMPT_SETS)} or a prompts file (Spec-Bench JSONL "
                             f"or plain text); there is no file {self.prompts!r}")
        file = read_prompts(self.prompts)
        if self.prompts_sha256 not in (None, file.sha256):
            raise InputError(f"prompts file {self.prompts} has SHA-256 {file.sha256}, not {self.prompts_sha256} "
                             "(--prompts-sha256): it is another file than the one asked for")
        object.__setattr__(self, "prompts_sha256", file.sha256)
        if self.sequences > len(file.records):
            raise InputError(f"--sequences {self.sequences} asks for more prompts than {self.prompts} holds "
                             f"({len(file.records)})")

    @property
    def schedule_steps(self) -> int:
        return decode_steps(self.gen_len)

    def command(self) -> str:
        """The CLI line that makes this run (every setting spelled out)."""
        args = ["finetune"]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value is True:  # unset, or a switch left on
                continue
            flag = "--" + f.name.replace("_", "-")
            if value is False:
                args.append("--no-" + f.name.replace("_", "-"))
            else:
                args += [flag, *map(str, value)] if isinstance(value, tuple) else [flag, str(value)]
        return command_line(args)


def _resume_key(cfg: FinetuneConfig) -> dict:
    """The settings a checkpoint must share with the run that resumes it: a prompts file by its SHA-256 (its
    contents, wherever it lies now); the overlap check's settings change no data."""
    key = {k: v for k, v in asdict(cfg).items()
           if k not in ("checkpoint_every", "device", "save_dtype", "spec_bench", "overlap_check")}
    if cfg.prompts_sha256:
        key["prompts"] = "a prompts file"
    return key

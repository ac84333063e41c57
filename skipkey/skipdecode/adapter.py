"""SkipDecode LoRA adapters as files: their metadata, whether one fits a model, and ``load_tuned``.

An adapter directory holds peft's files plus ``skipkey_adapter.json`` (base
model and its fingerprint, schedule range, data, steps, losses, command).
``skipkey.training.finetune`` writes them; serving only reads them, through this module,
so it never imports the training code.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings
from pathlib import Path

import torch

from skipkey.core.architectures import cached_architecture, get_architecture
from skipkey.errors import InputError, ModelLoadError
from skipkey.core.loading import LoadedModel
from skipkey.skipdecode.schedules import ScheduleShape, shapes_from_json, shapes_to_json

ADAPTER_FORMAT = "skipkey-skipdecode-lora/1"
METADATA_FILE = "skipkey_adapter.json"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
TUNED_SUFFIX = "+skipdecode-lora"
# Where an adapter's delta applies (metadata ``lora.applies_at``). "skipping-steps": only at decode steps
# that skip layers, so the prompt pass and full-depth steps are the original model exactly. "every-step":
# merged everywhere (adapters from before the distinction; their full-depth path moves too).
EVERY_STEP, SKIPPING_STEPS = "every-step", "skipping-steps"
APPLIES_AT = (EVERY_STEP, SKIPPING_STEPS)
SAVE_DTYPES = ("float32", "bfloat16")  # how the LoRA weights are stored; serving merges them in its own dtype
WEIGHTS_RTOL = 1e-3  # casting to bf16 moves the layer-0 checksum by ~3e-5; other weights move it far more


@contextlib.contextmanager
def peft_without_deprecation_noise():
    """peft probes ``model.is_gradient_checkpointing``, which transformers 5 deprecated in favour of
    ``is_activation_checkpointing``: one FutureWarning per wrap or load that the user can do nothing about.
    Silence that one warning, by its text, and nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def fingerprint(model) -> dict:
    """What identifies a base model: its shape, and a checksum of layer 0's weights (dtype-robust)."""
    cfg = model.config.get_text_config()
    layer0 = get_architecture(model).layers[0]
    return {
        "model_type": cfg.model_type,
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(cfg.vocab_size),
        "num_attention_heads": int(cfg.num_attention_heads),
        "layer0_abs_sum": float(sum(p.detach().double().abs().sum() for p in layer0.parameters())),
    }


def lora_targets(model) -> list[str]:
    """Names of the linear projections inside a decoder layer (attention and MLP) in this family."""
    layer = get_architecture(model).layers[0]
    return sorted({name.rsplit(".", 1)[-1] for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)})


def save_adapter(peft_model, out: str | Path, metadata: dict, dtype: str = "float32") -> None:
    """peft's files (the LoRA weights stored in ``dtype``, one of ``SAVE_DTYPES``) and ``metadata``."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config["default"].base_model_name_or_path = metadata["base_model"]
    peft_model.save_pretrained(str(out), save_embedding_layers=False)  # none trained; skips a Hub lookup
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    save_file({k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in state.items()},
              str(out / PEFT_FILES[1]), metadata={"format": "pt"})  # as peft writes it, in the dtype asked for
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template; the metadata says it all
    (out / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")


def adapter_megabytes(directory: str | Path) -> float:
    return sum(f.stat().st_size for f in Path(directory).iterdir() if f.is_file()) / 2**20


def read_metadata(adapter_dir: str | Path) -> dict:
    """The adapter's ``skipkey_adapter.json``, or a clear error about what is missing."""
    directory = Path(adapter_dir).expanduser()
    if not directory.is_dir():
        raise InputError(f"adapter directory {str(adapter_dir)!r} does not exist; pass the folder "
                         "`python -m skipkey finetune` wrote (e.g. assets/skipdecode-lora)")
    missing = [name for name in (METADATA_FILE, *PEFT_FILES) if not (directory / name).is_file()]
    if missing:
        raise ModelLoadError(f"{directory} is not a SkipDecode adapter: {', '.join(missing)} missing "
                             "(make one with `python -m skipkey finetune`)")
    try:
        meta = json.loads((directory / METADATA_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"Cannot read {directory / METADATA_FILE}: {error}") from error
    if not isinstance(meta, dict) or meta.get("format") != ADAPTER_FORMAT:
        raise ModelLoadError(f"{directory / METADATA_FILE} is not in the format {ADAPTER_FORMAT!r}")
    return meta


def applies_at(meta: dict) -> tuple[str, int]:
    """Where the adapter's delta applies: ``SKIPPING_STEPS`` or ``EVERY_STEP`` (older adapters), and the fewest
    layers a step must skip for it to apply there."""
    lora = meta.get("lora") or {}
    where, min_skipped = lora.get("applies_at", EVERY_STEP), lora.get("min_skipped", 1)
    if where not in APPLIES_AT:
        raise ModelLoadError(f"the adapter applies at {where!r}; this SkipKey knows {', '.join(map(repr, APPLIES_AT))}")
    if not isinstance(min_skipped, int) or isinstance(min_skipped, bool) or min_skipped < 1:
        raise ModelLoadError(f"the adapter's min_skipped must be a whole number from 1, got {min_skipped!r}")
    return where, min_skipped


def adapter_schedule(meta: dict) -> tuple[str, dict]:
    """(layer policy, shape table) to serve the adapter with, for ``make_skipdecode(shapes=...)``.

    The shapes a shape study of the tuned model measured best (``schedule.serving_shapes``,
    written by ``record_serving_shapes``) where there are some, else the shapes it was
    trained with (``schedule.shapes``). Adapters from before shapes were measured name a
    kind and a warm-up: they were trained with the paper's shape (``b_max = L``, the
    lowest ``b_min``).
    """
    schedule = meta.get("schedule") or {}
    policy = schedule.get("policy", "top")
    for key in ("serving_shapes", "shapes"):
        if key in schedule:
            return policy, shapes_from_json(schedule[key])
    shape = ScheduleShape(schedule.get("kind", "linear"), warmup=schedule.get("warmup", 1), top=1.0, floor=0.0)
    return policy, {policy: ((1.0, shape),)}


def trained_schedule(meta: dict) -> dict:
    """The metadata's schedule as training wrote it: what identifies the adapter's training, without the
    serving shapes a later study recorded."""
    return {k: v for k, v in (meta.get("schedule") or {}).items() if k not in ("serving_shapes", "serving_shapes_from")}


def record_serving_shapes(adapter_dir: str | Path, table: dict, source: dict) -> None:
    """Write ``table`` (policy -> [(target, shape)], for the adapter's own policy) into the adapter's metadata as
    the shapes to serve it with, and ``source`` (the study's command, date, machine) beside them."""
    meta = read_metadata(adapter_dir)
    policy = meta.get("schedule", {}).get("policy", "top")
    if set(table) != {policy}:
        raise InputError(f"the adapter was trained for the {policy} policy; serving shapes for "
                         f"{', '.join(sorted(table)) or 'no policy'} do not apply to it")
    meta.setdefault("schedule", {})
    meta["schedule"]["serving_shapes"] = shapes_to_json(table)
    meta["schedule"]["serving_shapes_from"] = source
    (Path(adapter_dir).expanduser() / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def check_compatible(meta: dict, loaded, where: str | Path = "the adapter") -> None:
    """Refuse an adapter trained for another model (name, shape or weights)."""
    trained_for = meta.get("base_model")
    if trained_for != loaded.name:
        raise ModelLoadError(f"the adapter in {where} was trained for model {trained_for!r}, not {loaded.name!r}; "
                             f"load it with --model {trained_for}")
    expected, actual = meta.get("base_fingerprint") or {}, fingerprint(loaded.model)
    shape = [f"{k} {expected.get(k)} there, {actual[k]} here" for k in actual
             if k != "layer0_abs_sum" and expected.get(k) != actual[k]]
    if shape:
        raise ModelLoadError(f"the adapter in {where} does not fit this {loaded.name!r} model: {'; '.join(shape)}")
    checksum = expected.get("layer0_abs_sum")
    if checksum is None or not math.isclose(checksum, actual["layer0_abs_sum"], rel_tol=WEIGHTS_RTOL):
        raise ModelLoadError(f"the adapter in {where} was trained on other weights than this {loaded.name!r} "
                             f"(layer-0 checksum {checksum} there, {actual['layer0_abs_sum']:.6g} here)")


def _copy_for_merge(model, target_modules: list[str]):
    """A copy of ``model`` whose LoRA-targeted weights are its own; every other tensor is shared.

    The embedding (a 262k-row table for Gemma 3) is most of a small model and no
    adapter touches it, so the tuned copy costs only the decoder layers' memory.
    """
    targeted = {id(m.weight) for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules}
    memo = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in targeted}
    arch = cached_architecture(model)
    if arch is not None:
        memo[id(arch)] = None  # the copy gets its own architecture on first use
    return copy.deepcopy(model, memo)


def whole_model_needed(name: str) -> str:
    """Why an adapter is refused for a model placed with a device map."""
    return (f"A SkipDecode adapter is merged into a copy of the whole model, which {name!r} placed with a device "
            "map does not hold in memory; load it without a device map")


def load_tuned(loaded, adapter_dir: str | Path):
    """A NEW ``LoadedModel``: ``loaded``'s weights with the SkipDecode LoRA adapters merged in.

    Refuses an adapter trained for another model. Named ``<name>+skipdecode-lora``;
    ``loaded`` itself is unchanged, and the two share every tensor the adapters
    do not touch. A skip-only adapter (``applies_at`` "skipping-steps") keeps
    ``loaded.model`` as the new model's ``full_depth`` weights: the engine runs
    the prompt pass and every step that skips fewer than ``min_skipped`` layers
    on them, the others on the merged copy (swapping costs nothing: both are
    resident).
    """
    from peft import PeftModel

    if loaded.placement is not None:
        raise InputError(whole_model_needed(loaded.name))
    meta = read_metadata(adapter_dir)
    directory = Path(adapter_dir).expanduser()
    check_compatible(meta, loaded, directory)
    where, min_skipped = applies_at(meta)
    model = _copy_for_merge(loaded.model, meta.get("lora", {}).get("target_modules") or lora_targets(loaded.model))
    try:
        with peft_without_deprecation_noise():
            merged = PeftModel.from_pretrained(model, str(directory), is_trainable=False).merge_and_unload()
    except Exception as error:  # peft raises many kinds, with long text
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ModelLoadError(f"Could not apply the adapter in {directory}: {first}") from error
    merged.eval()
    merged.requires_grad_(False)
    return LoadedModel(model=merged, tokenizer=loaded.tokenizer, name=f"{loaded.name}{TUNED_SUFFIX}",
                       device=loaded.device, dtype=loaded.dtype,
                       full_depth=loaded.model if where == SKIPPING_STEPS else None,
                       min_skipped=min_skipped if where == SKIPPING_STEPS else 1)

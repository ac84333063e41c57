"""docs/deploy.md's table of the model families SkipKey runs: each supported model type, the architecture that runs
it and a small Hub model of it for ``SKIPKEY_MODELS``, then the types refused with a reason, all read from
``skipkey.core.architectures`` and ``skipkey.serving.models.SUGGESTED_MODELS``.

    python -m experiments.families

prints the markdown; ``tests/test_repo.py`` fails when the document's copy differs.
"""

from __future__ import annotations

from skipkey.core.architectures import ARCHITECTURES, REFUSED_TYPES
from skipkey.serving.models import SUGGESTED_MODELS

NO_CHECKPOINT = "none known to fit (one whose layers share KV, take per-layer inputs or route to experts is refused)"


def table() -> str:
    rows = ["| model type | runs as | a small Hub model of it |", "|---|---|---|"]
    for architecture in ARCHITECTURES:
        for model_type in architecture.families:
            model = SUGGESTED_MODELS[model_type]
            rows.append(f"| `{model_type}` | `{architecture.__name__}` | {f'`{model}`' if model else NO_CHECKPOINT} |")
    refused = ", ".join(f"`{model_type}`" for model_type in REFUSED_TYPES)
    return "\n".join(rows) + f"\n\nRefused with the reason in the error: {refused}; any other type is refused too."


if __name__ == "__main__":
    print(table())

"""SkipKey: SkipDecode early exit and Keyformer KV-cache eviction, alone or together."""

from skipkey.errors import InputError, ModelLoadError

__all__ = ["InputError", "ModelLoadError"]

"""The draft head's vocabulary (FR-Spec, arXiv 2502.14856): the token ids a draft may propose, most frequent first.

FR-Spec counts the tokens a model generates. The ranking shipped for the embedded model
(``assets/skipdecode-lora/draft_vocab.json``) counts the full model's own greedy
continuations of prompts people wrote, never the test half of the benchmark
(``python -m experiments.draft_vocab``; the file says what it counted). A file records the
SHA-256 of its tokens' strings, so it never serves another tokenizer. A model without one
ranks its tokens by id: byte-pair and unigram vocabularies list their frequent pieces
first, which is the best guess that costs nothing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

DEFAULT_DRAFT_VOCAB = 32768  # the draft head's rows where none is named (docs/results/exact.md)
DRAFT_VOCAB_FILE = Path(__file__).resolve().parents[2] / "assets" / "skipdecode-lora" / "draft_vocab.json"
FORMAT = "skipkey-draft-vocab/2"


def tokenizer_digest(tokenizer, ids: Sequence[int]) -> str:
    """Identifies a ranking's tokens: the SHA-256 of their strings, so a file never serves another tokenizer."""
    return hashlib.sha256("\n".join(map(str, tokenizer.convert_ids_to_tokens(list(ids)))).encode()).hexdigest()


def write_ranking(path: Path, tokenizer, vocab_size: int, counts: Sequence[int], keep: int, counted_on: dict) -> dict:
    """Store the ``keep`` ids with the highest ``counts`` (ties by id) and what identifies them."""
    order = sorted(range(vocab_size), key=lambda t: (-counts[t], t))[:keep]
    record = {"format": FORMAT, "vocab_size": vocab_size, "counted_on": counted_on,
              "tokens_sha256": tokenizer_digest(tokenizer, order), "ids": order}
    Path(path).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return record


def shipped_ranking(tokenizer, vocab_size: int, path: Path = DRAFT_VOCAB_FILE) -> list[int] | None:
    """The stored ranking's ids when it is for this tokenizer and vocabulary (else None)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ids = record.get("ids", [])
    if record.get("vocab_size") != vocab_size or record.get("tokens_sha256") != tokenizer_digest(tokenizer, ids):
        return None
    return ids


_RANKINGS: dict[tuple[int, str], list[int]] = {}


def token_ranking(tokenizer, vocab_size: int) -> list[int]:
    """Every token id, most frequent first: the shipped file's order, then the rest by id."""
    key = (vocab_size, tokenizer_digest(tokenizer, range(min(vocab_size, len(tokenizer), 1024))))
    if key not in _RANKINGS:
        shipped = shipped_ranking(tokenizer, vocab_size) or []
        taken = set(shipped)
        _RANKINGS[key] = shipped + [t for t in range(vocab_size) if t not in taken]
    return _RANKINGS[key]


__all__ = ["DEFAULT_DRAFT_VOCAB", "DRAFT_VOCAB_FILE", "shipped_ranking", "token_ranking", "tokenizer_digest",
           "write_ranking"]

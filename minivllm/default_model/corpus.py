"""The embedded model's text: the standard library's sources, split into training and held-out files
by a hash of each path, so the training script and every evaluation see the same split."""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from typing import Any

import numpy as np

# Tests are 63% of the bytes (a model trained on them writes `self.assertEqual` after everything);
# encodings/ is mostly generated code-page tables.
SKIP_DIRS = ("site-packages", "__pycache__", "idlelib", "test", "tests", "encodings")
HELD_OUT_EVERY = 25


def stdlib_root() -> str:
    """The standard library's directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    """Every .py file of the standard library but its tests (and site-packages), sorted for a stable order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        out += [os.path.join(dirpath, f) for f in sorted(filenames)
                if f.endswith(".py") and not f.startswith("test_")]
    return sorted(out)


def relative_path(path: str) -> str:
    """`path` under the stdlib root, with forward slashes (the same on every machine)."""
    return os.path.relpath(path, stdlib_root()).replace(os.sep, "/")


def is_held_out(path: str, every: int = HELD_OUT_EVERY) -> bool:
    """1 file in `every`, chosen by a hash of its path under the stdlib root (stable across runs)."""
    return int(hashlib.sha1(relative_path(path).encode()).hexdigest(), 16) % every == 0


def split_files(every: int = HELD_OUT_EVERY) -> tuple[list[str], list[str]]:
    """(training files, held-out files)."""
    files = stdlib_files()
    held = [f for f in files if is_held_out(f, every)]
    return [f for f in files if not is_held_out(f, every)], held


def read_texts(files: list[str]) -> list[str]:
    """The files' contents; files that are not UTF-8 are skipped."""
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def encode_stream(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """One token stream (a `tokenizers.Tokenizer`): each file's tokens followed by <|endoftext|> (when the
    tokenizer has it: another model's may not)."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids
        if eot is not None:
            ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def windows(ids: np.ndarray, seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive windows of seq_len + 1 tokens, overlapping by one, so that each window scores
    seq_len next tokens and every token of the stream but the first is scored once."""
    ids = ids[:max_tokens] if max_tokens else ids
    out = [ids[s:s + seq_len + 1].tolist() for s in range(0, len(ids) - 1, seq_len)]
    return [w for w in out if len(w) >= 2]


def unigram_perplexity(train_ids: np.ndarray, held: np.ndarray, vocab: int) -> float:
    """The baseline: each token's training frequency (add-one smoothed), context ignored; the first
    held-out token is not scored, as with the windows."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[held[1:]].mean()))

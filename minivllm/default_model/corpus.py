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
    """One token stream: each file's tokens, then <|endoftext|> where the tokenizer has it."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids
        if eot is not None:
            ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def windows(ids: np.ndarray, seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """Windows of seq_len + 1 tokens overlapping by one: every token but the first is scored once."""
    ids = ids[:max_tokens] if max_tokens else ids
    out = [ids[s:s + seq_len + 1].tolist() for s in range(0, len(ids) - 1, seq_len)]
    return [w for w in out if len(w) >= 2]


def unigram_counts(train_ids: np.ndarray, vocab: int) -> np.ndarray:
    """How often each token id occurs in the training stream."""
    return np.bincount(train_ids, minlength=vocab).astype(np.int64)


def unigram_perplexity(counts: np.ndarray, held: np.ndarray) -> float:
    """The baseline: training frequencies (add-one smoothed), context ignored, first token unscored."""
    p = counts.astype(np.float64) + 1.0
    logp = np.log(p / p.sum())
    return float(math.exp(-logp[held[1:]].mean()))


def save_held_out(path: str, held_ids: np.ndarray, counts: np.ndarray) -> None:
    """Ship the held-out token stream and the training unigram counts, so that evaluation does not
    depend on the local standard library (another Python version has other files)."""
    from safetensors.numpy import save_file

    save_file({"input_ids": held_ids.astype(np.int32), "unigram_counts": counts.astype(np.int64)}, path)


def load_held_out(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(held-out token ids, training unigram counts) as save_held_out wrote them."""
    from safetensors.numpy import load_file

    t = load_file(path)
    return t["input_ids"], t["unigram_counts"]

"""llama.cpp beside us on the same weights: its own converter and quantizer, and its decode timed through its C API.

Everything comes from llama-cpp-python, an optional bench dependency (`pip install -e ".[peers]"`): pip builds its
sdist's vendored llama.cpp for this CPU (-march=native, as our kernels are); the converter (convert_hf_to_gguf.py
and the gguf-py it ships, model/gguf_converter.py) is read out of the same sdist. Decode is
timed with llama_decode on a batch of one token per sequence, the logits of every row computed, as our steps do.

Gemma 2's converter reads only a SentencePiece tokenizer.model: one is trained on the same stdlib text
(sentencepiece) and put beside the checkpoint for the conversion (the converter pads the vocabulary to the
model's). Gemma 3's converter cuts the embedding to the tokenizer's size: the bench's copy of tokenizer.json
is padded with unused tokens to the model's vocabulary first, as the real tokenizer has it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
import tempfile
import time
from typing import Any

from minivllm.model.gguf_converter import convert_hf

# Families whose llama.cpp conversion needs a SentencePiece tokenizer.model (our test checkpoints have none), and
# those whose converter sizes the embedding by the tokenizer (ours is smaller than the model's vocabulary).
NEEDS_SENTENCEPIECE = ("Gemma2ForCausalLM",)
PAD_TOKENIZER = ("Gemma3ForCausalLM",)

logger = logging.getLogger(__name__)
_SILENT: list[Any] = []  # the log callback must outlive every llama.cpp call


def _quiet() -> None:
    """Send llama.cpp's log (a line per tensor when quantizing, the whole model's metadata when loading) nowhere."""
    import llama_cpp

    if not _SILENT:
        _SILENT.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
        llama_cpp.llama_log_set(_SILENT[0], ctypes.c_void_p())


@functools.cache
def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


# A seccomp filter (classic BPF over struct seccomp_data) failing arch_prctl(ARCH_REQ_XCOMP_PERM, ...) with EPERM,
# every other call allowed: (code, jt, jf, k) as struct sock_filter.
_ARCH_X86_64, _SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM = 0xC000003E, 158, 0x1023
_DENY_XCOMP_PERM = ((0x20, 0, 0, 4), (0x15, 0, 5, _ARCH_X86_64),  # arch (offset 4); not x86-64: allow
                    (0x20, 0, 0, 0), (0x15, 0, 3, _SYS_ARCH_PRCTL),  # syscall number (offset 0)
                    (0x20, 0, 0, 16), (0x15, 0, 1, _ARCH_REQ_XCOMP_PERM),  # its first argument's low word
                    (0x06, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
                    (0x06, 0, 0, 0x7FFF0000))  # SECCOMP_RET_ALLOW


@functools.cache
def _without_amx() -> bool:
    """Make llama.cpp's AMX buffer type unavailable in this process, its other extra buffer types (the repacked
    Q4_0 / Q8_0 / K-quant layouts) kept: ggml asks the kernel for AMX tile permission (arch_prctl
    ARCH_REQ_XCOMP_PERM) before offering AMX tiles and offers none when refused, so a seccomp filter refuses that one
    request (this bench process only; the filter is inherited by threads started later). Whether it took."""
    libc = ctypes.CDLL(None, use_errno=True)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    insns = (SockFilter * len(_DENY_XCOMP_PERM))(*(SockFilter(*i) for i in _DENY_XCOMP_PERM))
    prog = SockFprog(len(insns), insns)
    # PR_SET_NO_NEW_PRIVS (38), then PR_SET_SECCOMP (22) with SECCOMP_MODE_FILTER (2)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        logger.warning("llama.cpp: could not refuse AMX (errno %d): its extra weight buffer types are off instead",
                       ctypes.get_errno())
        return False
    logger.warning("llama.cpp: AMX tiles refused on this AMX CPU (its repacked layouts stay on)")
    return True


def model_params() -> Any:
    """llama.cpp's default model parameters, on a CPU that advertises AMX without its AMX tiles: there llama.cpp
    repacks Q8_0 / Q4_0 weights for AMX tiles, and on the 2-vCPU Xeon VMs (AMX flags, permission granted) its first
    tile load raised SIGILL and killed the process (tests and benches alike, 135M and tiny models), where a tile load
    of our own ran. Its AMX permission request is refused instead (_without_amx), so it takes its repacked AVX-512
    layouts as on any other x86 CPU; where that cannot be done, every extra buffer type is off (said in the log)."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    if _has_amx() and not (sys.platform == "linux" and platform.machine() == "x86_64" and _without_amx()):
        params.use_extra_bufts = False
    return params


def prompt_logits(gguf_path: str, ids: list[int], threads: int = 2, f32_cache: bool = False) -> Any:
    """llama.cpp's logits [V] (numpy float32) after the prompt ids, in a fresh context; f32_cache: its KV cache in
    float32 (its default float16 moves a mixture's logits where a token's two best experts nearly tie)."""
    session = Session(gguf_path, threads)
    try:
        return session.prompt_logits(ids, f32_cache)
    finally:
        session.close()


def available() -> str | None:
    """None when llama-cpp-python and gguf are importable, else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama.cpp comparison skipped: {e} (pip install -e '.[peers]')"
    return None


def _sentencepiece_model(hf_dir: str) -> None:
    """A SentencePiece tokenizer.model for a checkpoint whose converter reads nothing else (Gemma 2)."""
    import sentencepiece as spm

    from minivllm.modelgen.make_model import corpus_files

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            for path in corpus_files()[:60]:
                with open(path, errors="ignore") as src:
                    f.write(src.read())
        spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(tmp, "sp"), vocab_size=4000,
                                       model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                       max_sentence_length=100000, minloglevel=2)
        os.replace(os.path.join(tmp, "sp.model"), os.path.join(hf_dir, "tokenizer.model"))


def _pad_tokenizer(hf_dir: str) -> None:
    """Give tokenizer.json the model's vocabulary size in unused added tokens (as real checkpoints' tokenizers
    have it): Gemma 3's converter cuts the embedding to the tokenizer's size, and llama.cpp then refuses a model
    whose embedding disagrees with its vocab_size."""
    import json

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    vocab_size = (cfg.get("text_config") or cfg)["vocab_size"]
    path = os.path.join(hf_dir, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    have = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    tok["added_tokens"] += [{"id": i, "content": f"<unused{i}>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True} for i in range(have, vocab_size)]
    with open(path, "w") as f:
        json.dump(tok, f)


def convert(hf_dir: str, out: str, outtype: str = "f32", architecture: str = "", extra: tuple[str, ...] = ()) -> str:
    """The HF checkpoint as a GGUF file, written by llama.cpp's own converter (model/gguf_converter.py), after the
    test checkpoints' tokenizer quirks above (extra: more of its flags, e.g. --split-max-tensors N)."""
    if architecture in NEEDS_SENTENCEPIECE and not os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        _sentencepiece_model(hf_dir)
    if architecture in PAD_TOKENIZER:
        _pad_tokenizer(hf_dir)
    return convert_hf(hf_dir, out, outtype, extra)


def quantize(gguf_in: str, gguf_out: str, ftype: str = "Q4_0", threads: int = 2) -> str:
    """llama.cpp's quantizer (llama_model_quantize), e.g. to Q4_0 or Q8_0."""
    import llama_cpp

    _quiet()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(gguf_in.encode(), gguf_out.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype} failed for {gguf_in}")
    return gguf_out


class Session:
    """One GGUF file loaded once, timed through llama.cpp's C API: a 512-token prefill, and decode steps of one
    token per sequence with the logits of every row computed, as our steps do. Each measurement runs in a fresh
    context (its KV cache sized for it, one unified cache so one long sequence fits beside many short ones)."""

    def __init__(self, gguf_path: str, threads: int) -> None:
        import llama_cpp as lc

        _quiet()
        lc.llama_backend_init()
        self.lc, self.threads = lc, threads
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), model_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.lc.llama_model_free(self.model)

    def _context(self, n_ctx: int, num_seqs: int, f32_cache: bool = False) -> Any:
        """A fresh context (one unified KV cache, float16 unless f32_cache) and a batch of up to 512 rows."""
        lc = self.lc
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = num_seqs
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = self.threads
        if f32_cache:
            cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
        return lc.llama_init_from_model(self.model, cp), lc.llama_batch_init(512, 0, 1)

    def _submit(self, ctx: Any, batch: Any, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of rows (token, position, sequence, whether its logits are wanted)."""
        batch.n_tokens = len(rows)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        if self.lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def prompt_logits(self, ids: list[int], f32_cache: bool = False) -> Any:
        """The logits [V] (numpy float32) after the prompt ids (at most 512), in a fresh context."""
        import numpy as np

        lc = self.lc
        ctx, batch = self._context(max(256, len(ids)), 1, f32_cache)
        try:
            self._submit(ctx, batch, [(tok, i, 0, i == len(ids) - 1) for i, tok in enumerate(ids)])
            return np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, len(ids) - 1), shape=(self.vocab,)).copy()
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)

    def _run(self, num_seqs: int, prompt_len: int, steps: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of num_seqs prompts then `steps` one-token-per-sequence steps."""
        lc = self.lc
        ctx, batch = self._context(max(256, num_seqs * (prompt_len + steps + 8)), num_seqs)

        def submit(rows: list[tuple[int, int, int, bool]]) -> None:
            self._submit(ctx, batch, rows)

        vocab = self.vocab
        try:
            prompt = [((7 * i + 13 * s) % vocab, i, s, i == prompt_len - 1) for s in range(num_seqs)
                      for i in range(prompt_len)]
            t0 = time.perf_counter()
            for k in range(0, len(prompt), 512):
                submit(prompt[k:k + 512])
            t1 = time.perf_counter()
            for step in range(steps):
                submit([((31 * step + s) % vocab, prompt_len + step, s, True) for s in range(num_seqs)])
            t2 = time.perf_counter()
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return t1 - t0, t2 - t1

    def prefill_s(self, prompt_len: int) -> float:
        """Seconds to prefill one prompt of prompt_len tokens (the first token's logits)."""
        return self._run(1, prompt_len, 0)[0]

    def decode_tok_s(self, num_seqs: int, prompt_len: int, steps: int) -> float:
        """Decode tokens per second of num_seqs sequences after their prompts."""
        return num_seqs * steps / self._run(num_seqs, prompt_len, steps)[1]


def decode_speed(gguf_path: str, num_seqs: int, prompt_len: int, steps: int, threads: int) -> dict[str, Any]:
    """Prefill num_seqs prompts, then time `steps` decode steps of one token per sequence (logits of every row)."""
    session = Session(gguf_path, threads)
    try:
        prefill, decode = session._run(num_seqs, prompt_len, steps)
    finally:
        session.close()
    return {"prefill_s": prefill, "decode_s": decode, "decode_tok_s": num_seqs * steps / decode}


def streamed_bytes(gguf_path: str) -> int:
    """Bytes of the tensors a decode step reads: all but the token embedding (a gather of one row per token),
    which is read whole only where the file has no separate output matrix (tied embeddings: it is the LM head)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf_path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")

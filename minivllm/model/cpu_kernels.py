"""Native CPU kernels: C sources shipped in the package, compiled once per machine with the system
C compiler (model/kernel_build.py) and loaded with ctypes.

The library links the same OpenMP runtime torch loaded (same soname, so the dynamic linker reuses
torch's), and every call passes torch's thread count, so the kernels use exactly the threads the
engine was given. Without a compiler the engine falls back to the portable PyTorch paths.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from minivllm.model import hugepages
from minivllm.model.kernel_build import build_library


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """Compile (once, cached on disk: model/kernel_build.py) and load the native kernels; None if that is
    impossible here."""
    lib_path = build_library()
    if lib_path is None:
        return None
    lib = ctypes.CDLL(lib_path)
    i64, p, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.paged_attention_f32.argtypes = [p, p, i64, p, p, c_int, p, p, p, i64, p, i64, c_int, c_int, c_int, c_int,
                                        c_float, c_float, i64, i64, i64, p, c_int]
    lib.paged_attention_f32.restype = None
    lib.sample_rows_f32.argtypes, lib.sample_rows_f32.restype = [p, i64, i64, p, p, p, p, p, p, p, c_int], None
    lib.logprobs_rows_f32.argtypes = [p, i64, p, i64, i64, p, p, i64, p, p, p, p, c_int]
    lib.logprobs_rows_f32.restype = None
    lib.linear_gemv.argtypes = [p, i64, p, i64, c_int, i64, i64, c_int, p, p, p, i64, p, p, c_int]
    lib.linear_gemv.restype = None
    lib.linear_gemv_m1_many.argtypes = [p, i64, p, i64, c_int, i64, i64, c_int, p, p, p, i64, p, p, c_int]
    lib.linear_gemv_m1_many.restype = c_int  # (csrc/moe_decode.c's caller; bound here for the tests)
    lib.gemm_f32_panels.argtypes, lib.gemm_f32_panels.restype = [p, i64, p, i64, c_int, i64, i64, p, p, c_int], None
    lib.gemm_f32_panel_width.argtypes, lib.gemm_f32_panel_width.restype = [], c_int
    lib.gemm_f32_x_ld.argtypes, lib.gemm_f32_x_ld.restype = [i64], i64
    lib.quantize_rows_s8.argtypes = [p, i64, i64, i64, p, p, c_int]
    lib.rescale_i32.argtypes = [p, i64, i64, p, p, p, p, c_int]
    lib.quantize_rows_s8.restype = lib.rescale_i32.restype = None
    lib.add_rmsnorm_f32.argtypes = [p, p, i64, c_float, p, c_float, p, i64, i64, c_int]
    lib.add_layernorm_f32.argtypes = [p, p, i64, p, p, c_float, p, i64, i64, c_int]
    lib.rmsnorm_groups_f32.argtypes = [p, i64, i64, i64, i64, p, c_float, c_int]
    lib.silu_mul_f32.argtypes = [p, i64, p, i64, i64, i64, c_int]
    lib.gelu_tanh_mul_f32.argtypes = [p, i64, p, i64, i64, i64, c_int]
    lib.gelu_tanh_f32.argtypes = [p, i64, p, i64, i64, i64, c_int]
    lib.rope_kv_write_f32.argtypes = [p, i64, i64, c_int, c_int, c_int, c_int, p, p, p, p, c_int, p, p, p, c_int]
    for fn in (lib.add_rmsnorm_f32, lib.add_layernorm_f32, lib.rmsnorm_groups_f32, lib.silu_mul_f32,
               lib.gelu_tanh_mul_f32, lib.gelu_tanh_f32, lib.rope_kv_write_f32):
        fn.restype = None
    lib.decode_stack_f32.argtypes = [p, i64, p, p, p, p]
    lib.decode_stack_f32.restype = None
    lib.greedy_round_f32.argtypes = [p, i64, p, p, p, i64, p, p, p, i64, p, i64, p, p, i64, p, p, p]
    lib.greedy_round_f32.restype = None
    lib.apply_token_bitmask_f32.argtypes, lib.apply_token_bitmask_f32.restype = [p, i64, p, i64, p, i64, i64], None
    # the one-token rows' settings (model/row_order.py): (argument types, result type)
    for name, (args, res) in {"set_gemv_m1_order": ([c_int], None), "gemv_m1_order_now": ([], c_int),
                              "set_gemv_m1_prefetch": ([i64], None), "set_gemv_few_rows_k": ([i64], None),
                              "gemv_few_rows_ordered": ([], c_int), "gemv_w8a8_rows_ordered": ([], c_int),
                              "gemv_int4_bf16dot": ([], c_int), "gemv_int4_x_int16": ([], c_int),
                              "gemv_int4_int16dot": ([], c_int), "gemv_int4_int16_ordered": ([], c_int),
                              "gemv_int4_few_tokens": ([], c_int),
                              "set_gemv_w4a8_seq_bytes": ([i64], None), "set_gemv_w4a8_pass_rows": ([c_int], None),
                              "set_gemv_w4a8_prefetch_l2": ([c_int], None), "gemv_w4a8_one_by_one": ([i64], c_int),
                              "gemv_w4a8_rows_ordered": ([], c_int)}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.stream_read_f32.argtypes, lib.stream_read_f32.restype = [p, i64, c_int, c_int], ctypes.c_double
    return lib


def available() -> bool:
    """Whether the native kernels compiled and loaded on this machine."""
    return load_library() is not None


def int4_x_int16() -> bool:
    """Whether int4's one-token native rows take a float32 x as int16 in blocks of 32 here (csrc/gemv_avx2.h: AVX2
    without VNNI; csrc/gemv_int4_int16dot.h: AVX512-VNNI), where float x against nibbles costs a conversion per 8 or
    16 weights; elsewhere they take it as it is."""
    lib = load_library()
    return lib is not None and bool(lib.gemv_int4_x_int16())


_local = threading.local()  # per-thread scratch: ctypes drops the GIL, so engines in threads must not share


KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # csrc's kv_fmt codes


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                    max_ctx: int, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    sinks: int = 0, softcap: float = 0.0) -> None:
    """Decode attention: out[t] = softmax(q[t] K^T * scale) V over the context of token t (row t of
    block_tables), read in place from the block pool (float32, bfloat16, or int8 with float16 scales per
    slot and kv head). The context is the last `window` positions (0: all) and the first `sinks`; softcap > 0
    caps each score as softcap * tanh(score / softcap). q [T, H, D] and out are float32; q may have any row
    stride."""
    lib = load_library()
    assert lib is not None
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
    assert out.dtype == torch.float32 and k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_FORMATS
    assert (k_cache.dtype == torch.int8) == (k_scale is not None)
    assert block_tables.dtype == torch.int64 and block_tables.stride(1) == 1 and positions.dtype == torch.int64
    threads = torch.get_num_threads()
    scratch = _scratch_for(attention_scratch_floats(threads, num_heads, max_ctx))
    lib.paged_attention_f32(
        out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        KV_FORMATS[k_cache.dtype], _ptr(k_scale), _ptr(v_scale), block_tables.data_ptr(),
        block_tables.stride(0), positions.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, block_size,
        scale, softcap, window, sinks, max_ctx, scratch.data_ptr(), threads)


def attention_scratch_floats(threads: int, num_heads: int, max_ctx: int) -> int:
    """The work buffer csrc/paged_attention.c needs: per thread, a score row per query head (padded to 16 lanes
    for the row items) of max_ctx rounded up to 16."""
    return threads * (-(-num_heads // 16) * 16) * ((max_ctx + 15) // 16 * 16)


def _scratch_for(numel: int) -> torch.Tensor:
    """A float32 work buffer of at least numel elements for the calling thread: grow-only and reused,
    so no allocation per call."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < numel:
        buf = _local.scratch = torch.empty(int(numel * 1.25), dtype=torch.float32)
    return buf


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 logits [R, V] (see csrc/sampling.c for the exact semantics)."""
    lib = load_library()
    assert lib is not None
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.is_contiguous()
    threads = torch.get_num_threads()
    scratch = _scratch_for(threads * (2 * vocab + 2 * 16384))  # csrc/sampling.c's layout
    out = torch.empty(rows, dtype=torch.int64)
    args = [temperature.float().contiguous(), top_k.long().contiguous(), top_p.float().contiguous(),
            min_p.float().contiguous(), u.double().contiguous()]
    lib.sample_rows_f32(logits.data_ptr(), rows, vocab, *(a.data_ptr() for a in args), out.data_ptr(),
                        scratch.data_ptr(), threads)
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """In place: -inf where mask [len(rows), words] (int32, one bit per token) forbids a token of logits[rows]."""
    lib = load_library()
    assert lib is not None and logits.dtype == torch.float32 and logits.stride(1) == 1
    idx = torch.tensor(rows, dtype=torch.int64)
    m = mask.contiguous()
    lib.apply_token_bitmask_f32(logits.data_ptr(), logits.stride(0), idx.data_ptr(), len(rows), m.data_ptr(),
                                m.shape[1], logits.shape[1])


def logprobs_rows(logits: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor, num_top: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows `rows` of float32 logits [R, V]: the logprob and rank of token chosen[j], and the top
    num_top[j] (ids, logprobs; padded to the largest num_top). See csrc/logprobs.c."""
    lib = load_library()
    assert lib is not None
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    n, vocab = rows.numel(), logits.shape[1]
    rows, chosen, num_top = rows.long().contiguous(), chosen.long().contiguous(), num_top.long().contiguous()
    max_top = max(int(num_top.max()), 1) if n else 1
    out_chosen = torch.empty(n, dtype=torch.float32)
    out_rank = torch.empty(n, dtype=torch.int64)
    top_ids = torch.zeros(n, max_top, dtype=torch.int64)
    top_lp = torch.zeros(n, max_top, dtype=torch.float32)
    lib.logprobs_rows_f32(logits.data_ptr(), logits.stride(0), rows.data_ptr(), n, vocab, chosen.data_ptr(),
                          num_top.data_ptr(), max_top, out_chosen.data_ptr(), out_rank.data_ptr(),
                          top_ids.data_ptr(), top_lp.data_ptr(), torch.get_num_threads())
    return out_chosen, out_rank, top_ids, top_lp


_MAX_M = 16  # csrc/gemv.c's rows of x staged per pass
# q8 / q8a8: int8 in blocks of 32 with float16 scales (GGUF's Q8_0), weight-only / against int8 activations
GEMV_FORMATS = {"f32": 0, "bf16": 1, "int8": 2, "int4": 3, "w8a8": 4, "w4a8": 5, "q8": 6, "q8a8": 7, "q6k": 8,
                "q4k": 9}
SUPERBLOCK_BYTES = {"q6k": 210, "q4k": 144}  # GGUF's K-quants: bytes a superblock of 256 weights
_F16_SCALES = 16  # csrc/gemv.c's FMT_F16_SCALES: int4 / w4a8 group scales (and mins) in float16, not bfloat16
_F32_MINS = 32  # FMT_F32_MINS: int4 / w4a8 group mins in float32
_SYM_MINS = 64  # FMT_SYM_MINS: no mins stored, each -8 * scale (GGUF's Q4_0)
_ACT_BLOCKS = 128  # FMT_ACT_BLOCKS: w4a8's / q8a8's x per 32-weight block, each its own scale (llama.cpp's Q8_0 x)


class GemvWeights:
    """One layer's weights bound for csrc/gemv.c: pointers and sizes resolved once, so a call does only
    the per-input work (this runs for every projection of every decode step)."""

    __slots__ = ("fmt", "k", "n", "group", "ptrs", "tensors", "scratch_numel")

    def __init__(self, fmt: str, weight: torch.Tensor, in_features: int, scale: torch.Tensor | None = None,
                 mins: torch.Tensor | None = None, group: int = 0, bias: torch.Tensor | None = None,
                 act_blocks: bool = False) -> None:
        assert load_library() is not None and weight.device.type == "cpu" and weight.is_contiguous()
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        self.fmt, self.k, self.n, self.group = GEMV_FORMATS[fmt], in_features, weight.shape[0], group
        if fmt in ("q8", "q8a8"):
            assert group == 32 and scale is not None and scale.dtype == torch.float16 and mins is None
        elif group:  # int4 groups: scales bfloat16 or float16; mins the scales' dtype, float32, or none (-8 scale)
            assert scale is not None and scale.dtype in (torch.bfloat16, torch.float16)
            assert mins is None or mins.dtype in (scale.dtype, torch.float32)
            self.fmt |= (_F16_SCALES if scale.dtype == torch.float16 else 0) | \
                (_SYM_MINS if mins is None else _F32_MINS if mins.dtype == torch.float32 else 0)
        elif fmt in SUPERBLOCK_BYTES:  # Q6_K / Q4_K superblocks as the file holds them (csrc/gemv_q6k.c, gemv_q4k.c)
            assert weight.dtype == torch.uint8 and in_features % 256 == 0 and scale is None and mins is None
            assert weight.shape[1] == in_features // 256 * SUPERBLOCK_BYTES[fmt] and group == 0
        if act_blocks:  # x's blocks of 32 meet the weights' groups: one scale each (csrc/gemv_w4a8.c)
            assert (fmt, group) in (("w4a8", 32), ("q8a8", 32), ("q6k", 0), ("q4k", 0))
            self.fmt |= _ACT_BLOCKS
        self.tensors = (weight, scale, mins, bias)  # the pointers below stay valid while these live
        self.ptrs = tuple(_ptr(t) for t in self.tensors)
        kp = -(-in_features // group) * group if group else in_features
        self.scratch_numel = _MAX_M * (kp + 2 * (kp // group if group else 0) + 64)

    @classmethod
    def dense(cls, weight: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> GemvWeights:
        """A float weight (float32, or bfloat16 as it is) and its bias, bound for csrc/gemv.c."""
        w = weight.detach().contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        return cls("f32" if w.dtype == torch.float32 else "bf16", w, in_features, bias=b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 with unit column stride → [M, N] float32."""
        lib = load_library()
        assert lib is not None
        m = x.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        w, scale, mins, bias = self.ptrs
        lib.linear_gemv(out.data_ptr(), self.n, x.data_ptr(), x.stride(0), m, self.k, self.n, self.fmt, w, scale, mins,
                        self.group, bias, _scratch_for(self.scratch_numel).data_ptr(), torch.get_num_threads())
        return out


class GemmPanels:
    """A float32 weight [N, K] packed for csrc/gemm_f32.c's many-token GEMM: panels of the library's panel width
    (two vectors) of output columns, each [K, width] (zero columns past N), in huge pages where large. A second copy
    of the weight, made where the kernel plan runs the native kernel on more than layers.PANELS_PAST (6) tokens, or
    its only one (model/weight_layout.py)."""

    __slots__ = ("k", "n", "panels", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib = load_library()
        assert lib is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
        width = lib.gemm_f32_panel_width()
        self.n, self.k = weight.shape
        w, count, full = weight.detach().contiguous(), -(-self.n // width), self.n // width
        self.panels = hugepages.float_buffer(count * self.k * width).view(count, self.k, width)
        self.panels[:full].copy_(w[: full * width].view(full, width, self.k).transpose(1, 2))
        if full < count:  # (zero columns past N)
            self.panels[full].zero_()
            self.panels[full, :, : self.n - full * width].copy_(w[full * width:].t())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 with unit column stride → [M, N] float32."""
        lib = load_library()
        assert lib is not None and x.dtype == torch.float32 and x.stride(-1) == 1
        m = x.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        lib.gemm_f32_panels(out.data_ptr(), self.n, x.data_ptr(), x.stride(0), m, self.k, self.n,
                            self.panels.data_ptr(), _ptr(self.bias), torch.get_num_threads())
        return out


def quantize_rows_s8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activation quantization in one pass: (int8 [M, K], float32 scales [M]), as
    quantization.quantize_rows_int8 computes it. x float32 [M, K], unit column stride."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, dtype=torch.float32)
    lib = load_library()
    assert lib is not None
    lib.quantize_rows_s8(x.data_ptr(), x.stride(0), m, k, xq.data_ptr(), xs.data_ptr(), torch.get_num_threads())
    return xq, xs


def rescale_i32(acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """acc [M, N] int32 (contiguous) * xs[m] * ws[n] + bias[n], as float32, in one pass."""
    m, n = acc.shape
    out = torch.empty(m, n, dtype=torch.float32)
    lib = load_library()
    assert lib is not None
    lib.rescale_i32(acc.data_ptr(), m, n, xs.data_ptr(), ws.data_ptr(), _ptr(bias), out.data_ptr(),
                    torch.get_num_threads())
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _residual_args(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, int | None, int]:
    """A fused norm's (residual, x pointer, x row stride): without a residual, x (contiguous) is the stream, read
    only, and nothing is added."""
    if residual is None:
        return x.contiguous(), None, 0
    return residual, x.data_ptr(), x.stride(0)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of (x + residual), returning (normed, residual updated in place); without a residual, of x
    (returned as the residual). float32 [M, H], residual contiguous; x may have any row stride."""
    lib = load_library()
    assert lib is not None
    m, h = x.shape
    residual, x_ptr, ldx = _residual_args(x, residual)
    out = torch.empty(m, h, dtype=torch.float32)
    lib.add_rmsnorm_f32(residual.data_ptr(), x_ptr, ldx, 1.0, weight.data_ptr(), eps, out.data_ptr(), m, h,
                        torch.get_num_threads())
    return out, residual


def add_layernorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of (x + residual), returning (normed, residual updated in place); without a residual, of x
    (returned as the residual): add_rmsnorm's convention. float32 [M, H], residual contiguous; x any row stride."""
    lib = load_library()
    assert lib is not None
    m, h = x.shape
    residual, x_ptr, ldx = _residual_args(x, residual)
    out = torch.empty(m, h, dtype=torch.float32)
    lib.add_layernorm_f32(residual.data_ptr(), x_ptr, ldx, weight.data_ptr(), bias.data_ptr(), eps, out.data_ptr(),
                          m, h, torch.get_num_threads())
    return out, residual


def rmsnorm_groups(x: torch.Tensor, size: int, weight: torch.Tensor, eps: float) -> None:
    """In place: RMSNorm of each group of `size` columns of x [M, n * size] (float32, unit column stride, any
    row stride), every group scaled by weight [size]."""
    m, cols = x.shape
    lib = load_library()
    assert lib is not None
    lib.rmsnorm_groups_f32(x.data_ptr(), x.stride(0), m, cols // size, size, weight.data_ptr(), eps,
                           torch.get_num_threads())


def rope_kv_write(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  positions: torch.Tensor | None,
                  cos_sin_cache: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """Rotary embedding in place on the q and k heads of a fused qkv [M, (H + 2 KVH) * D] (float32, unit
    column stride; the first R dimensions of each head for a table cos_sin_cache [positions, R], none without
    a table, and then no positions), then k and v written to their cache slots (an int8 cache with its scales):
    one pass instead of rope + two scatters."""
    lib = load_library()
    assert lib is not None and (cos_sin_cache is None or positions is not None)
    rot = 0 if cos_sin_cache is None else cos_sin_cache.shape[1]
    lib.rope_kv_write_f32(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_q_heads, num_kv_heads, head_dim, rot,
                          _ptr(positions), _ptr(cos_sin_cache), k_cache.data_ptr(), v_cache.data_ptr(),
                          KV_FORMATS[k_cache.dtype], _ptr(k_scale), _ptr(v_scale), slot_mapping.data_ptr(),
                          torch.get_num_threads())


def _gated(kernel: str, x: torch.Tensor) -> torch.Tensor:
    m, two_i = x.shape
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    getattr(load_library(), kernel)(x.data_ptr(), x.stride(0), out.data_ptr(), two_i // 2, m, two_i // 2,
                                    torch.get_num_threads())
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [M, 2I] float32 projection (rows any stride) → [M, I]."""
    return _gated("silu_mul_f32", x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu(x, approximate="tanh") of a float32 [M, N] (rows any stride, unit column stride) → [M, N]."""
    lib = load_library()
    assert lib is not None
    m, n = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    lib.gelu_tanh_f32(x.data_ptr(), x.stride(0), out.data_ptr(), n, m, n, torch.get_num_threads())
    return out


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of a fused [M, 2I] float32 projection (rows any stride) → [M, I]."""
    return _gated("gelu_tanh_mul_f32", x)


def stream_read(buf: torch.Tensor, threads: int, sequential: bool = False) -> float:
    """Read every float of buf once with `threads` OpenMP threads (a bandwidth probe, csrc/membw.c: each thread one
    sequential stream, or chunks of four interleaved rows); returns their sum."""
    lib = load_library()
    assert lib is not None and buf.dtype == torch.float32 and buf.is_contiguous()
    return lib.stream_read_f32(buf.data_ptr(), buf.numel(), threads, int(sequential))

"""GGUF's Q6_K and Q4_K run from their own superblocks (model/q6k_linear.py, model/q4k_linear.py, csrc/gemv_q6k.c,
csrc/gemv_q4k.c, csrc/gemm_a8.c's tiles): the dequantizers equal the `gguf` package's, every kernel path (AVX-512
VNNI rows and tiles, AVX2, portable) computes the weight-only and the x-in-blocks math of those weights, and
llama.cpp's own files load them as they are."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from minivllm.model import cpu_kernels
from minivllm.model.q4k_linear import Q4KLinear
from minivllm.model.q6k_linear import Q6KLinear
from minivllm.model.quantization import quantize_blocks_int8
from minivllm.model.split_linear import SplitLinear
from minivllm.model.superblock_linear import SuperblockLinear

CSRC = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")


TYPES = [Q6KLinear, Q4KLinear]
# where each type's float16 d (and Q4_K's dmin) sit in a superblock; every other bit pattern is valid codes and scales
_D_OFFSETS = {Q6KLinear: (208,), Q4KLinear: (0, 2)}


def _rows(cls: type[SuperblockLinear], n: int, k: int, seed: int) -> np.ndarray:
    """n rows of random superblocks of the type (every code and sub-block scale) with finite float16 d (dmin)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, cls.row_bytes(256)), dtype=np.uint8)
    for off in _D_OFFSETS[cls]:
        raw[:, :, off:off + 2] = rng.uniform(1e-3, 4e-3, (n, k // 256)).astype(np.float16).view(np.uint8).reshape(
            n, k // 256, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("cls", TYPES)
def test_dequantizer_equals_the_gguf_package(cls):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _rows(cls, 7, 512, 0)
    ref = np.asarray(dequantize(raw, GGMLQuantizationType[cls.type_name]), dtype=np.float32)
    got = cls.dequantize_rows(torch.from_numpy(raw), 512).numpy()
    assert got.shape == ref.shape == (7, 512)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)


def _expected(layer: SuperblockLinear, x: torch.Tensor) -> torch.Tensor:
    xr = quantize_blocks_int8(x) if layer.act_blocks else x
    return xr.double() @ layer.dequantize().double().t()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels")
@pytest.mark.parametrize("cls", TYPES)
@pytest.mark.parametrize("act_blocks", [False, True])
@pytest.mark.parametrize("k,n", [(256, 37), (768, 300)])
@pytest.mark.parametrize("m", [1, 3, 5, 11, 12, 14, 21, 70])  # (x in blocks: the tiles from 12 rows, Q4_K's from 14)
@pytest.mark.parametrize("threads", [1, 3])
def test_native_kernel_computes_the_layers_math(cls, act_blocks, k, n, m, threads):
    layer = cls.from_blocks(_rows(cls, n, k, k + n), k, act_blocks)
    x = torch.randn(m, k) * torch.linspace(0.1, 3.0, k)  # blocks of x at different scales
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = layer.forward_native(x)
        ref = layer.forward_reference(x)
    finally:
        torch.set_num_threads(old)
    expected = _expected(layer, x)
    tol = 2e-5 * expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= tol
    assert (ref.double() - expected).abs().max().item() <= tol


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels")
@pytest.mark.parametrize("cls", TYPES)
def test_strided_x_and_the_planned_forward(cls):
    layer = cls.from_blocks(_rows(cls, 64, 512, 3), 512, True)
    big = torch.randn(4, 700)
    x = big[:, 100:612]  # rows 700 floats apart
    from minivllm.model.kernel_plan import plan_kernels

    plan_kernels([layer], "native", cls.fmt, torch.float32)
    got = layer(x)
    assert (got.double() - _expected(layer, x)).abs().max().item() <= 2e-5 * got.abs().max().item()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels")
@pytest.mark.parametrize("cls", TYPES)
def test_a_weight_only_layer_quantizes_x_only_in_steps_of_many_tokens(cls):
    layer = cls.from_blocks(_rows(cls, 40, 512, 5), 512, False)
    assert set(layer.candidates()) == {"reference", "native", "native_a8"}
    assert not layer.eligible("native_a8", 1) and not layer.eligible("native_a8", 6)
    assert layer.eligible("native_a8", 16) and layer.eligible("native", 1)
    x = torch.randn(20, 512)
    blocks = cls.from_blocks(layer.qweight, 512, True)
    expected = _expected(blocks, x)
    assert (layer.forward_native_a8(x).double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


@pytest.mark.parametrize("cls", TYPES)
def test_malformed_rows_are_refused(cls):
    with pytest.raises(ValueError, match=f"{cls.type_name}: 300 input features are not whole superblocks of 256"):
        cls(300, 4, False)
    with pytest.raises(ValueError, match="not 512 weights' superblocks"):
        cls.from_blocks(np.zeros((4, 400), dtype=np.uint8), 512, False)


def _build(tmp_path, march: str, cls: type[SuperblockLinear]) -> ctypes.CDLL:
    """csrc/gemv_q6k.c (gemv_q4k.c) alone for another instruction set (the paths this CPU's own build does not
    take)."""
    cc = os.environ.get("CC") or shutil.which("gcc")
    obj, lib = tmp_path / f"{cls.fmt}_{march}.o", tmp_path / f"{cls.fmt}_{march}.so"
    # Compiled and linked apart, as cpu_kernels builds: -ffast-math at link time adds crtfastmath.o, whose
    # constructor flushes denormals to zero in the loading process (tests/test_sampler.py checks they survive).
    subprocess.run([cc, "-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11", "-c",
                    os.path.join(CSRC, f"gemv_{cls.fmt}.c"), "-o", str(obj)], check=True, capture_output=True)
    subprocess.run([cc, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"], check=True, capture_output=True)
    so = ctypes.CDLL(str(lib))
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    getattr(so, f"gemv_{cls.fmt}").argtypes = [p, i64, p, i64, c_int, i64, i64, p, p, c_int, p, c_int]
    return so


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and f" {flag}" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("gcc") is None and not os.environ.get("CC"), reason="no C compiler")
@pytest.mark.parametrize("cls", TYPES)
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])  # portable loops; AVX2 + FMA without VNNI
def test_other_instruction_sets_compute_the_same(tmp_path, march, cls):
    if march == "x86-64-v3" and not (_cpu_has("avx2") and _cpu_has("fma")):
        pytest.skip("this CPU has no AVX2")
    so = _build(tmp_path, march, cls)
    assert (torch.tensor(1e-39, dtype=torch.float32) * 1).item() > 0  # (loading it kept denormals)
    k, n = 512, 45
    for act_blocks in (False, True):
        layer = cls.from_blocks(_rows(cls, n, k, 9), k, act_blocks)
        for m in (1, 6):
            x = torch.randn(m, k) * torch.linspace(0.1, 3.0, k)
            out = torch.empty(m, n)
            scratch = torch.empty(16 * (k + 64))
            getattr(so, f"gemv_{cls.fmt}")(out.data_ptr(), n, x.data_ptr(), k, m, k, n, layer.qweight.data_ptr(), None,
                                           int(act_blocks), scratch.data_ptr(), 2)
            expected = _expected(layer, x)
            assert (out.double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item(), (act_blocks, m)


@pytest.fixture(scope="module")
def llama_cpp_file(tmp_path_factory):
    """make(hf_dir, ftype) → llama.cpp's own Q4_0 (Q4_K_M) file of the model, made once per module (its converter is a
    4 s subprocess; tests that differ only in how they load a file read the same one): its quantizer writes the head
    (the tied embedding where the model has no head of its own) in Q6_K where rows are whole superblocks."""
    from minivllm.bench import llamacpp

    made: dict[tuple[str, str], str] = {}

    def make(hf_dir: str, ftype: str) -> str:
        if (hf_dir, ftype) not in made:
            out = str(tmp_path_factory.mktemp("llama-cpp-file") / f"{ftype}.gguf")
            f32 = out + ".f32.gguf"
            llamacpp.quantize(llamacpp.convert(hf_dir, f32, "f32"), out, ftype)
            os.remove(f32)
            made[hf_dir, ftype] = out
        return made[hf_dir, ftype]

    return make


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels")
@pytest.mark.parametrize("ftype,tied", [("Q4_0", False), ("Q4_0", True), ("Q4_K_M", True)])
@pytest.mark.parametrize("weight_only", [False, True])  # by default x in blocks of 32 (w4a8, w8a8)
def test_a_gguf_files_q6_k_head_runs_as_its_own_superblocks(model_factory, llama_cpp_file, caplog, monkeypatch, tied,
                                                             ftype, weight_only):
    """The head of a Q4_0 file (or its tied embedding) in Q6_K runs from the file's own rows: its bytes equal the
    file's, weight-only it adds no error (logged KL ~0, logits and greedy text as transformers reads the file),
    against x in blocks it stays close; the load says what it did. The head's math is the layers': a Q4_K_M file's
    tied head beside layers all of superblocks (none of int8 blocks left to say w8a8) took x in blocks too (it ran
    weight-only: 0.8x the speed of a 1B file's decode)."""
    import logging

    from gguf import GGUFReader

    from minivllm import LLM, SamplingParams
    from minivllm.config import ModelConfig
    from minivllm.engine.tokenizer import get_tokenizer
    from tests.conftest import PROMPTS, hf_greedy, last_logits_and_hf, make_runner

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by the test extra")
    wide = (("intermediate_size", 512),) if ftype == "Q4_K_M" else ()  # (K-quant rows: whole superblocks)
    hf_dir = model_factory("tiny-llama", overrides=(("hidden_size", 256), *wide, ("tie_word_embeddings", tied)))
    path = llama_cpp_file(hf_dir, ftype)
    method = ("int4" if ftype == "Q4_0" else "int8") if weight_only else None
    kw = {"quantization": method} if method else {}
    from minivllm.model import gguf_conversion, hugepages

    placed = []  # the head is built after the loader's placement in huge pages: it is placed itself (this one is
    # under the 1 MiB the placement skips, so placed whatever its size)
    monkeypatch.setattr(gguf_conversion, "place_in_hugepages",
                        lambda m: placed.append(m) or hugepages.place_in_hugepages(m, min_bytes=0))
    with caplog.at_level(logging.INFO, logger="minivllm.model.gguf_conversion"):
        runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization_kernel="native", **kw)
    head = runner.model.lm_head  # type: ignore[attr-defined]
    assert isinstance(head, Q6KLinear) and head.act_blocks == (method is None)
    assert placed == [head]
    if hugepages.enabled():
        assert head.qweight.data_ptr() % hugepages.HUGE_PAGE == 0 and hugepages.huge_page_bytes(head.qweight) > 0
    name = "token_embd.weight" if tied else "output.weight"
    raw = next(t for t in GGUFReader(path).tensors if t.name == name)
    assert torch.equal(head.qweight, torch.from_numpy(np.array(raw.data).reshape(head.out_features, -1)))
    conv = runner.head_conversion
    assert conv is not None
    assert f"run as its own Q6_K superblocks ({'weight-only' if method else 'x in blocks of 32'}): KL" in caplog.text
    if method is None:
        assert conv.kl < 0.01 and conv.top1 >= 0.9
        return
    assert conv.kl < 1e-9 and conv.top1 == 1.0
    ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
    ours, ref, hf = last_logits_and_hf(runner, path, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=0)
    llm = LLM(path, quantization=method, quantization_kernel="native")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids == hf_greedy(hf, ids, 16)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels")
@pytest.mark.parametrize("method", [None, "int8"])  # by default x in blocks of 32 (w8a8); int8: weight-only
def test_llama_cpps_q4_k_m_file_runs_its_q4_k_modules_as_the_file_holds_them(model_factory, llama_cpp_file, caplog,
                                                                             method):
    """llama.cpp's own Q4_K_M file: every module whose parts are all Q4_K holds the file's rows (4.5 bits, nothing
    re-quantized), those all Q6_K too, and the attention whose v is Q6_K beside Q4_K q and k holds them in two parts
    (model/split_linear.py): nothing is converted; weight-only, the logits stay within 0.5% of transformers' reading
    of the file and 16 greedy tokens equal its, in the module path and in the native decode stack."""
    import logging

    from gguf import GGUFReader

    from minivllm import LLM, SamplingParams
    from minivllm.config import ModelConfig
    from minivllm.engine.tokenizer import get_tokenizer
    from minivllm.model.gguf_blocks import module_of
    from minivllm.model.quantization import QuantizedLinear
    from tests.conftest import PROMPTS, hf_greedy, last_logits_and_hf, make_runner

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by the test extra")
    hf_dir = model_factory("tiny-llama", overrides=(("hidden_size", 256), ("intermediate_size", 512),
                                                    ("tie_word_embeddings", False)))
    path = llama_cpp_file(hf_dir, "Q4_K_M")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    kw = {"quantization": method} if method else {}
    with caplog.at_level(logging.INFO, logger="minivllm.model"):
        runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization_kernel="native", **kw)
    parts: dict[str, set[str]] = {}
    for name, t in tensors.items():
        module = module_of(name)
        if module is not None and module != "lm_head":
            parts.setdefault(module, set()).add(t.tensor_type.name)
    kinds = {"Q4_K": Q4KLinear, "Q6_K": Q6KLinear}
    split = 0
    for module, types in parts.items():
        layer = runner.model.get_submodule(module)
        if len(types) == 1:
            assert type(layer) is kinds[types.pop()] and layer.act_blocks == (method is None), module
            continue
        # q and k Q4_K, v Q6_K: two parts, v's the file's rows
        assert types == {"Q4_K", "Q6_K"} and module.endswith("qkv_proj") and isinstance(layer, SplitLinear), module
        four, six = layer.parts
        assert type(four) is Q4KLinear and type(six) is Q6KLinear and six.act_blocks == (method is None)
        i = module.split(".")[1]
        v = np.array(tensors[f"blk.{i}.attn_v.weight"].data)
        assert four.out_features + six.out_features == layer.out_features and six.out_features == v.shape[0]
        assert torch.equal(six.qweight, torch.from_numpy(np.array(tensors[f"blk.{i}.attn_v.weight"].data)))
        split += 1
    assert split and not any(isinstance(m, QuantizedLinear) for m in runner.model.modules())
    assert runner.layer_conversion is None and "converted at load" not in caplog.text
    o = runner.model.layers[0].self_attn.o_proj  # type: ignore[attr-defined]
    assert torch.equal(o.qweight, torch.from_numpy(np.array(tensors["blk.0.attn_output.weight"].data)))
    assert "as their Q4_K superblocks" in caplog.text and f"; {split} in parts (Q4_K + Q6_K)" in caplog.text
    ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
    ours, ref, hf = last_logits_and_hf(runner, path, ids)
    if method is None:
        # x in blocks of 32: the activations' rounding moves this random model's logits by 4.8% of the largest
        # (int8 blocks in the attention's place moved them alike); its top two are 0.5% apart, so the argmax
        # asked is one within twice that error of the top
        err = (ours - ref).abs().max().item()
        assert err < 0.1 * ref.abs().max().item() and ref[ours.argmax()] >= ref.max() - 2 * err
        return
    assert ours.argmax() == ref.argmax()
    assert (ours - ref).abs().max().item() < 5e-3 * ref.abs().max().item()
    llm = LLM(path, quantization="int8", quantization_kernel="native")
    stack = llm.llm_engine.runner.decode_stack
    assert stack is not None and stack.native_classes[0]  # (the parts chained in csrc/decode_stack.c)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids == hf_greedy(hf, ids, 16)


def test_a_split_module_routes_each_checkpoint_row_to_its_part_and_refuses_one_spanning_two():
    """model/split_linear.py: rows [0, 256) Q4_K, [256, 320) Q6_K; q (rows 0-191) and k (192-255) land in the first
    part, v in the second; the output joins the parts' in row order; a tensor across the boundary is a clear error
    naming it, and a part left unfilled is reported missing."""
    from torch import nn

    from minivllm.model.models.weights import WeightLoader

    q, k, v = (_rows(cls, n, 512, seed) for seed, (n, cls) in enumerate(((192, Q4KLinear), (64, Q4KLinear),
                                                                        (64, Q6KLinear))))
    model = nn.Module()
    model.qkv = SplitLinear([Q4KLinear(512, 256, False), Q6KLinear(512, 64, False)])
    loader = WeightLoader(model)
    loader.load_slice("qkv.qweight", torch.from_numpy(q), 0, 192, "q_proj.qweight")
    loader.load_slice("qkv.qweight", torch.from_numpy(k), 192, 64, "k_proj.qweight")
    with pytest.raises(ValueError, match="missing weights: qkv.parts.1.qweight"):
        loader.finish()
    loader.load_slice("qkv.qweight", torch.from_numpy(v), 256, 64, "v_proj.qweight")
    loader.finish()
    four, six = model.qkv.parts
    assert torch.equal(four.qweight, torch.from_numpy(np.concatenate([q, k]))) and torch.equal(six.qweight,
                                                                                                torch.from_numpy(v))
    x = torch.randn(3, 512)
    expected = x.double() @ torch.cat([four.dequantize(), six.dequantize()]).double().T
    got = model.qkv(x)
    assert got.shape == (3, 320) and torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"'kv_proj.qweight' \(rows 192-320 of qkv.qweight\) spans parts"):
        WeightLoader(model).load_slice("qkv.qweight", torch.zeros(128, 288, dtype=torch.uint8), 192, 128,
                                       "kv_proj.qweight")
    with pytest.raises(ValueError, match="spans parts"):  # (a whole fused tensor into a split module)
        WeightLoader(model).load("qkv.qweight", torch.zeros(320, 288, dtype=torch.uint8), "qkv_proj.qweight")

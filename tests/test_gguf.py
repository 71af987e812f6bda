"""GGUF checkpoints: files written by llama.cpp's own converter load with their config, tokenizer and weights;
float files match the HF checkpoint they came from, quantized ones transformers' reading of the same file; a
malformed header is a clear error naming what is wrong, never a crash or a hang."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from conftest import PROMPTS, hf_greedy
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import quantize

from minivllm import LLM, SamplingParams
from minivllm.bench import llamacpp
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.gguf_checkpoint import EOG_TEXTS, find_gguf
from minivllm.model.gguf_export import rewrite_gguf
from minivllm.model.gguf_header import read_header
from minivllm.model.quantization import QuantizedLinear, unpack_int4
from minivllm.model.runner import SequenceInput
from tests.conftest import last_logits_and_hf, make_runner

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]  # Llama's q/k permuted by the converter; GPT-2's transposed


@pytest.fixture(scope="module")
def gguf_file(model_factory, tmp_path_factory):
    """gguf_file(preset, outtype) → a GGUF file llama.cpp's converter wrote from the preset's HF checkpoint
    (outtype: f32, f16, bf16, q8_0), or, for Q4_0 / Q4_1 / Q5_0 / Q5_1, the f32 file with its matrices
    quantized by the gguf package (the format's own quantizer)."""
    made: dict[tuple[str, str], str] = {}

    def make(preset: str, outtype: str) -> str:
        if (preset, outtype) not in made:
            out = str(tmp_path_factory.mktemp("gguf") / f"{preset}-{outtype}.gguf")
            if outtype.upper() in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
                requantize(make(preset, "f32"), out, GGMLQuantizationType[outtype.upper()])
            else:
                llamacpp.convert(model_factory(preset), out, outtype)
            made[preset, outtype] = out
        return made[preset, outtype]

    return make


def requantize(src: str, dst: str, qtype: GGMLQuantizationType, head: GGMLQuantizationType | None = None) -> None:
    """Copy a GGUF file, its 2-D weights quantized to qtype (the head to `head` if given; metadata and everything
    else as they were)."""

    def convert(t):
        data = np.asarray(t.data)
        if len(t.shape) != 2 or t.tensor_type != GGMLQuantizationType.F32 or data.shape[-1] % 32:
            return None
        kind = head if head is not None and t.name == "output.weight" else qtype
        return quantize(data, kind), kind

    rewrite_gguf(src, dst, convert)


def _prompt_logits(path: str, ids: list[int]) -> torch.Tensor:
    """Our logits after each half of ids (prefilled in two chunks, the second through the paged cache)."""
    runner = make_runner(ModelConfig.from_pretrained(path), 16)
    split = len(ids) // 2
    return torch.stack([runner.execute([SequenceInput(ids[lo:hi], lo, list(range(16)), True)])[0]
                        for lo, hi in ((0, split), (split, len(ids)))])


@pytest.mark.parametrize("preset", FAMILIES)
def test_f32_gguf_serves_exactly_what_its_hf_checkpoint_does(model_factory, gguf_file, preset):
    """Config, tokenizer (ids of every prompt), eos, logits and greedy text of the file equal the checkpoint's."""
    hf_dir, path = model_factory(preset), gguf_file(preset, "f32")
    mc, ref_mc = ModelConfig.from_pretrained(path), ModelConfig.from_pretrained(hf_dir)
    assert (mc.architecture, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == \
        (ref_mc.architecture, ref_mc.num_layers, ref_mc.num_heads, ref_mc.num_kv_heads, ref_mc.head_dim,
         ref_mc.vocab_size)
    tok, ref_tok = get_tokenizer(path), get_tokenizer(hf_dir)
    # Every token that ends generation in the checkpoint ends it here; the file adds only llama.cpp's
    # end-of-turn texts (its one eos id cannot list them all).
    assert set(ref_mc.eos_token_ids) <= set(mc.eos_token_ids) and mc.path == path
    assert all(tok.convert_ids_to_tokens(i) in EOG_TEXTS for i in set(mc.eos_token_ids) - set(ref_mc.eos_token_ids))
    for p in PROMPTS:
        assert tok.encode(p) == ref_tok.encode(p), p
    ids = ref_tok.encode(PROMPTS[1] + PROMPTS[3])
    torch.testing.assert_close(_prompt_logits(path, ids), _prompt_logits(hf_dir, ids), atol=1e-5, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].text for o in LLM(path).generate(PROMPTS[:4], params)]
    assert got == [o.outputs[0].text for o in LLM(hf_dir).generate(PROMPTS[:4], params)]


@pytest.mark.parametrize("preset,outtype", [("tiny-llama", t) for t in ("f16", "bf16", "q8_0", "Q4_0", "Q4_1", "Q5_0",
                                                                      "Q5_1")]
                         + [("tiny-gpt2", t) for t in ("q8_0", "Q4_0")])
def test_each_tensor_type_matches_transformers_reading_of_the_same_file(gguf_file, preset, outtype):
    """The reference is the file's weights dequantized by the gguf package and run by HF transformers in float32
    (its GGUF loader): our logits agree within float tolerance and greedy continuations are identical. (GPT-2's
    projections are transposed in its checkpoints, not in its files: their blocks run as the file has them.)"""
    from transformers import AutoModelForCausalLM

    path = gguf_file(preset, outtype)
    types = {t.ggml_type.name for t in read_header(path).tensors if len(t.dims) == 2}
    assert outtype.upper() in types  # the file really holds the type under test
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
    # Q4_0 / Q4_1 projections run as they are on the int4 kernels, weight-only on request ("native": the kernels
    # that compute with the file's weights exactly; the auto plan may quantize a prefill's activations).
    exact = {"Q4_0": "int4", "Q4_1": "int4", "q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8"}.get(outtype)
    kw = {"quantization": exact} if exact else {}
    runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization_kernel="native", **kw)
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    layers = len(runner.model.h if preset == "tiny-gpt2" else runner.model.layers)  # type: ignore[attr-defined]
    if outtype in ("Q4_0", "Q4_1"):
        # Every projection and the head (the file's head is Q4 too): 4 + 3 + 1 per layer before fusing -> 4 + 1.
        assert len(quantized) == 4 * layers + 1
        tied_head = runner.model.lm_head if preset == "tiny-gpt2" else None  # (its Q4_0 embedding, as int8 blocks)
        assert all(m.method == "int4" and m.group_size == 32 and m.scales.dtype == torch.float16
                   and m.symmetric == (outtype == "Q4_0") for m in quantized if m is not tied_head)
    elif outtype in ("q8_0", "Q5_0", "Q5_1"):  # int8 blocks of 32: Q8_0's own, the 5-bit types converted at load
        assert len(quantized) == 4 * layers + 1
        assert all(m.method == "int8" and m.blocked and m.scales.dtype == torch.float16 for m in quantized)
    else:
        assert not quantized  # the float types load into the float model
    ours = runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    if outtype.startswith("Q5"):  # converted: its error measured at load (tests/test_gguf_converted.py)
        conv = runner.layer_conversion
        assert conv is not None and conv.types == (outtype,) and conv.kl < 1e-3 and conv.top1 >= 0.9
        assert (ours - ref).abs().max().item() < 0.02 * ref.abs().max().item() and ours.argmax() == ref.argmax()
        return
    if preset == "tiny-gpt2" and outtype == "Q4_0":  # the tied Q4_0 head as int8 blocks: its error measured at load
        conv = runner.head_conversion
        assert conv is not None and conv.kl < 1e-3 and conv.top1 >= 0.9
        assert (ours - ref).abs().max().item() < 0.02 * ref.abs().max().item() and ours.argmax() == ref.argmax()
        return
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, quantization_kernel="native", **kw)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    assert out == hf_greedy(hf, ids, 16)
    if exact:  # by default against int8 activations in blocks of 32, as llama.cpp computes: close, same top token
        by_default = make_runner(ModelConfig.from_pretrained(path), 16)
        got = by_default.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]
        assert (got - ref).abs().max().item() < 0.02 * ref.abs().max().item() and got.argmax() == ref.argmax()


@pytest.mark.parametrize("outtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_run_as_they_are_and_only_as_int4(model_factory, gguf_file, outtype, tmp_path):
    """A Q4 file's projections hold the file's own codes and float16 scales (Q4_0's min -8 d, Q4_1's m): no
    re-quantization; they run as W4A8 with x in blocks of 32 by default (llama.cpp's arithmetic), weight-only int4
    on request; a method the blocks are not is a clear error; and a HF directory claiming GGUF blocks is refused."""
    from gguf import GGUFReader

    path = gguf_file("tiny-qwen2", outtype)
    runner = make_runner(ModelConfig.from_pretrained(path), 16)
    layer = runner.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    blk = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    raw = np.asarray(blk.data).reshape(layer.out_features, -1, 18 if outtype == "Q4_0" else 20)
    d = raw[:, :, :2].copy().view(np.float16)[:, :, 0]
    assert torch.equal(layer.scales, torch.from_numpy(d))
    if outtype == "Q4_0":  # a file of Q4_0 only: no mins stored (each -8 d, in the kernels): 18 bytes a block
        assert layer.symmetric and not hasattr(layer, "mins")
        assert torch.equal(layer.dequantize().view(layer.out_features, -1, 32),
                           (unpack_int4(layer.qweight).float() - 8).view(layer.out_features, -1, 32)
                           * layer.scales.float()[..., None])
    else:
        mins = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        assert torch.equal(layer.mins.float(), torch.from_numpy(mins.astype(np.float32)))
    assert torch.equal(layer.qweight, torch.from_numpy(raw[:, :, -16:].reshape(layer.out_features, -1).copy()))
    assert layer.method == "w4a8"
    assert {m.method for m in LLM(path, quantization="int4").llm_engine.runner.model.modules()
            if isinstance(m, QuantizedLinear)} == {"int4", "int8"}  # (weight-only: the converted head too)
    w4a8 = runner
    # (the file's tied head is its Q4_0 embedding, which stays a float embedding: the head runs converted, W8A8)
    assert {m.method for m in w4a8.model.modules() if isinstance(m, QuantizedLinear)} == {"w4a8", "w8a8"}
    assert w4a8.model.lm_head.method == "w8a8" and w4a8.head_conversion is not None
    # Their activations quantized as llama.cpp's Q4 dot products take them: per 32-weight block, a scale each.
    assert all(m.act_blocks for m in w4a8.model.modules() if isinstance(m, QuantizedLinear) and m.method == "w4a8")
    with pytest.raises(ValueError, match="gguf checkpoint whose layers run as w4a8 or int4; it cannot be loaded as "
                                         "int8"):
        LLM(path, quantization="int8")
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(model_factory("tiny-qwen2"), hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gguf", "types": ["Q4_0"], "lm_head": False}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="a quantization_config of method 'gguf' belongs to a .gguf file only"):
        LLM(hf_dir)


def test_q8_0_blocks_run_as_they_are_weight_only_or_w8a8(gguf_file, caplog):
    """A Q8_0 file's projections hold the file's own int8 codes and float16 scales (no re-quantization) and run
    against int8 activations in blocks of 32 by default (w8a8, as llama.cpp's Q8_0 dot product) or weight-only;
    the tied head (the Q8_0 embedding) takes the same blocks, its error logged (nil: the codes come back); a
    method the blocks are not is a clear error."""
    import logging

    from gguf import GGUFReader

    path = gguf_file("tiny-qwen2", "q8_0")
    with caplog.at_level(logging.INFO, logger="minivllm.model.gguf_conversion"):
        runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization="int8")
    layer = runner.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    assert layer.method == "int8" and layer.blocked
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    raw = np.asarray(tensors["blk.0.ffn_down.weight"].data).reshape(layer.out_features, -1, 34)
    assert torch.equal(layer.scales, torch.from_numpy(raw[:, :, :2].copy().view(np.float16)[:, :, 0]))
    assert torch.equal(layer.qweight, torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).reshape(layer.out_features,
                                                                                                   -1)))
    head = runner.model.lm_head  # type: ignore[attr-defined]
    assert "output.weight" not in tensors  # tied: the embedding's blocks, converted back exactly
    assert runner.head_conversion is not None and head.blocked
    assert runner.head_conversion.kl < 1e-6 and runner.head_conversion.top1 == 1.0
    assert "converted to int8 in blocks of 32: KL" in caplog.text
    llm = LLM(path)
    assert {(m.method, m.blocked, m.act_blocks) for m in llm.llm_engine.runner.model.modules()
            if isinstance(m, QuantizedLinear)} == {("w8a8", True, True)}  # (x in blocks too, as llama.cpp's)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:2], params)[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="gguf checkpoint whose layers run as w8a8 or int8; it cannot be loaded as "
                                         "int4"):
        LLM(path, quantization="int4")


def test_a_directory_holding_one_gguf_file_serves_it(gguf_file, tmp_path):
    src = gguf_file("tiny-llama", "q8_0")
    shutil.copy(src, tmp_path / "model.gguf")
    assert find_gguf(str(tmp_path)) == str(tmp_path / "model.gguf")
    out = LLM(str(tmp_path)).generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    shutil.copy(src, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF models"):
        find_gguf(str(tmp_path))
    split = tmp_path / "split"
    split.mkdir()
    shutil.copy(src, split / "m-00001-of-00002.gguf")
    with pytest.raises(ValueError, match="is missing parts: m-00002-of-00002.gguf"):
        find_gguf(str(split))


def test_the_first_engine_on_a_gguf_file_is_freed_on_del(gguf_file):
    """A GGUF file's names come from transformers' model classes, whose import imports torch._dynamo inside the
    engine's build: the first engine of the process is still freed by `del` (test_engine_lifetime.py)."""
    from test_engine_lifetime import first_engine_freed_on_del

    assert first_engine_freed_on_del(gguf_file("tiny-llama", "q8_0")) == (True, True)


def test_a_split_gguf_file_serves_as_one(model_factory, tmp_path):
    """llama.cpp's converter splits the file (a few tensors per part, the head in a later part than the metadata):
    the first part, or the directory, serves the same tokens as the checkpoint; a later part is refused, naming
    the first; a missing part is named."""
    hf_dir = model_factory("tiny-llama")
    llamacpp.convert(hf_dir, str(tmp_path / "m.gguf"), "q8_0", extra=("--split-max-tensors", "8"))
    names = sorted(os.listdir(tmp_path))
    assert len(names) >= 3 and names[0] == f"m-00001-of-{len(names):05d}.gguf", names
    first = str(tmp_path / names[0])
    mc = ModelConfig.from_pretrained(first)
    assert mc.hf_config["tie_word_embeddings"] is False  # the output head sits in a later part
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    whole = tmp_path / "whole"
    whole.mkdir()
    llamacpp.convert(hf_dir, str(whole / "m.gguf"), "q8_0")
    want = LLM(str(whole / "m.gguf")).generate(PROMPTS[:2], params)
    got = LLM(str(tmp_path)).generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match=f"name its first part, {names[0]}"):
        find_gguf(str(tmp_path / names[1]))
    os.remove(tmp_path / names[-1])
    with pytest.raises(ValueError, match=f"missing parts: {names[-1]}"):
        find_gguf(first)


def _header_fields(path: str) -> list[tuple[int, int, str]]:
    """(offset, size, what) of every count, length, dimension, type and offset field in the header: every metadata
    entry's, and every field of one tensor of each kind (type, dimensions) and of the last tensor (its data ends
    the file). Tensors of one kind are parsed and checked by the same code: all 233 fields of the tiny model took
    2.5 minutes of the suite on a 2-core AVX2 machine."""
    reader = GGUFReader(path)
    spots = [(8, 8, "tensor count"), (16, 8, "metadata count")]
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        spots.append((field.offset, 8, f"{field.name} key length"))
        spots.append((field.offset + 8 + len(field.name), 4, f"{field.name} type"))
    kinds: dict[tuple[int, int], ReaderTensor] = {}
    for t in reader.tensors:
        kinds.setdefault((int(t.tensor_type), len(t.shape)), t)
    for t in {id(t): t for t in [*kinds.values(), reader.tensors[-1]]}.values():  # (the last once, if chosen)
        off = t.field.offset
        n = len(t.name)
        spots.append((off, 8, f"{t.name} name length"))
        spots.append((off + 8 + n, 4, f"{t.name} n_dims"))
        for d in range(len(t.shape)):
            spots.append((off + 12 + n + 8 * d, 8, f"{t.name} dim {d}"))
        spots.append((off + 12 + n + 8 * len(t.shape), 4, f"{t.name} type"))
        spots.append((off + 16 + n + 8 * len(t.shape), 8, f"{t.name} offset"))
    return spots


def test_fuzzed_headers_are_clear_errors_never_crashes(gguf_file, tmp_path):
    """Every count, length, dimension, type and offset field of a real file's header set to hostile values
    (zero, one, huge, off by one, all ones), random bytes flipped, and the file truncated: each load either
    succeeds or raises ValueError / FileNotFoundError naming the problem; nothing else escapes, nothing hangs."""
    src = gguf_file("tiny-llama", "q8_0")
    data = open(src, "rb").read()
    rng = random.Random(0)
    cases: list[bytes] = []
    for off, size, _what in _header_fields(src):
        old = int.from_bytes(data[off:off + size], "little")
        for value in (0, 1, old + 1, old - 1 if old else 2, (1 << (8 * size)) - 1, 1 << (8 * size - 2), old * 7):
            value %= 1 << (8 * size)
            cases.append(data[:off] + value.to_bytes(size, "little") + data[off + size:])
    header_end = read_header(src).data_start
    for _ in range(80):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(header_end)] = rng.randrange(256)
        cases.append(bytes(b))
    for cut in (0, 3, 20, header_end // 2, header_end, len(data) - 1):
        cases.append(data[:cut])
    outcomes = {"ok": 0, "error": 0}
    for i, case in enumerate(cases):
        path = tmp_path / f"fuzzed-{i}.gguf"  # (a new name each: nothing cached by path can answer for it)
        path.write_bytes(case)
        try:
            mc = ModelConfig.from_pretrained(str(path))
            get_tokenizer(str(path))
            # (kernels named: what is under test is the file's reading, not the start-up timing of kernel candidates)
            runner_ok = make_runner(mc, 4, linear_backend="torch", quantization_kernel="reference") is not None
            outcomes["ok"] += runner_ok
        except (ValueError, FileNotFoundError) as e:
            assert str(e), "an error must say what is wrong"
            outcomes["error"] += 1
        path.unlink()
    assert outcomes["error"] > len(cases) // 2 and sum(outcomes.values()) == len(cases)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d, t: d[:len(d) - 100], "past the end of the .*-byte file: truncated"),
    (lambda d, t: _set(d, t["blk.0.attn_q.weight"]["type"], 4, 99), "tensor 'blk.0.attn_q.weight' has unknown type 99"),
    (lambda d, t: _set(d, t["blk.0.attn_q.weight"]["dim0"], 8, 1 << 62), "'blk.0.attn_q.weight'.*overflow"),
    (lambda d, t: _set(d, t["blk.0.attn_q.weight"]["dim0"], 8, 0), "'blk.0.attn_q.weight' has a zero dimension"),
    (lambda d, t: _set(d, t["blk.0.attn_q.weight"]["offset"], 8, 1 << 50), "'blk.0.attn_q.weight'.*past the end"),
    (lambda d, t: _set(d, t["blk.0.attn_q.weight"]["offset"], 8, 3), "not a multiple of the alignment"),
    (lambda d, t: _set(d, t["blk.0.attn_q.weight"]["ndims"], 4, 7), "'blk.0.attn_q.weight' has 7 dimensions"),
    (lambda d, t: _set(d, 16, 8, 1 << 60), "claims .* metadata entries"),
    (lambda d, t: b"GGML" + d[4:], "not a GGUF file"),
])
def test_malformed_files_name_the_tensor_or_key(gguf_file, tmp_path, mutate, message):
    src = gguf_file("tiny-llama", "q8_0")
    reader = GGUFReader(src)
    spots = {}
    for t in reader.tensors:
        off, n, nd = t.field.offset, len(t.name), len(t.shape)
        spots[t.name] = {"ndims": off + 8 + n, "dim0": off + 12 + n, "type": off + 12 + n + 8 * nd,
                         "offset": off + 16 + n + 8 * nd}
    path = tmp_path / "bad.gguf"
    path.write_bytes(mutate(open(src, "rb").read(), spots))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(str(path))


def _set(data: bytes, off: int, size: int, value: int) -> bytes:
    return data[:off] + value.to_bytes(size, "little") + data[off + size:]


@pytest.mark.parametrize("method,head_method", [("int4", "int8"), (None, "w8a8")])
def test_a_head_no_kernel_runs_as_it_is_is_converted_with_its_error_logged(gguf_file, tmp_path, caplog, method,
                                                                            head_method):
    """Q4_0 projections beside a Q8_0 head (llama.cpp's quantizer writes the head a type up): the head runs as int8
    blocks of 32 (against x in blocks beside W4A8: W8A8; weight-only beside int4, where it is the file's own Q8_0
    codes and scales again, no error added), and the load logs the KL and top-1 on a probe against the file's
    dequantized head; the logits stay close to transformers' reading of the file."""
    import logging


    path = str(tmp_path / "q4-head-q8.gguf")
    requantize(gguf_file("tiny-llama", "f32"), path, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)
    with caplog.at_level(logging.INFO, logger="minivllm.model.gguf_conversion"):
        kw = {"quantization": method} if method else {}
        runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization_kernel="native", **kw)
    conv = runner.head_conversion
    head = runner.model.lm_head  # type: ignore[attr-defined]
    assert conv is not None and conv.method == head_method
    assert isinstance(head, QuantizedLinear) and head.method == head_method and head.blocked and head.act_blocks
    # The float head it replaced left the float plan (its timing no longer bounds the steps; its weights freed).
    assert not any(q.out_features == head.out_features for q in runner.linear_plan.layers)
    assert 0 <= conv.kl < (1e-6 if method == "int4" else 0.01) and conv.top1 >= (1.0 if method == "int4" else 0.9)
    assert f"converted to {head_method} in blocks of 32: KL" in caplog.text
    if method == "int4":  # weight-only int8 head: close to the file's weights run in float32
        ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
        ours, ref, _ = last_logits_and_hf(runner, path, ids)
        assert (ours - ref).abs().max().item() < 0.05 * ref.abs().max().item()
        assert ours.argmax() == ref.argmax()


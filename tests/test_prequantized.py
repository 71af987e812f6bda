"""Checkpoints quantized elsewhere: GPTQ (v1 and v2 zeros, symmetric and not, with and without act-order), AWQ
(GEMM packing) and compressed-tensors (pack-quantized W4A16 packed by the library itself, int-quantized W8A8),
made here from a tiny model's checkpoint. Each loads into the engine's own layers where they fit (int4 with
float16 / bfloat16 group scales, int8) or dequantized, and matches its dequantized reference checkpoint run in
float32; a malformed config or tensor is a clear error."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from conftest import PROMPTS
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model import cpu_kernels
from minivllm.model.quantization import QuantizedLinear
from minivllm.model.runner import SequenceInput
from tests.conftest import make_runner

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i of an int32 holds channel 8j + AWQ_ORDER[i]


def _i32(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of 32 bits → int32 (two's complement), as the packers' uint32 → int32 views."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_along_rows(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AutoGPTQ's qweight packing: codes [R, C] → int32 [R * bits / 32, C], 32 / bits codes per int32 along R."""
    per = 32 // bits
    c = codes.to(torch.int64).view(-1, per, codes.shape[1])
    out = torch.zeros(c.shape[0], codes.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= c[:, j] << (bits * j)
    return _i32(out)


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: codes [R, C] → int32 [R, C / 8] along C in AWQ_ORDER."""
    c = codes.to(torch.int64).view(codes.shape[0], -1, 8)
    out = torch.zeros(c.shape[0], c.shape[1], dtype=torch.int64)
    for i, ch in enumerate(AWQ_ORDER):
        out |= c[:, :, ch] << (4 * i)
    return _i32(out)


def _layers(state: dict[str, torch.Tensor], head: bool) -> list[str]:
    return [n[:-7] for n in state if n.endswith("_proj.weight") or head and n == "lm_head.weight"]


def _write(src: str, out: str, state: dict[str, torch.Tensor], qc: dict | None, dtype: str) -> str:
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "model.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = dtype
    config.pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def make_prequantized(src: str, out: str, kind: str, group: int = 32, sym: bool = False, act_order: bool = False,
                      head: bool = False) -> tuple[str, str]:
    """(quantized checkpoint, its dequantized float32 reference) from the float checkpoint at src: random 4-bit
    codes, scales and zeros per group (GPTQ, AWQ) or the weights quantized by compressed-tensors' own compressor."""
    state = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    qstate, ref = dict(state), dict(state)
    for name in _layers(state, head):
        w = state.pop(name + ".weight").float()
        del qstate[name + ".weight"]
        n, k = w.shape
        groups = k // group
        if kind in ("gptq", "gptq_v2", "awq"):
            codes = torch.randint(0, 16, (k, n), generator=g)  # [K, N], as the packers take them
            scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
            zeros = torch.full((groups, n), 8) if sym else torch.randint(1, 16, (groups, n), generator=g)
            if act_order:
                perm = torch.randperm(k, generator=g)
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
            else:
                g_idx = torch.arange(k, dtype=torch.int32) // group
            gi = g_idx.long()
            ref[name + ".weight"] = (scales.float()[gi] * (codes - zeros[gi]).float()).t().contiguous()
            if kind == "awq":
                qstate.update({name + ".qweight": _pack_awq(codes), name + ".qzeros": _pack_awq(zeros),
                               name + ".scales": scales})
            else:
                stored = zeros - 1 if kind == "gptq" else zeros  # v1 stores each zero minus one
                qstate.update({name + ".qweight": _pack_along_rows(codes), name + ".g_idx": g_idx,
                               name + ".qzeros": _pack_along_rows(stored.t()).t().contiguous(),
                               name + ".scales": scales})
        else:
            bits = 4 if kind == "ct-w4a16" else 8
            args = (QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group)
                    if bits == 4 else QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"))
            acts = None if bits == 4 else QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                                            dynamic=True)
            scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
            ws = w.view(n, -1, group) if bits == 4 else w.view(n, 1, k)
            qmax = (1 << (bits - 1)) - 1
            if sym:
                scale = (ws.abs().amax(-1) / qmax).bfloat16()
                zp = torch.zeros_like(scale, dtype=torch.int8)
            else:
                lo, hi = ws.amin(-1), ws.amax(-1)
                scale = ((hi - lo) / 15).bfloat16()
                zp = (-8 - torch.round(lo / scale.float())).clamp(-8, 7).to(torch.int8)
            comp = PackedQuantizationCompressor if bits == 4 else NaiveQuantizationCompressor
            packed = comp.compress({"weight": w.bfloat16(), "weight_scale": scale, "weight_zero_point": zp}, scheme)
            qstate.update({f"{name}.{k2}": v for k2, v in packed.items()})
            # The library's own dequantization is the reference, in float32 (with bfloat16 scales it would round).
            decomp = comp.decompress({**packed, "weight_scale": packed["weight_scale"].float()}, scheme)
            ref[name + ".weight"] = decomp["weight"].float()
            qc = QuantizationConfig(config_groups={"group_0": scheme},
                                    format="pack-quantized" if bits == 4 else "int-quantized",
                                    ignore=[] if head else ["lm_head"]).model_dump()
    if kind in ("gptq", "gptq_v2"):
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
              "checkpoint_format": kind}
    elif kind == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    dtype = "bfloat16" if kind.startswith("ct") else "float16"
    return (_write(src, out + "-q", qstate, qc, dtype),
            _write(src, out + "-ref", {k: v.float() for k, v in ref.items()}, None, "float32"))


def _logits(path: str, **kw) -> tuple[torch.Tensor, ModelConfig, object]:
    mc = ModelConfig.from_pretrained(path)
    runner = make_runner(mc, 16, **kw)
    ids = get_tokenizer(path).encode(PROMPTS[1])
    return runner.execute([SequenceInput(ids, 0, list(range(16)), True, all_logits=True)]), mc, runner


INT4_TOL = 2e-4 if cpu_kernels.int4_x_int16() else 2e-5  # (int16 x: 3e-5 of the largest logit seen)

CASES = [  # (kind, group, sym, act_order, head, the layers' engine method or None: dequantized floats)
    ("gptq", 32, True, False, False, "int4"),
    ("gptq", 32, False, False, True, "int4"),
    ("gptq_v2", 32, False, False, False, "int4"),
    ("gptq", 32, False, True, False, None),
    ("gptq", 16, True, False, False, None),  # not one of our group sizes: dequantized
    ("awq", 32, False, False, False, "int4"),
    ("ct-w4a16", 32, True, False, False, "int4"),
    ("ct-w4a16", 32, False, False, False, "int4"),
    ("ct-w8a8", 0, True, False, False, "w8a8"),
]


@pytest.mark.parametrize("kind,group,sym,act_order,head,method", CASES)
def test_prequantized_checkpoint_matches_its_dequantized_reference(model_factory, tmp_path, kind, group, sym,
                                                                    act_order, head, method):
    src = model_factory("tiny-llama")
    qpath, refpath = make_prequantized(src, str(tmp_path / kind), kind, group or 32, sym, act_order, head)
    # The native kernels (the auto plan may quantize a weight-only layer's activations in a prefill: its own figure).
    got, mc, runner = _logits(qpath, quantization_kernel="native")
    want, _, _ = _logits(refpath)
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]  # type: ignore[attr-defined]
    if method is None:
        assert not quantized  # dequantized at load: the float model
    else:
        assert quantized and {m.method for m in quantized} == {method}
        heads = [m for m in quantized if m.out_features == mc.vocab_size]
        assert bool(heads) == head  # the head is quantized exactly when the checkpoint's is
        if method == "int4":
            dtype = torch.bfloat16 if kind.startswith("ct") else torch.float16  # the checkpoint's scales, as they are
            assert all(m.scales.dtype == dtype and m.group_size == group for m in quantized)
    # W8A8 quantizes activations (the checkpoint says so); the rest compute with the file's weights exactly (up to
    # the rounding of an asymmetric zero folded into a float16 min, and where int4's one-token rows take x as int16
    # in blocks of 32, that rounding: 2^-16 of a block's largest, in a prompt's last token past whole passes of 16).
    tol = 0.1 if method == "w8a8" else INT4_TOL if method == "int4" else 2e-5
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= tol * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1)) or method == "w8a8"


def test_prequantized_kernels_and_generation(model_factory, tmp_path):
    """A GPTQ checkpoint through the engine: greedy text equal to its reference's, in its own int4 kernels and as
    W4A8 (same weights, activations quantized); asking for a method its layers cannot be is a clear error."""
    src = model_factory("tiny-llama")
    qpath, refpath = make_prequantized(src, str(tmp_path / "g"), "gptq", 32, True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(refpath).generate(PROMPTS[:3], params)]
    got = [o.outputs[0].token_ids for o in LLM(qpath, quantization_kernel="native").generate(PROMPTS[:3], params)]
    assert got == want
    w4a8 = LLM(qpath, quantization="w4a8")
    layers = [m for m in w4a8.llm_engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.method for m in layers} == {"w4a8"}
    assert len(w4a8.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 12
    with pytest.raises(ValueError, match="gptq checkpoint whose layers run as int4 or w4a8; it cannot be loaded as "
                                         "w8a8"):
        LLM(qpath, quantization="w8a8")


def _edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("changes,message", [
    ({"bits": 3}, "gptq with 3-bit weights is not supported"),
    ({"bits": "4"}, r"quantization_config.bits is .4.; expected int"),
    ({"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ({"group_size": 30}, "group_size 30 is not a positive multiple of 8"),
])
def test_malformed_prequantized_config_is_a_clear_error(model_factory, tmp_path, changes, message):
    src = model_factory("tiny-llama")
    qpath, _ = make_prequantized(src, str(tmp_path / "g"), "gptq", 32, True)
    _edit_config(qpath, **changes)
    with pytest.raises(ValueError, match=message):
        LLM(qpath)


def test_prequantized_tensors_that_disagree_are_a_clear_error(model_factory, tmp_path):
    src = model_factory("tiny-llama")
    qpath, _ = make_prequantized(src, str(tmp_path / "g"), "gptq", 32, True)
    state = load_file(os.path.join(qpath, "model.safetensors"))
    state["model.layers.1.mlp.up_proj.scales"] = state["model.layers.1.mlp.up_proj.scales"][:1]  # one group short
    del state["model.layers.2.self_attn.o_proj.qzeros"]
    save_file(state, os.path.join(qpath, "model.safetensors"))
    with pytest.raises(ValueError, match=r"gptq layer 'model.layers.1.mlp.up_proj': shapes disagree"):
        LLM(qpath)
    state = load_file(os.path.join(qpath, "model.safetensors"))
    state["model.layers.1.mlp.up_proj.scales"] = state["model.layers.0.mlp.up_proj.scales"].clone()
    save_file(state, os.path.join(qpath, "model.safetensors"))
    with pytest.raises(ValueError, match=r"gptq layer 'model.layers.2.self_attn.o_proj': tensor 'qzeros' is missing"):
        LLM(qpath)


def test_a_float_model_of_a_prequantized_checkpoint_is_its_dequantized_weights(model_factory, tmp_path):
    """Without a quantization (a draft model, a direct load), the layers come back dequantized into the float model:
    the reference checkpoint's weights exactly."""
    from minivllm.model.loader import load_model

    qpath, refpath = make_prequantized(model_factory("tiny-llama"), str(tmp_path / "g"), "awq", 32)
    got = load_model(ModelConfig.from_pretrained(qpath), torch.float32, torch.device("cpu"), 64, None)
    want = load_model(ModelConfig.from_pretrained(refpath), torch.float32, torch.device("cpu"), 64, None)
    assert not any(isinstance(m, QuantizedLinear) for m in got.modules())
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_compressed_tensors_zero_points_and_asymmetric_int8(model_factory, tmp_path):
    """A symmetric pack-quantized checkpoint that still ships a zero-point tensor loads by its scheme (zero 0), and
    asymmetric int8 weights, which no kernel here runs, are a clear error."""
    qpath, refpath = make_prequantized(model_factory("tiny-llama"), str(tmp_path / "c"), "ct-w4a16", 32, True)
    state = load_file(os.path.join(qpath, "model.safetensors"))
    for name in [n for n in state if n.endswith(".weight_scale")]:
        state[name.replace("weight_scale", "weight_zero_point")] = torch.zeros_like(state[name], dtype=torch.int8)
    save_file(state, os.path.join(qpath, "model.safetensors"))
    got, _, _ = _logits(qpath, quantization_kernel="native")
    want, _, _ = _logits(refpath)
    assert (got - want).abs().max().item() <= INT4_TOL * want.abs().max().item()
    qpath, _ = make_prequantized(model_factory("tiny-llama"), str(tmp_path / "i"), "ct-w8a8", 32, True)
    with open(os.path.join(qpath, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with open(os.path.join(qpath, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="asymmetric 8-bit int-quantized weights are not supported"):
        LLM(qpath)


def test_a_tensor_of_the_wrong_rank_is_a_clear_error(model_factory, tmp_path):
    qpath, _ = make_prequantized(model_factory("tiny-llama"), str(tmp_path / "g"), "gptq", 32, True)
    state = load_file(os.path.join(qpath, "model.safetensors"))
    state["model.layers.0.mlp.down_proj.scales"] = state["model.layers.0.mlp.down_proj.scales"][0].clone()
    save_file(state, os.path.join(qpath, "model.safetensors"))
    with pytest.raises(ValueError, match=r"gptq layer 'model.layers.0.mlp.down_proj': its tensors do not fit"):
        LLM(qpath)

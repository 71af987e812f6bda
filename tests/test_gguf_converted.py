"""GGUF files of the K-quants and 5-bit types (what Q4_K_M / Q5_K_M / Q6_K files hold): a module all of whose parts
are Q6_K, or all Q4_K, runs as the file's own superblocks (model/q6k_linear.py, model/q4k_linear.py), one of Q4_K
beside Q4_1 as int4 groups, every other one is converted at load to int8 blocks of 32; the error that adds is measured
against the file's dequantized weights and logged, and the logits stay close to transformers' reading of the same
file."""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest
import torch
from conftest import PROMPTS
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from minivllm import LLM, SamplingParams
from minivllm.bench import llamacpp
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.gguf_conversion import PROBE_TOKENS, _divergence
from minivllm.model.gguf_export import rewrite_gguf
from minivllm.model.q4k_linear import Q4KLinear
from minivllm.model.q6k_linear import Q6KLinear
from minivllm.model.quantization import QuantizedLinear
from minivllm.model.runner import SequenceInput
from minivllm.model.split_linear import SplitLinear
from tests.conftest import last_logits_and_hf, make_runner

Q = GGMLQuantizationType
# K-quant blocks of 256 weights: where the block's float16 d (and Q4_K's dmin) sit; everything else is codes and
# sub-block scales, valid whatever their bits.
_D_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """Random valid blocks of a K-quant type (the gguf package cannot quantize to these): weights of ~0.05."""
    data = rng.integers(0, 256, size=(rows, cols // 256, _BYTES[qtype]), dtype=np.uint8)
    scale = 2e-5 if qtype == Q.Q6_K else 1e-4  # |w| <= d * 127 * 32 (Q6_K), d * 63 * 31 + dmin * 63 (Q4/5_K)
    for off in _D_OFFSETS[qtype]:
        d = (rng.uniform(0.5, 1.5, size=(rows, cols // 256)) * scale).astype(np.float16)
        data[:, :, off:off + 2] = d[..., None].view(np.uint8).reshape(rows, cols // 256, 2)
    return data.reshape(rows, -1)


def write_mixed(src: str, dst: str, kinds: dict[str, GGMLQuantizationType]) -> None:
    """Copy a float GGUF file with each 2-D weight whose name matches a key of `kinds` stored as that type (K-quants
    as random blocks, others quantized from the weight by the gguf package); metadata as it was."""
    rng = np.random.default_rng(0)

    def convert(t):
        kind = next((k for key, k in kinds.items() if re.search(key, t.name)), None) if len(t.shape) == 2 else None
        if kind is None:
            return None
        data = np.asarray(t.data)
        if kind in _BYTES:
            return _random_blocks(rng, data.shape[0], data.shape[1], kind), kind
        return quantize(data, kind), kind

    rewrite_gguf(src, dst, convert)


@pytest.fixture(scope="module")
def f32_file(model_factory, tmp_path_factory):
    """tiny-llama widened to rows of 256 (a K-quant block), as llama.cpp's converter writes it in float32."""
    hf_dir = model_factory("tiny-llama", overrides=(("hidden_size", 256), ("intermediate_size", 512)))
    out = str(tmp_path_factory.mktemp("kq") / "f32.gguf")
    return llamacpp.convert(hf_dir, out, "f32")


# Q4_K_M's mix (llama.cpp gives attn_v and ffn_down Q6_K in some layers, the head Q6_K); Q5_K_M's; the 5-bit types.
MIXES = {
    "Q4_K_M": {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, r"^output\.": Q.Q6_K, "blk.": Q.Q4_K},
    "Q5_K_M": {"attn_v": Q.Q6_K, r"^output\.": Q.Q6_K, "blk.": Q.Q5_K},
    "Q5_0+Q8_0": {"ffn_": Q.Q5_0, r"^output\.": Q.Q8_0, "blk.": Q.Q5_1},
    "Q4_K+Q4_1": {"ffn_up": Q.Q4_1, r"^output\.": Q.Q6_K, "blk.": Q.Q4_K},  # gate Q4_K beside up Q4_1: int4 groups
}


def _hf(path: str):
    """transformers' float32 reading of a GGUF file (the gguf package's dequantizer)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("mix", [m for m in MIXES if m != "Q4_K_M"])  # (Q4_K_M's: nothing converted, below)
def test_k_quant_files_convert_to_int8_blocks_with_their_error_logged(f32_file, tmp_path, caplog, mix):
    path = str(tmp_path / f"{mix}.gguf")
    write_mixed(f32_file, path, MIXES[mix])
    with caplog.at_level(logging.INFO, logger="minivllm.model.gguf_conversion"):
        runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization="int8",  # weight-only
                             quantization_kernel="native")
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    six = {name for name, m in runner.model.named_modules() if isinstance(m, Q6KLinear)}
    four = {name for name, m in runner.model.named_modules() if isinstance(m, Q4KLinear)}
    assert len(quantized) + len(six) + len(four) == 4 * len(runner.model.layers) + 1  # type: ignore[attr-defined]
    # Modules whose every part is Q4_K run as the file's superblocks (as the Q6_K heads), weight-only here; Q4_K
    # beside Q4_1 (a gate_up) as int4 groups of 32; the others (the 5-bit types, and a Q6_K v beside them) as int8
    # blocks.
    layers = len(runner.model.layers)  # type: ignore[attr-defined]
    every = {m: {f"layers.{i}.{m}" for i in range(layers)} for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                      "mlp.gate_up_proj", "mlp.down_proj")}
    int4 = every["mlp.gate_up_proj"] if mix == "Q4_K+Q4_1" else set()
    expected_four = every["self_attn.qkv_proj"] | every["self_attn.o_proj"] | every["mlp.down_proj"] \
        if mix == "Q4_K+Q4_1" else set()
    expected_six = {"lm_head"} if mix != "Q5_0+Q8_0" else set()
    assert six == expected_six and four == expected_four
    assert not any(runner.model.get_submodule(name).act_blocks for name in six | four)
    for name, m in runner.model.named_modules():
        if not isinstance(m, QuantizedLinear):
            continue
        if name in int4:
            assert m.method == "int4" and m.grouped and m.scales.dtype == torch.float16, name
            assert m.mins.dtype == torch.float32, name
        else:
            assert m.method == "int8" and m.blocked, name
    raw = {t.name: t for t in GGUFReader(path).tensors}
    layer = runner.model.layers[0]  # type: ignore[attr-defined]
    if mix == "Q4_K+Q4_1":  # each Q4_K sub-block of int4 groups: the file's codes, its min exactly, d * sc in float16
        module = layer.mlp.gate_up_proj
        w = torch.from_numpy(dequantize(np.asarray(raw["blk.0.ffn_gate.weight"].data), Q.Q4_K).astype(np.float32))
        bound = 15 * module.scales.float().abs().repeat_interleave(32, 1)[:w.shape[0]] * 2 ** -11 + 1e-7
        assert ((module.dequantize()[:w.shape[0]] - w).abs() <= bound).all()
    conv = runner.layer_conversion
    expected = {k.name for k in MIXES[mix].values()} - {"Q8_0"} - ({"Q6_K"} if mix == "Q4_K+Q4_1" else set())
    assert conv is not None and set(conv.types) == expected and conv.layers == len(quantized)
    # Random K-quant blocks: against the file alone. The 5-bit types, quantized from the float model: the added
    # error is a small share of the file's own (KL from the float32 model's logits on the same probe; the share
    # measured 8.5%).
    if mix == "Q5_0+Q8_0":
        probe = torch.tensor([np.random.default_rng(0).integers(0, 1024, PROBE_TOKENS).tolist()])
        with torch.no_grad():
            own = _divergence(_hf(f32_file)(probe).logits[0], _hf(path)(probe).logits[0])[0]
        assert 1e-7 < conv.kl < 0.1 * own and conv.top1 >= 0.85
    else:
        # (> 0: the measurement sees the re-quantization; this random 3-layer model's logits are flat, so a few of the
        # probe's 64 positions are near-ties: 4 flipped with down_proj and the head as Q6_K, 2 with them int8 blocks,
        # while its last logits came 3.4x closer to transformers' reading of the file)
        # (int4 groups round only the Q4_K sub-blocks' scales d * sc to float16: KL 6e-10)
        lower = 1e-11 if mix == "Q4_K+Q4_1" else 1e-7
        assert lower < conv.kl < 1e-3 and conv.top1 >= 0.9
    kept = ", ".join(f"{len(names)} as their {t} superblocks" for t, names in (("Q4_K", four), ("Q6_K", six))
                     if names) or "none as their superblocks"
    assert f"its {', '.join(conv.types)} projections converted at load ({len(int4)} layers as int4 groups of 32, " \
        f"{len(quantized) - len(int4)} as int8 blocks of 32; {kept})" in caplog.text
    # The codes of one converted layer are Q8_0's of the file's dequantized weight (the row order HF's); a Q6_K
    # layer's weights are the file's.
    down = runner.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    raw = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    w = torch.from_numpy(dequantize(np.asarray(raw.data), raw.tensor_type).astype(np.float32))
    if isinstance(down, Q6KLinear | Q4KLinear):
        torch.testing.assert_close(down.dequantize(), w, rtol=1e-6, atol=0)
    else:
        step = down.scales.float().repeat_interleave(32, 1)
        assert ((down.dequantize() - w).abs() <= step / 2 * 1.001).all()
    # Logits close to transformers' float32 reading of the same file (its dequantized weights).
    hf = _hf(path)
    ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
    ours = runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    if mix == "Q5_0+Q8_0":  # (this 3-layer model is sharp: the file itself moves its logits far more)
        with torch.no_grad():
            own_dev = (_hf(f32_file)(torch.tensor([ids])).logits[0, -1] - ref).abs().max().item()
        assert (ours - ref).abs().max().item() < 0.3 * own_dev
    else:
        assert (ours - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    assert ours.argmax() == ref.argmax()


def test_converted_layers_serve_as_w8a8_on_request_not_as_int4(f32_file, tmp_path, caplog):
    path = str(tmp_path / "q5k.gguf")
    write_mixed(f32_file, path, {"blk.": Q.Q5_K})
    with caplog.at_level(logging.INFO, logger="minivllm.model.gguf_conversion"):
        llm = LLM(path, quantization="w8a8")
    runner = llm.llm_engine.runner
    assert {(m.method, m.blocked) for m in runner.model.modules() if isinstance(m, QuantizedLinear)} == \
        {("w8a8", True)}
    assert runner.layer_conversion is not None and runner.layer_conversion.types == ("Q5_K",)
    assert "in w8a8 math" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:2], params)[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="cannot be loaded as int4"):
        LLM(path, quantization="int4")


def test_without_memory_for_the_float_copy_the_error_is_not_measured_but_the_file_serves(f32_file, tmp_path,
                                                                                        caplog, monkeypatch):
    import psutil

    path = str(tmp_path / "q5k.gguf")
    write_mixed(f32_file, path, {"blk.": Q.Q5_K})
    free = psutil.virtual_memory()._replace(available=1 << 20)  # 1 MiB free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    with caplog.at_level(logging.INFO, logger="minivllm.model.gguf_conversion"):
        runner = make_runner(ModelConfig.from_pretrained(path), 16)
    assert runner.layer_conversion is None
    assert "their error is not measured: a float copy of the model needs" in caplog.text
    ids = get_tokenizer(path).encode(PROMPTS[0])
    assert torch.isfinite(runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]).all()


K_QUANT_FILES = {"Q6_K": {"blk.": Q.Q6_K, r"^output\.": Q.Q6_K}, "Q4_K": {"blk.": Q.Q4_K, r"^output\.": Q.Q6_K},
                 "Q4_K_M": MIXES["Q4_K_M"]}


@pytest.mark.parametrize("mix", list(K_QUANT_FILES))
@pytest.mark.parametrize("method", [None, "int8"])
def test_a_k_quant_files_projections_run_as_its_superblocks_with_nothing_converted(f32_file, tmp_path, caplog, method,
                                                                                   mix):
    """Every projection Q6_K, or Q4_K, or Q4_K_M's mix (Q4_K; v and down Q6_K), the head Q6_K: each module holds the
    file's rows (nothing re-quantized, no conversion error to log), Q4_K_M's qkv in two parts (model/split_linear.py:
    Q4_K q and k, Q6_K v), against x in blocks of 32 by default (llama.cpp's arithmetic), weight-only on request
    (then the logits are the file's weights' in float32); int4 is refused."""
    path = str(tmp_path / f"{mix}.gguf")
    write_mixed(f32_file, path, K_QUANT_FILES[mix])
    kw = {"quantization": method} if method else {}
    with caplog.at_level(logging.INFO, logger="minivllm.model"):
        runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization_kernel="native", **kw)
    layers = runner.model.layers  # type: ignore[attr-defined]
    four, six = ((Q6KLinear,) * 4 if mix == "Q6_K" else (Q4KLinear,) * 4 if mix == "Q4_K" else
                 (SplitLinear, Q4KLinear, Q4KLinear, Q6KLinear)), Q6KLinear
    for layer in layers:
        projs = layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
        assert tuple(type(m) for m in projs) == four
        planned = [q for m in projs for q in (m.parts if isinstance(m, SplitLinear) else (m,))]
        assert all(m.act_blocks == (method is None) for m in planned)
    assert isinstance(runner.model.lm_head, six) and runner.model.lm_head.act_blocks == (method is None)
    assert runner.layer_conversion is None and "converted at load" not in caplog.text
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    up = np.array(tensors["blk.1.ffn_up.weight"].data)  # the second half of gate_up, as the file holds it
    assert torch.equal(layers[1].mlp.gate_up_proj.qweight[-up.shape[0]:], torch.from_numpy(up))
    if mix == "Q4_K_M":  # the parts: q and k's rows (in HF's order), v's as the file holds them
        qkv = layers[1].self_attn.qkv_proj
        v = np.array(tensors["blk.1.attn_v.weight"].data)
        assert [(type(p), p.out_features) for p in qkv.parts] == [(Q4KLinear, qkv.out_features - v.shape[0]),
                                                                  (Q6KLinear, v.shape[0])]
        assert torch.equal(qkv.parts[1].qweight, torch.from_numpy(v))
        k = torch.from_numpy(dequantize(np.array(tensors["blk.1.attn_k.weight"].data), Q.Q4_K).astype(np.float32))
        got = qkv.parts[0].dequantize()[-k.shape[0]:]
        assert torch.equal(got.sort(0).values, k.sort(0).values)  # (the rows permuted: rope's order)
        assert f"; {len(layers)} in parts (Q4_K + Q6_K)" in caplog.text
    ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
    ours, ref, _ = last_logits_and_hf(runner, path, ids)
    tol = (1e-4 if method else 0.02) * ref.abs().max().item()
    assert (ours - ref).abs().max().item() < tol and ours.argmax() == ref.argmax()
    if method is None:
        with pytest.raises(ValueError, match="cannot be loaded as int4"):
            LLM(path, quantization="int4")

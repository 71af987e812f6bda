"""`minivllm quantize --out m.gguf`: a model quantized here, written as GGUF (llama.cpp's converter for the
metadata, tokenizer and layouts; our quantizers for the blocks). The file holds exactly the engine's codes for the
HF weights (through llama.cpp's row reordering and transposes), serves as transformers reads it, and opens in
llama.cpp (where llama-cpp-python is installed) with the same next tokens."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import PROMPTS, hf_greedy, make_runner
from gguf import GGUFReader

from minivllm import LLM, SamplingParams
from minivllm.bench import llamacpp
from minivllm.cli import main
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.gguf_header import read_header
from minivllm.model.quantization import QuantizedLinear, quantize_int4, quantize_int8_blocks
from minivllm.model.runner import SequenceInput

# (preset, --quantization, GGUF type): Llama's q / k rows are reordered by llama.cpp, GPT-2's projections
# transposed; tiny-llama3 ties its head to the embedding; tiny-qwen3 normalizes q and k.
CASES = [("tiny-llama", "int8", "Q8_0"), ("tiny-llama", "int4", "Q4_1"), ("tiny-llama", "w4a8", "Q4_0"),
         ("tiny-llama3", "w8a8", "Q8_0"), ("tiny-qwen3", "int4", "Q4_1"), ("tiny-gpt2", "int8", "Q8_0")]


@pytest.fixture(scope="module")
def exported(model_factory, tmp_path_factory):
    """exported(preset, method, kind) -> (HF dir, the GGUF file `minivllm quantize` wrote from it)."""
    made: dict[tuple[str, str, str], str] = {}

    def make(preset: str, method: str, kind: str) -> tuple[str, str]:
        hf_dir = model_factory(preset)
        if (preset, method, kind) not in made:
            out = str(tmp_path_factory.mktemp("export") / f"{preset}-{kind}.gguf")
            assert main(["quantize", hf_dir, "--quantization", method, "--out", out,
                         *(["--gguf-int4-type", kind] if kind.startswith("Q4") else [])]) == 0
            made[preset, method, kind] = out
        return hf_dir, made[preset, method, kind]

    return make


def _reference(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """Our quantizer's tensors for an HF weight in the engine's layout."""
    if kind == "Q8_0":
        return quantize_int8_blocks(w)
    return quantize_int4(w, 32, torch.float16, symmetric=kind == "Q4_0")


@pytest.mark.parametrize("preset,method,kind", CASES)
def test_the_file_holds_the_engines_codes_for_the_hf_weights(exported, preset, method, kind, capsys):
    """Every projection and an untied head are blocks of `kind` (a tied head: the embedding as Q8_0), the file's
    other metadata as llama.cpp's converter wrote it; loaded back, each layer's codes, scales and mins equal our
    quantizer's on the HF checkpoint's weights (GPT-2, dequantized at load: its weights equal the codes' values)."""
    hf_dir, path = exported(preset, method, kind)
    fields = GGUFReader(path).fields
    assert fields["general.file_type"].contents() == {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}[kind]
    assert fields["general.quantized_by"].contents() == f"minivllm {method}"
    types = {t.name: t.ggml_type.name for t in read_header(path).tensors}
    tied = "output.weight" not in types
    for name, ty in types.items():
        if name.startswith("blk.") and name.endswith(".weight") and ("attn_" in name or "ffn_" in name) \
                and "norm" not in name:
            assert ty == kind, name
    assert types["token_embd.weight"] == ("Q8_0" if tied else "F32")
    assert tied == (preset in ("tiny-llama3", "tiny-gpt2")) and (tied or types["output.weight"] == kind)
    assert all(ty == "F32" for name, ty in types.items() if "norm" in name or name.endswith(".bias"))

    ref = make_runner(ModelConfig.from_pretrained(hf_dir)).model
    ours = make_runner(ModelConfig.from_pretrained(path), quantization_kernel="native").model
    quantized = {n: m for n, m in ours.named_modules() if isinstance(m, QuantizedLinear)}
    layers = len(ours.h if preset == "tiny-gpt2" else ours.layers)  # type: ignore[attr-defined]
    # qkv, o, gate_up, down per layer (GPT-2's c_attn, c_proj, c_fc, c_proj: transposed in its checkpoints, not in
    # its files, whose blocks run as they are), and the head
    assert len(quantized) == 4 * layers + 1
    for name, layer in quantized.items():
        if name == "lm_head" and tied:  # the Q8_0 embedding converted back at load, its error logged
            continue
        expect = _reference(ref.get_submodule(name).weight.detach().float(), kind)
        assert torch.equal(layer.qweight, expect[0]), name
        assert torch.equal(layer.scales, expect[1]), name
        if kind == "Q4_1":
            assert torch.equal(layer.mins, expect[2]), name


# (transformers' GGUF reader mis-sizes Qwen 3's heads, whose size is not hidden / heads: tests/test_gguf_families.py)
@pytest.mark.parametrize("preset,method,kind", [c for c in CASES if c[0] == "tiny-llama"])
def test_the_file_serves_as_transformers_reads_it(exported, preset, method, kind):
    """Our logits on the written file (its blocks run as they are, weight-only on request) equal HF transformers' on
    the same file's weights dequantized by the gguf package, within float tolerance; greedy continuations
    identical."""
    from transformers import AutoModelForCausalLM

    _, path = exported(preset, method, kind)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = get_tokenizer(path).encode(PROMPTS[0] + PROMPTS[2])
    exact = "int4" if kind.startswith("Q4") else "int8"
    runner = make_runner(ModelConfig.from_pretrained(path), 16, quantization=exact, quantization_kernel="native")
    got = runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = LLM(path, quantization=exact, quantization_kernel="native").generate([{"prompt_token_ids": ids}], params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 16)


@pytest.mark.parametrize("preset,method,kind", [CASES[0], CASES[1], CASES[3]])
def test_llama_cpp_opens_the_file_and_agrees(exported, preset, method, kind):
    """llama.cpp loads the file (its own loader checks every tensor's type and shape against the architecture)
    and its logits after a prompt agree with ours (it computes Q8_0 / Q4 blocks against activations quantized to
    8 bits, so within a few percent, with the same most likely token)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by the test extra")
    _, path = exported(preset, method, kind)
    ids = get_tokenizer(path).encode(PROMPTS[1])
    vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    assert vocab.tokenize(PROMPTS[1].encode(), add_bos=True, special=True) == ids  # the same tokenizer
    theirs = torch.from_numpy(llamacpp.prompt_logits(path, ids))  # (its weights as bench peers loads them)
    runner = make_runner(ModelConfig.from_pretrained(path), 16)
    ours = runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]
    assert (ours - theirs).abs().max().item() < 0.05 * ours.abs().max().item()
    assert ours.argmax().item() == theirs.argmax().item()


def test_what_gguf_cannot_hold_is_refused_by_name(model_factory, exported, tmp_path, capsys):
    """Group sizes GGUF has no type for, an existing output, and a GGUF input are clear errors (exit status 2),
    before any file is written."""
    hf_dir = model_factory("tiny-llama")
    out = str(tmp_path / "m.gguf")
    _, existing = exported(*CASES[0])
    for args, message in [
            ([hf_dir, "--quantization", "int4", "--quantization-group-size", "64", "--out", out],
             "hold 32 weights; --quantization-group-size 64"),
            ([hf_dir, "--quantization", "int8", "--out", existing], "exists; name a new .gguf file"),
            ([existing, "--quantization", "int8", "--out", out], "already quantized")]:
        assert main(["quantize", *args]) == 2
        assert message in capsys.readouterr().err
    assert not os.listdir(tmp_path)

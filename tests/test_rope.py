"""Rope scaling as real Llama-3.x / Qwen2.5 configs use it equals HF's implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minivllm.model.rotary import compute_inv_freq

BASE = {"hidden_size": 2048, "num_attention_heads": 32, "max_position_embeddings": 131072}
CASES = {
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
    "yarn": {"rope_theta": 1000000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "default": {"rope_theta": 10000.0, "rope_scaling": None},
}


@pytest.mark.parametrize("name", CASES)
def test_inv_freq_and_scale_match_hf(name):
    cfg = {**BASE, **CASES[name]}
    ours, our_scale = compute_inv_freq(cfg, 64)
    hf_cfg = LlamaConfig(**cfg)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu")) if rope_type != "default" \
        else (1.0 / (cfg["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64)), 1.0)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(ref_scale)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope type 'dynamic'"):
        compute_inv_freq({**BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 64)

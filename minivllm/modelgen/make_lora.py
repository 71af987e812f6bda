"""`minivllm make-lora`: a PEFT LoRA adapter with random weights for a model directory, written by peft itself (the
format the engine must read, from the library that defines it)."""

from __future__ import annotations

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora(base: str, out: str, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = DEFAULT_TARGETS,
              seed: int = 0, std: float = 0.05) -> str:
    """Write adapter_config.json + adapter_model.safetensors for `base` to `out`; returns out. Both A and B are
    random (peft's default B = 0 would make the adapter a no-op), normal with `std`."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RuntimeError("make-lora needs peft: pip install peft (it is in the [test] extra)") from None
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # peft annotates lora_alpha int; a fractional alpha scales just the same (alpha / r) and the engine reads it so
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),  # type: ignore[arg-type]
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(out)
    return out

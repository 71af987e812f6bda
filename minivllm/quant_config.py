"""QuantConfig: how a model's weights are quantized (--quantization), as recorded in a saved checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.model_config import ModelConfig

QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "w4a8")
GROUPED_METHODS = ("int4", "w4a8")  # int4 weights, group-wise scale and min
GROUP_SIZES = (32, 64, 128, 256)
QUANTIZATION_KERNELS = ("auto", "native", "reference", "int_mm", "native_a8")


@dataclass(frozen=True)
class QuantConfig:
    """How a model's weights are quantized; recorded in a saved checkpoint's config.json."""

    method: str
    group_size: int = 32  # int4 and w4a8 only
    quantize_lm_head: bool = True
    # int4 / w4a8 group scales and mins: bfloat16 (what we quantize to), or float16 where a checkpoint quantized
    # elsewhere (GPTQ, AWQ, GGUF's Q4_0 / Q4_1) stores them so: kept exactly, not rounded to bfloat16.
    scale_dtype: str = "bfloat16"
    # Their mins (-scale * zero): in scale_dtype, or float32 where a float16 product would round (asymmetric zeros),
    # or "none": not stored, each -8 * scale (codes centred on 8: GGUF's Q4_0; 2 bytes fewer per 32 weights).
    min_dtype: str = ""
    # int8 / w8a8 weights in blocks of 32 with a float16 scale each (GGUF's Q8_0, its own bytes), not per channel.
    int8_blocks: bool = False
    # Activations, where quantized (w4a8 / w8a8; int4's / int8's native_a8 in long steps), per 32-weight block with
    # a scale each (llama.cpp's Q8_0 activations, what its Q4_0 / Q8_0 dot products multiply: GGUF files), not per
    # row: for int4 groups of 32 and int8 blocks.
    act_blocks: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: unknown method {self.method!r}; choose one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.scale_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"quantization scale dtype: {self.scale_dtype!r} is neither bfloat16 nor float16")
        if self.min_dtype not in ("", "float32", "none"):
            raise ValueError(f"quantization min dtype: {self.min_dtype!r} is neither the scales', float32 nor none")
        if self.int8_blocks and (self.method not in ("int8", "w8a8") or self.group_size != 32):
            raise ValueError(f"quantization: int8 blocks are for int8 / w8a8 in groups of 32, not {self.method} "
                             f"with group size {self.group_size}")
        if self.act_blocks and (self.method not in GROUPED_METHODS and not self.int8_blocks or self.group_size != 32):
            raise ValueError(f"quantization: activation blocks are for int4 groups of 32 and int8 blocks, not "
                             f"{self.method} with group size {self.group_size}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size: {self.group_size} does not divide into the int4 kernel's "
                             f"32-weight blocks as a power of two; choose one of {', '.join(map(str, GROUP_SIZES))}")

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.scale_dtype == "float16" else torch.bfloat16

    @property
    def torch_min_dtype(self) -> torch.dtype:
        return torch.float32 if self.min_dtype == "float32" else self.torch_scale_dtype

    def as_hf_dict(self) -> dict[str, object]:
        """The `quantization_config` entry of a saved checkpoint's config.json."""
        return {"quant_method": "minivllm", "mode": self.method, "group_size": self.group_size,
                "lm_head": self.quantize_lm_head, "format_version": 1}

    @staticmethod
    def resolve(method: str | None, group_size: int, quantize_lm_head: bool, mc: ModelConfig
                ) -> QuantConfig | None:
        """The quantization to run: the checkpoint's own (a saved quantized model), else the requested one."""
        saved = mc.hf_config.get("quantization_config")
        if saved is None:
            return None if method is None else QuantConfig(method, group_size, quantize_lm_head)
        from minivllm.prequant_config import parse_prequantized

        scheme = parse_prequantized(saved, f"{mc.path}/config.json") if isinstance(saved, dict) else None
        if scheme is not None:
            kernels = scheme.kernels()
            if not kernels:  # dequantized at load: the float model, quantized again only if asked
                return None if method is None else QuantConfig(method, group_size, quantize_lm_head)
            if method is not None and method not in kernels:
                raise ValueError(f"quantization: {mc.path} is a {scheme.method} checkpoint whose layers run as "
                                 f"{' or '.join(kernels)}; it cannot be loaded as {method}")
            # The head's quantization is the checkpoint's (the loader reads it from the tensors present).
            half = "bfloat16" if scheme.method == "compressed-tensors" and mc.checkpoint_dtype == "bfloat16" \
                else "float16"
            target = scheme.engine_method()
            assert target is not None  # (kernels implies it)
            # GGUF's mins (-8 d, Q4_1's m) are exact in float16; an asymmetric zero times a scale needs float32.
            exact = scheme.symmetric or scheme.method == "gguf"
            mins = "none" if scheme.method == "gguf" and scheme.symmetric else "" if exact else "float32"
            chosen = method or kernels[0]
            return QuantConfig(chosen, target[1] or 32, False, half, mins,
                               int8_blocks=scheme.method == "gguf" and scheme.bits == 8,
                               act_blocks=scheme.method == "gguf")
        cfg = QuantConfig.from_hf_dict(saved, f"{mc.path}/config.json")
        if method is not None and method != cfg.method:
            raise ValueError(f"quantization: {mc.path} is a checkpoint quantized as {cfg.method}; it cannot be "
                             f"loaded as {method} (omit --quantization, or quantize the original model)")
        return cfg

    @staticmethod
    def from_hf_dict(d: dict[str, Any], where: str) -> QuantConfig:
        """Parse a checkpoint's `quantization_config`; anything we did not write is a clear error."""
        if d.get("quant_method") != "minivllm" or d.get("format_version") != 1:
            raise ValueError(f"{where}: quantization_config {d!r} is not a minivllm quantized checkpoint "
                             "(format_version 1) nor a GPTQ, AWQ or compressed-tensors one; those are what load "
                             "quantized")
        return QuantConfig(str(d.get("mode")), int(d.get("group_size", 32)), bool(d.get("lm_head", True)))

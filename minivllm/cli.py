"""The `minivllm` command: serve | generate | make-model | make-lora | quantize | monitor | profile | bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from minivllm.config import EngineArgs
from minivllm.quant_config import QUANTIZATION_METHODS


def _cmd_generate(ns: argparse.Namespace) -> int:
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            min_p=ns.min_p, repetition_penalty=ns.repetition_penalty, seed=ns.seed_sampling, n=ns.n,
                            stop=ns.stop or [],
                            ignore_eos=ns.ignore_eos, use_beam_search=ns.beam_width > 1, beam_width=ns.beam_width)
    outs = llm.generate(ns.prompt, params, use_tqdm=len(ns.prompt) > 1)
    for out in outs:
        for c in out.outputs:
            if ns.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason}, ensure_ascii=False))
            else:
                print(f"{out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    import dataclasses

    from minivllm.entrypoints.api_server import run_server
    from minivllm.entrypoints.server_args import ServerArgs

    server_args = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    logging.getLogger().setLevel(server_args.log_level.upper())
    run_server(EngineArgs.from_cli_args(ns), server_args)
    return 0


def _cmd_make_model(ns: argparse.Namespace) -> int:
    from minivllm.modelgen.make_model import make_model

    path = make_model(ns.preset, ns.out, dtype=ns.dtype, seed=ns.seed, max_shard_size=ns.max_shard_size)
    print(f"wrote {ns.preset} to {path}")
    return 0


def _cmd_make_lora(ns: argparse.Namespace) -> int:
    from minivllm.modelgen.make_lora import make_lora

    targets = tuple(t.strip() for t in ns.targets.split(",") if t.strip())
    path = make_lora(ns.base, ns.out, rank=ns.rank, alpha=ns.alpha, targets=targets, seed=ns.seed, std=ns.std)
    print(f"wrote a rank-{ns.rank} LoRA adapter for {ns.base} to {path}")
    return 0


def _cmd_quantize(ns: argparse.Namespace) -> int:
    import torch

    from minivllm.config import _DTYPES, ModelConfig
    from minivllm.model.loader import load_model
    from minivllm.model.quantized_checkpoint import save_quantized
    from minivllm.quant_config import QuantConfig

    mc = ModelConfig.from_pretrained(ns.model)
    if "quantization_config" in mc.hf_config:
        raise ValueError(f"{ns.model} is already quantized (its config has a quantization_config); quantize the "
                         "original model")
    cfg = QuantConfig(ns.quantization, ns.quantization_group_size, ns.quantize_lm_head)
    # Norms and embeddings keep the checkpoint's own dtype (float32 if it names none).
    dtype = _DTYPES.get(mc.checkpoint_dtype or "", torch.float32) if ns.dtype == "auto" else _DTYPES[ns.dtype]
    if ns.out.endswith(".gguf"):
        from minivllm.model.gguf_export import export_gguf

        if not os.path.isdir(mc.path):
            raise ValueError(f"quantize: {mc.path!r} is not a Hugging Face model directory")
        report = export_gguf(mc.path, cfg, ns.out, dtype, ns.gguf_int4_type)
        types = ", ".join(f"{n} {t}" for t, n in sorted(report.types.items()))
        print(f"wrote {cfg.method} model to {report.path} as GGUF ({types}; {report.nbytes / 2**20:.1f} MiB); "
              f"llama.cpp opens it, and so does `minivllm serve {report.path}`")
        return 0
    model = load_model(mc, dtype, torch.device("cpu"), mc.max_position_embeddings, cfg)
    out = save_quantized(model, mc, cfg, ns.out)
    print(f"wrote {cfg.method} model to {out}")
    return 0


def build_parser(bench_verbs: bool = True) -> argparse.ArgumentParser:
    """The argument parser of every verb; without `bench_verbs`, `bench` has none of its own (a command line that
    is not `bench ...` never parses them)."""
    from minivllm.modelgen.presets import PRESETS

    parser = argparse.ArgumentParser(prog="minivllm", description="Mini-vLLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (offline, greedy by default)")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    gen.add_argument("--beam-width", type=int, default=1, help="> 1: beam search with this many beams")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_cmd_generate)

    from minivllm.cli_args import add_dataclass_args
    from minivllm.entrypoints.server_args import ServerArgs

    srv = sub.add_parser("serve", help="serve a model over HTTP (seed endpoints, OpenAI API, SSE, WebSocket)")
    EngineArgs.add_cli_args(srv, positional_model=True)
    add_dataclass_args(ServerArgs, srv)
    srv.set_defaults(func=_cmd_serve)

    mk = sub.add_parser("make-model", help="write a test model (random weights, real architecture config)")
    mk.add_argument("--preset", required=True, choices=sorted(PRESETS), help="architecture preset")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--seed", type=int, default=0, help="weight seed")
    mk.add_argument("--max-shard-size", default=None, help="write sharded safetensors, e.g. 200MB")
    mk.set_defaults(func=_cmd_make_model)

    ml = sub.add_parser("make-lora", help="write a PEFT LoRA adapter with random weights for a model (needs peft)")
    ml.add_argument("base", help="the base model's directory")
    ml.add_argument("--out", required=True, help="output directory")
    ml.add_argument("--rank", type=int, default=8)
    ml.add_argument("--alpha", type=float, default=16.0)
    ml.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    help="comma-separated modules to adapt")
    ml.add_argument("--seed", type=int, default=0)
    ml.add_argument("--std", type=float, default=0.05, help="std of the random A and B weights")
    ml.set_defaults(func=_cmd_make_lora)

    qz = sub.add_parser("quantize", help="save a quantized copy of a model that loads without re-quantizing")
    qz.add_argument("model", help="Hugging Face-format model directory")
    qz.add_argument("--quantization", required=True, choices=QUANTIZATION_METHODS)
    qz.add_argument("--quantization-group-size", type=int, default=32, help="int4, w4a8: weights per scale/min group")
    qz.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True,
                    help="quantize the LM head too")
    qz.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of the tensors left in full precision (auto: the checkpoint's)")
    qz.add_argument("--out", required=True, help="output directory (new or empty), or a new .gguf file: the model "
                    "as GGUF (int8 / w8a8 as Q8_0, int4 / w4a8 as Q4_1 or Q4_0), which llama.cpp opens")
    qz.add_argument("--gguf-int4-type", default="Q4_1", choices=["Q4_1", "Q4_0"],
                    help="GGUF output of int4 / w4a8: Q4_1 (scale and min: the engine's own groups) or Q4_0 "
                         "(symmetric, 2 bytes fewer per 32 weights)")
    qz.set_defaults(func=_cmd_quantize)

    from minivllm.profiling.monitor import add_monitor_args, run_monitor
    from minivllm.profiling.profiler import add_profile_args, run_profile

    mon = sub.add_parser("monitor", help="sample a running process (RSS, peak RSS, context switches, CPU%%, "
                                         "threads, page faults) into a CSV and a plot")
    add_monitor_args(mon)
    mon.set_defaults(func=run_monitor)
    prof = sub.add_parser("profile", help="perf stat counters and a py-spy flame graph of a running process")
    add_profile_args(prof)
    prof.set_defaults(func=run_profile)

    bench = sub.add_parser("bench", help="benchmarks")
    if bench_verbs:  # (each bench module's flags import it, and several import the engine: seconds per call)
        bsub = bench.add_subparsers(dest="bench", required=True)
        from minivllm.bench.verbs import add_bench_verbs

        add_bench_verbs(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `minivllm` command."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    ns = build_parser(bench_verbs=args[:1] == ["bench"]).parse_args(args)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"minivllm {ns.command}: error: {e}", file=sys.stderr)
        return 2

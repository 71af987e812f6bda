"""ModelRunner: one step's scheduled sequences → flat tensors → one forward → logits of sampled rows."""

from __future__ import annotations

import itertools
import logging
import tempfile
import time
from typing import Any

import numpy as np
import torch

from minivllm.distributed.parallel import check_tensor_parallel, intermediate_size
from minivllm.distributed.tp_group import TensorParallelGroup
from minivllm.engine_config import EngineConfig, ParallelConfig
from minivllm.model.attention import (
    Attention,
    AttentionMetadata,
    KVGroupTables,
    PrefillSpan,
    forward_context,
    get_backend,
)
from minivllm.model.decode_stack import DecodeStack
from minivllm.model.gguf_conversion import gguf_conversions
from minivllm.model.hugepages import collapse_in_place
from minivllm.model.input_batch import SequenceInput
from minivllm.model.kernel_plan import PlanCheck, plan_kernels, plan_kinds
from minivllm.model.kv_quant import indexable, is_quantized, kv_storage_dtype
from minivllm.model.kv_swap import HostKVTier, block_bytes, check_capacity, uses_pinned_memory
from minivllm.model.layers import Linear, bucket_rows, onednn_linear_available
from minivllm.model.loader import load_model
from minivllm.model.lora import LoRAModelManager, build_mapping
from minivllm.model.models import get_model_class, kv_windows
from minivllm.model.quantization import QuantizedLinear, check_device
from minivllm.model.row_order import choose_few_rows, choose_row_order, choose_w4a8_rows
from minivllm.model.stack_plan import StackCheck, plan_classes_with_stack
from minivllm.model.step_sampling import RunnerOutput, SamplingRequest, StepSampler
from minivllm.model.superblock_linear import SuperblockLinear
from minivllm.model.weight_layout import choose_layout, eligible, second_layout_affordable

logger = logging.getLogger(__name__)


def _use_onednn(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    if name not in ("auto", "onednn", "onednn_plain", "torch", "native"):
        raise ValueError(f"linear_backend: unknown {name!r}; choose auto, onednn, onednn_plain, native or torch")
    available = onednn_linear_available(device, dtype)
    if name.startswith("onednn") and not available:
        raise ValueError(f"linear_backend: onednn needs a CPU with oneDNN and fp32/bf16 weights ({device}, {dtype})")
    return available and name in ("auto", "onednn")


class ModelRunner:
    """Owns the model and the KV pool; turns SequenceInputs into logits."""

    # A registry class (model/models/): its forward, compute_logits, layers and decode_stack are its own, not
    # nn.Module's (which types them `Tensor | Module`); declared here, not narrowed to load_model's nn.Module.
    model: Any

    def __init__(self, config: EngineConfig, num_blocks: int, group_blocks: tuple[int, ...] | None = None,
                 parallel: ParallelConfig | None = None) -> None:
        """The model of config (engine_config.EngineConfig, whole) with a KV pool of num_blocks blocks, or with
        group_blocks, a pool per attention window; `parallel` is set on the ranks a tensor-parallel rank 0 spawns."""
        self.config = config
        ms, c = config.model, config.cache
        self.mc, self.dtype, self.device = mc, dtype, device = config.model_config, ms.dtype, ms.device
        self.block_size = block_size = c.block_size
        max_model_len, quant, sink_window = ms.max_model_len, ms.quantization, c.sink_window
        check_device(quant, device)
        # Tensor parallelism: as rank 0 (tensor_parallel_size > 1) spawn the other ranks, which build their own
        # runner from the same config with `parallel` set; each loads the model and keeps its shard.
        self.group: TensorParallelGroup | None = None
        if parallel is None:
            parallel = config.parallel
            refusal = getattr(get_model_class(mc), "tensor_parallel_refusal", None)
            if parallel.size > 1 and refusal:
                raise ValueError(f"tensor_parallel_size: {mc.architecture} cannot be split across ranks: {refusal}")
            check_tensor_parallel(mc, parallel.size, intermediate_size(mc))
            if parallel.size > 1:
                threads = max(1, torch.get_num_threads() // parallel.size)
                torch.set_num_threads(threads)  # the ranks share this machine's cores
                self.group = TensorParallelGroup(parallel.size, threads, dict(
                    config=config, num_blocks=num_blocks, group_blocks=group_blocks))
        self.parallel = parallel
        self.model = load_model(mc, dtype, device, max_model_len, quant, parallel)
        self.head = self.model.compute_logits if ms.runner == "generate" else lambda h: h.float()  # pooling: states
        # Shape class → kernel of the full-precision and of the quantized projections, timed on this machine.
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        # oneDNN's packed layout and the native GEMM's panels (layers.Linear): second copies where memory allows.
        affordable, onednn = second_layout_affordable(linears), _use_onednn(ms.linear_backend, device, dtype)
        for m in linears:
            if onednn and (ms.linear_backend == "onednn" or affordable):
                m.pack(keep_weight=ms.linear_backend == "auto")
            m.allow_panels = affordable and ms.linear_backend in ("auto", "native")
        quantized = [m for m in self.model.modules() if isinstance(m, QuantizedLinear | SuperblockLinear)]
        # Before the plans time the native kernels: how their one-token rows stream here (model/row_order.py), timed
        # on the decoder's layers a plan may run natively, in the model's order; not on the head, which may still
        # change (a GGUF file's is converted after this: a 1B model's float32 head, 1 GB, was all a timing read).
        native = ("auto", "native")
        head = getattr(self.model, "lm_head", None)
        ordered = [m for m in self.model.modules() if m is not head and (
            (isinstance(m, Linear) and ms.linear_backend in native)
            or (isinstance(m, QuantizedLinear | SuperblockLinear) and ms.quantization_kernel in native))]
        self.row_order = choose_row_order(ordered, dtype)
        self.w4a8_rows = choose_w4a8_rows(ordered, dtype)
        self.few_rows = choose_few_rows(ordered, dtype)
        # One layout where two do not fit: the plain weight or the GEMM's panels alone, timed (model/weight_layout.py).
        self.weight_layout = choose_layout(linears, ms.linear_backend, dtype) if not affordable and not quantized \
            and eligible(linears, self.model, ms.linear_backend) else None
        self.linear_plan = plan_kernels(linears, ms.linear_backend, "linear_backend", dtype)
        self.linear_kernels = self.linear_plan.names
        for m in linears:
            m.release_unused()
        collapse_in_place([t for m in linears for t in m.kernel_copies()], "packed weights")  # those kept
        self.quant_plans = plan_kinds(quantized, ms.quantization_kernel, f"quantization {quant and quant.method}",
                                      dtype)  # (a plan per kind: a GGUF file's int4 layers beside int8 blocks)
        self.quant_kernels = self.quant_plans[0].names
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert len(layers) == mc.num_layers
        # Each layer's attention window (None: full attention); Gemma's local and global layers differ.
        self.layer_windows: tuple[int | None, ...] = tuple(layer.sliding_window for layer in layers)
        # --kv-eviction sink-window (StreamingLLM): every token attends to the first sink_tokens positions and
        # the last window_tokens; the engine frees the blocks in between.
        self.sink_tokens = 0
        if sink_window is not None:
            if any(w is not None for w in self.layer_windows):
                window = next(w for w in self.layer_windows if w is not None)
                raise ValueError(f"kv_eviction: {mc.architecture} already attends through a sliding window of "
                                 f"{window} tokens; sink-window eviction is for full-attention models")
            self.sink_tokens = sink_window[0]
            self.layer_windows = (sink_window[1],) * len(layers)
            for layer in layers:
                layer.sliding_window = sink_window[1]
        # KV groups (engine/kv_groups.py): the layers of one window share a pool and a block table; with
        # group_blocks, a pool per distinct window (full attention first; a window no shorter than max_model_len
        # counts as full: kv_windows), else one pool for every layer.
        grouped = kv_windows(self.layer_windows, max_model_len)
        windows = sorted(set(grouped), key=lambda w: (w is not None, w or 0))
        if group_blocks is None or len(windows) == 1:
            windows, group_blocks = [None], (num_blocks,)
        if len(group_blocks) != len(windows):
            raise ValueError(f"group_blocks: {len(group_blocks)} pools for {len(windows)} attention windows")
        self.num_kv_groups = len(windows)
        # One allocation per group: [2, layers, blocks, block_size, kv_heads, head_dim]; a quantized cache adds
        # float16 scales [2, layers, blocks, block_size, kv_heads] (model/kv_quant.py).
        self.kv_cache_dtype = kv_dtype = kv_storage_dtype(c.kv_cache_dtype, dtype, device)
        kv_heads = mc.kv_heads_per_rank(parallel.size)
        self.attention_backend = backend = get_backend(ms.attention_backend, device, dtype)
        # Per group, every tensor of its pool, each [2, layers, num_blocks, ...]: whole-block copies (copy-on-write,
        # swap) move the same block index in all of them.
        self.group_pools: list[list[torch.Tensor]] = []
        for g, (w, nb) in enumerate(zip(windows, group_blocks, strict=True)):
            members = [layer for layer, lw in zip(layers, grouped, strict=True) if len(windows) == 1 or lw == w]
            cache = torch.zeros(2, len(members), nb, block_size, kv_heads, mc.head_dim, dtype=kv_dtype, device=device)
            scales = (torch.zeros(2, len(members), nb, block_size, kv_heads, dtype=torch.float16, device=device)
                      if is_quantized(kv_dtype) else None)
            for i, layer in enumerate(members):
                layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
                if scales is not None:
                    layer.k_scale, layer.v_scale = scales[0, i], scales[1, i]
                layer.backend, layer.kv_group = backend, g
            self.group_pools.append([cache] + ([scales] if scales is not None else []))
        self.kv_pools: list[torch.Tensor] = self.group_pools[0]
        self.kv_cache = self.kv_pools[0]
        self.kv_scales = self.kv_pools[1] if len(self.kv_pools) > 1 else None
        # All-decode steps in one native call where the stack runs the kernels planned above.
        # (Not with tensor parallelism: the stack's layers have no all-reduce between them.)
        self.decode_stack = None if ms.enforce_eager or parallel.size > 1 else DecodeStack.build(self.model)
        self.model.decode_stack = self.decode_stack  # (None: the model runs its modules)
        self.last_forward_time = 0.0  # seconds in the model (forward + logits) during the last execute
        # Whether the last forward was this runner's first over its tokens' row bucket (layers.bucket_rows): oneDNN
        # builds its primitives for each new shape, and such a step of the embedded model took 1.4-3.4 ms more than
        # the next one of its size (3-6 ms steps, Zen 4): a cost model that priced a size by it kept proposals from
        # that size (spec_decode/cost.py StepCostTable).
        self.last_forward_first = False
        self._sizes_run: set[int] = set()
        self.sampling = StepSampler(device, ms.seed)  # the step's sampler and persistent input batch (rank 0's)
        self.lora: LoRAModelManager | None = None  # adapter slots, when the engine enables LoRA (init_lora)
        self.host_tiers: list[HostKVTier | None] = []  # preemption by swap's host tier per KV group (init_swap)
        self.plan_check: PlanCheck | None = None
        # Classes decided by timing whole steps, re-checked on serving steps (None while those steps are timed).
        self.stack_check: StackCheck | None = None
        self.stack_check = plan_classes_with_stack(self)
        # Steps faster than the start-up timings allow re-time their class (not on CUDA: its forward time is not
        # synchronized; not across tensor-parallel ranks, which must keep one plan).
        cpu_alone = device.type == "cpu" and parallel.size == 1
        self.head_conversion, self.layer_conversion = gguf_conversions(self)  # GGUF's conversions, errors logged
        plans = [self.linear_plan, *self.quant_plans, *([self.head_conversion.plan] if self.head_conversion else [])]
        self.plan_check = PlanCheck(plans) if cpu_alone else None

    def init_lora(self, max_loras: int, max_rank: int) -> LoRAModelManager:
        """Give every adaptable projection max_loras LoRA slots of rank max_rank (--enable-lora)."""
        if self.parallel.size > 1:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor parallelism")
        if not hasattr(self.model, "layers") or not hasattr(self.model.layers[0], "self_attn"):
            raise ValueError(f"enable_lora: LoRA adapters are supported for the Llama family, not "
                             f"{self.mc.architecture}")
        self.lora = LoRAModelManager(self.model, max_loras, max_rank, self.dtype, self.device)
        return self.lora

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]], kv_group: int = 0) -> None:
        """Copy-on-write: duplicate whole blocks (all the group's layers, K and V) before they are written."""
        if not copies:
            return
        if self.group is not None:
            self.group.command("_copy", copies, kv_group)
        self._copy(copies, kv_group)

    def _copy(self, copies: list[tuple[int, int]], kv_group: int = 0) -> None:
        src, dst = (torch.tensor(list(ids), device=self.device) for ids in zip(*copies, strict=True))
        for pool in map(indexable, self.group_pools[kv_group]):
            pool[:, :, dst] = pool[:, :, src]

    @property
    def swap_block_bytes(self) -> int:
        """Bytes of one block in the host tier (this rank's shard of every pool tensor)."""
        return block_bytes(self.kv_pools)

    def group_block_bytes(self, kv_group: int) -> int:
        """Bytes of one block of a KV group's pool (its layers' K and V, this rank's shard)."""
        return block_bytes(self.group_pools[kv_group])

    @property
    def host_tier(self) -> HostKVTier | None:
        """The primary KV group's host tier (init_swap), None before."""
        return self.host_tiers[0] if self.host_tiers else None

    def init_swap(self, num_blocks: int, swap_dir: str | None, kv_group: int = 0) -> float:
        """Allocate a KV group's host tier of num_blocks blocks (under tensor parallelism every rank its own
        shard's); returns this rank's measured seconds to swap one block (HostKVTier.probe)."""
        pools = self.group_pools[kv_group]
        if self.parallel.rank == 0:  # one check for every rank's tier, before any allocates
            check_capacity(num_blocks * block_bytes(pools) * self.parallel.size,
                           uses_pinned_memory(self.device, swap_dir), swap_dir or tempfile.gettempdir())
        if self.group is not None:
            self.group.command("init_swap", num_blocks, swap_dir, kv_group)
        self.host_tiers += [None] * (kv_group + 1 - len(self.host_tiers))
        tier = self.host_tiers[kv_group] = HostKVTier(pools, num_blocks, swap_dir)
        return tier.probe(pools, min(8, num_blocks, pools[0].shape[2]))

    @torch.inference_mode()
    def move_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                    copies: list[tuple[int, int]], kv_group: int = 0) -> float:
        """A step's block moves in one KV group, each a list of (src, dst): swap-outs to the host tier, swap-ins
        from it, then copy-on-write copies. Returns the seconds the swaps took (for preemption_mode=auto)."""
        if not (swap_out or swap_in or copies):
            return 0.0
        if self.group is not None:
            self.group.command("_move", swap_out, swap_in, copies, kv_group)
        t0 = time.perf_counter()
        self._move(swap_out, swap_in, copies, kv_group)
        return time.perf_counter() - t0 if swap_out or swap_in else 0.0

    def _move(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
              copies: list[tuple[int, int]], kv_group: int = 0) -> None:
        # In this order: the scheduler may hand blocks a swap-out released to a swap-in or a copy-on-write of
        # the same step, so they are read out before anything is written into them.
        pools = self.group_pools[kv_group]
        if swap_out or swap_in:
            tier = self.host_tiers[kv_group] if kv_group < len(self.host_tiers) else None
            assert tier is not None, "swaps without init_swap"
            if swap_out:
                tier.swap_out(pools, swap_out)
            if swap_in:
                tier.swap_in(pools, swap_in)
        if copies:
            self._copy(copies, kv_group)

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput]) -> torch.Tensor:
        """Run one forward over all scheduled tokens; return float32 logits in the order of `seqs`: one row
        per token for `all_logits` inputs, else one row for a sampling input, none otherwise."""
        return self._forward(*self._prepare(seqs))

    def sample(self, logits: torch.Tensor, req: SamplingRequest) -> RunnerOutput:
        """The step's tokens and logprobs from the logits execute returned (model/step_sampling.py)."""
        return self.sampling.run(logits, req)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                 logits_indices: torch.Tensor | None) -> torch.Tensor:
        """The model on prepared inputs → logits of the rows in logits_indices (None: every row). Under
        tensor parallelism every rank runs this on the inputs rank 0 broadcasts."""
        if self.group is not None:
            self.group.command("_forward", input_ids, positions, md, logits_indices)
        t0 = time.perf_counter()
        with forward_context(md):
            hidden = self.model(input_ids, positions)
        logits = self.head(hidden if logits_indices is None else hidden[logits_indices])
        self.last_forward_time = time.perf_counter() - t0
        m = bucket_rows(len(input_ids))  # (oneDNN's primitives are per bucket)
        self.last_forward_first = m not in self._sizes_run
        if self.last_forward_first:
            self._sizes_run.add(m)
        if self.plan_check is not None and self.plan_check.observe(len(input_ids), self.last_forward_time) \
                and self.decode_stack is not None:
            self.decode_stack.refresh(self.model)
        if self.stack_check is not None:
            self.stack_check.observe(md, len(input_ids), self.last_forward_time)
        return logits

    @torch.inference_mode()
    def execute_decodes(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor
                        ) -> torch.Tensor:
        """A step of one-token decodes given as tensors, one row each: the token ids and positions [M], the
        block tables [M, B] (int64, on the device); returns logits [M, V]. A draft model's proposal loop
        builds its tables once for its k forwards, where `execute` would pack them again every time."""
        bs = self.block_size
        slots = block_tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        md = AttentionMetadata(slot_mapping=slots, num_decodes=token_ids.shape[0], decode_block_tables=block_tables,
                               decode_positions=positions, max_decode_seq_len=int(positions.max()) + 1,
                               prefills=[], sink_tokens=self.sink_tokens)
        return self._forward(token_ids, positions, md, None)

    def _prepare(self, seqs: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                              torch.Tensor]:
        """Pack every scheduled token flat (decodes first, then prefill chunks) and build the metadata."""
        n = len(seqs)
        q_lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        # Stable order: one-token queries first so they share one batched decode attention call; with LoRA, each
        # adapter's sequences next to each other within those (its tokens in one run: model/lora.py).
        lora_slots = np.fromiter((s.lora for s in seqs), np.int64, n) if self.lora is not None else None
        order = (np.argsort(q_lens != 1, kind="stable") if lora_slots is None
                 else np.lexsort((lora_slots, q_lens != 1)))
        seqs_o = [seqs[i] for i in order]
        q_lens = q_lens[order]
        starts = np.fromiter((s.start_pos for s in seqs_o), np.int64, n)
        total = int(q_lens.sum())
        cu = np.cumsum(q_lens)
        first = cu - q_lens
        input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs_o), np.int64, total)
        positions = np.arange(total) - np.repeat(first - starts, q_lens)
        rows = np.repeat(np.arange(n), q_lens)
        nd = int((q_lens == 1).sum())
        dev = self.device
        # Each KV group's tables and slots (one group unless the model mixes attention windows).
        groups = [self._group_tables([s.block_table for s in seqs_o], rows, positions, nd)]
        assert all(len(s.group_tables) == self.num_kv_groups - 1 for s in seqs_o), \
            f"every SequenceInput needs its block tables in the model's {self.num_kv_groups} KV groups"
        for g in range(1, self.num_kv_groups):
            groups.append(self._group_tables([s.group_tables[g - 1] for s in seqs_o], rows, positions, nd))
        seq_lens = starts + q_lens
        md = AttentionMetadata(
            slot_mapping=groups[0].slot_mapping, num_decodes=nd, decode_block_tables=groups[0].decode_block_tables,
            decode_positions=None, max_decode_seq_len=0, prefills=[], sink_tokens=self.sink_tokens,
            groups=groups[1:])
        if lora_slots is not None:
            md.lora = build_mapping(np.repeat(lora_slots[order], q_lens))
        if nd:
            md.decode_positions = torch.from_numpy(positions[:nd]).to(dev)
            md.max_decode_seq_len = int(seq_lens[:nd].max())
        for i in range(nd, n):
            md.prefills.append(self._prefill_span(int(first[i]), int(cu[i]), int(starts[i]), seqs_o[i]))

        # Rows come back in the caller's order: the last token of each sampling sequence, or every token
        # of a chunk that wants prompt logprobs.
        inv = np.empty(n, np.int64)
        inv[order] = np.arange(n)
        ends = cu[inv]
        if any(s.all_logits for s in seqs):
            logits_indices = np.concatenate([
                np.arange(ends[i] - len(s.token_ids), ends[i]) if s.all_logits else ends[i:i + 1] - 1
                for i, s in enumerate(seqs) if s.sample or s.all_logits]).astype(np.int64)
        else:
            logits_indices = ends[np.fromiter((s.sample for s in seqs), bool, n)] - 1
        return (torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), md,
                torch.from_numpy(logits_indices).to(dev))

    def _group_tables(self, block_tables: list[list[int]], rows: np.ndarray, positions: np.ndarray, nd: int
                      ) -> KVGroupTables:
        """One KV group's slots for the step's tokens and its decode rows' block tables, packed with one flat read
        and one masked write (no per-row numpy calls)."""
        n = len(block_tables)
        n_blocks = np.fromiter((len(t) for t in block_tables), np.int64, n)
        max_blocks = int(n_blocks.max())
        tables = np.zeros((n, max_blocks), np.int64)
        tables[np.arange(max_blocks)[None, :] < n_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), np.int64, int(n_blocks.sum()))
        bs = self.block_size
        slot_mapping = tables[rows, positions // bs] * bs + positions % bs
        decode = torch.from_numpy(tables[:nd, :int(n_blocks[:nd].max())]).to(self.device) if nd else None
        return KVGroupTables(torch.from_numpy(slot_mapping).to(self.device), decode)

    def _prefill_span(self, start: int, end: int, num_cached: int, s: SequenceInput) -> PrefillSpan:
        """A chunk without cached context attends to its own K/V; one with context reads its blocks in each KV group
        (masks per window are built by the attention layers that need them)."""
        if num_cached == 0:
            return PrefillSpan(start, end, 0, None)
        nblocks = -(-(num_cached + end - start) // self.block_size)
        tables = [torch.tensor(t[:nblocks], device=self.device) for t in s.group_tables]
        return PrefillSpan(start, end, num_cached, torch.tensor(s.block_table[:nblocks], device=self.device),
                           group_tables=tables)

"""Patched upstream `HunyuanMoE`: dropless grouped-matmul experts, TP or EP, shared MLP on a side stream.

Forward of one layer (T tokens, K = top-k):

    gate (fp32, replicated) -> route (upstream topkgating's combine weights, no [S, E, C] mask)
    shared MLP  ............ on `shared_mlp_stream` when one is injected (model.py), else inline
    permute (tokens sorted by expert) -> grouped matmul w13 -> SwiGLU -> grouped matmul w2
    unpermute (weighted combine) -> wait "shared done" -> add -> [TP: one all-reduce]
    (ops.routed_experts; on CPU with many tokens, moe_cpu.py fuses these steps around a padded bmm)

Modes (from `parallel.runtime()`: sharding read at __init__, groups at forward):
  replicated  every expert whole on every rank.
  tp          every expert's intermediate split over the "tp" group, the shared MLP too; routed and
              shared partial sums leave through ONE all-reduce.
  ep          experts split contiguously over the "tp" group. The (replicated) token rows are cut
              into contiguous per-rank chunks (uneven and empty allowed); each rank routes its chunk:
              all_to_all of per-expert counts, all_to_all_single of the rows, local grouped matmul,
              all_to_all_single back, weighted combine, + the shared MLP of the chunk; one
              all-gather (rows padded to the largest chunk) replicates the output again.

Host syncs per layer: replicated 0, tp 0, ep 1 (one `.tolist()` of the exchanged counts, which
the all-to-all split sizes need). The "loop" and "cpu" forms (ops.py) add one `.tolist()` per
matmul or per layer; "cpu" is the CPU default, where a host sync costs nothing.

Streams: "input ready" is recorded on the main stream, the side stream waits on it and runs the
shared MLP, then records "shared done"; the main stream waits on that before the add.
`record_stream` marks the input as used by the side stream and the shared output as used by the
main stream so the caching allocator cannot hand either block out early. On CPU there is no
stream: the same code runs inline. The NPU and CUDA stream paths have not been run on hardware here.

Upstream's `moe_impl` ("eager" / "flashinfer") is ignored: routing always follows topkgating.
Weight layout and loading: moe_weights.py.
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import ops
from .moe_weights import MoeShard, stack_upstream_keys
from .parallel import runtime


def _per_layer(value, layer_idx):
    return value if isinstance(value, int) else value[layer_idx]


class GroupedExperts(nn.Module):
    """This rank's experts, stacked for grouped matmul (layout: moe_weights.py)."""

    def __init__(self, hidden: int, intermediate: int, shard: MoeShard, init_std: float):
        super().__init__()
        self.shard = shard
        local = shard.local_size(intermediate)
        self.w13 = nn.Parameter(torch.empty(shard.local_experts, hidden, 2 * local))
        self.w2 = nn.Parameter(torch.empty(shard.local_experts, local, hidden))
        nn.init.normal_(self.w13, std=init_std)
        nn.init.normal_(self.w2, std=init_std)

    def forward(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows already grouped by local expert (EP, after the all-to-all)."""
        return ops.expert_mlp(sorted_x, self.w13, self.w2, counts)

    def routed(self, tokens, topk_weight, topk_idx, add_to=None) -> torch.Tensor:
        """The weighted sum of each token's experts (every expert is local: replicated or TP)."""
        return ops.routed_experts(tokens, topk_weight, topk_idx, self.w13, self.w2, add_to)


# ---------------------------------------------------------------- __init__

def _check_supported(config) -> None:
    if config.hidden_act != "silu":
        raise NotImplementedError(f"moe: hidden_act '{config.hidden_act}' is not supported by the patched MoE "
                                  f"(silu only)")
    if config.mlp_bias:
        raise NotImplementedError("moe: mlp_bias=True is not supported by the patched MoE")
    if config.group_limited_greedy:
        raise NotImplementedError("moe: group_limited_greedy routing is not supported by the patched MoE")
    if config.moe_drop_tokens:
        warnings.warn("moe: config.moe_drop_tokens=True, but the patched MoE is dropless (no token is dropped)")


def _layer_shard(num_experts: int) -> MoeShard:
    rt = runtime()
    settings = rt.settings
    if settings.moe_degree > 1 and rt.mesh is None:
        raise RuntimeError(f"moe-{settings.moe_mode}: degree {settings.moe_degree} needs an initialised process "
                           f"group before the model is built (torch.distributed.init_process_group)")
    return MoeShard.for_rank(settings.moe_mode, num_experts, settings.moe_degree, rt.group_rank("tp"))


def _shard_shared_mlp(mlp: nn.Module, shard: MoeShard) -> None:
    """Shrink upstream's shared HunyuanMLP to this rank's intermediate slice (TP only)."""
    if shard.tp_degree == 1:
        return
    full = mlp.intermediate_size // 2
    local = shard.local_size(full)
    like = mlp.gate_and_up_proj.weight
    mlp.gate_and_up_proj = nn.Linear(mlp.hidden_size, 2 * local, bias=False, device=like.device, dtype=like.dtype)
    mlp.down_proj = nn.Linear(local, mlp.hidden_size, bias=False, device=like.device, dtype=like.dtype)
    mlp.intermediate_size = 2 * local


def moe_init(_original, _device):
    """Patch for HunyuanMoE.__init__ (the original is not called: it would build E full experts)."""

    def __init__(self, config, layer_idx=None):
        nn.Module.__init__(self)
        upstream = sys.modules[type(self).__module__]
        _check_supported(config)
        self.config = config
        self.layer_idx = layer_idx
        self.moe_topk = config.moe_topk
        self.num_experts = _per_layer(config.num_experts, layer_idx)
        shard = _layer_shard(self.num_experts)
        if config.use_mixed_mlp_moe:
            self.shared_mlp = upstream.HunyuanMLP(config, layer_idx=layer_idx, is_shared_mlp=True)
            _shard_shared_mlp(self.shared_mlp, shard)
        self.gate = upstream.HunyuanTopKGate(config, layer_idx=layer_idx)
        intermediate = _per_layer(config.moe_intermediate_size or config.intermediate_size, layer_idx)
        self.experts = GroupedExperts(config.hidden_size, intermediate, shard, config.initializer_range)
        self._moe_impl = config.moe_impl
        self.shared_mlp_stream = None           # set by model.py's HunyuanImage3Model.__init__
        self._register_load_state_dict_pre_hook(stack_upstream_keys, with_module=True)

    return __init__


# ---------------------------------------------------------------- forward

def moe_forward(_original, _device):
    """Patch for HunyuanMoE.forward."""

    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_size)
        group = runtime().group("tp") if self.experts.shard.mode != "replicated" else None
        if self.experts.shard.mode == "ep":
            output = _forward_ep(self, tokens, group)
        else:
            output = _forward_local_experts(self, tokens, group)
        return output.view(bsz, seq_len, hidden_size)

    return forward


def _forward_local_experts(moe, tokens, tp_group):
    shared = _launch_shared_mlp(moe, tokens)
    topk_weight, topk_idx = _route(moe, tokens)
    if shared is not None and shared[1] is None:
        # No side stream: the shared output is already complete, so the routed sum goes straight into it.
        output = moe.experts.routed(tokens, topk_weight, topk_idx, add_to=shared[0])
    else:
        output = _merge_shared(moe.experts.routed(tokens, topk_weight, topk_idx), shared)
    if tp_group is not None:
        dist.all_reduce(output, group=tp_group)
    return output


def _forward_ep(moe, tokens, ep_group):
    shard = moe.experts.shard
    ep_size, ep_rank = shard.num_experts // shard.local_experts, shard.first_expert // shard.local_experts
    sizes = chunk_sizes(tokens.shape[0], ep_size)
    start = sum(sizes[:ep_rank])
    chunk = tokens[start:start + sizes[ep_rank]]
    shared = _launch_shared_mlp(moe, chunk)
    topk_weight, topk_idx = _route(moe, chunk)
    sorted_x, row_idx, counts = ops.permute(chunk, topk_idx, moe.num_experts)
    expert_out = _experts_across_ranks(moe.experts, sorted_x, counts, ep_group)
    output = _merge_shared(ops.unpermute(expert_out, row_idx, topk_weight), shared)
    return all_gather_rows(output, sizes, ep_group)


def _route(moe, tokens):
    gate = moe.gate
    if tokens.shape[0] == 0:        # an empty EP chunk: no gate matmul on zero rows
        return (torch.empty(0, gate.moe_topk, dtype=torch.float32, device=tokens.device),
                torch.empty(0, gate.moe_topk, dtype=torch.int64, device=tokens.device))
    gate_input = tokens.float() if gate.wg.weight.dtype == torch.float32 else tokens
    return ops.route(gate.wg(gate_input), gate.moe_topk, gate.norm_topk_prob, gate.routed_scaling_factor)


def _experts_across_ranks(experts, sorted_x, counts, group):
    """Double routing: rows sorted by global expert go to the expert's owner and come back computed."""
    ep_size, local_experts = dist.get_world_size(group), experts.shard.local_experts
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(ep_size, local_experts)        # [source rank, local expert]
    # The one host sync of the layer: split sizes must be Python ints.
    send_splits, recv_splits = torch.stack([counts.view(ep_size, local_experts).sum(1),
                                            received_counts.sum(1)]).tolist()
    received = sorted_x.new_empty(sum(recv_splits), sorted_x.shape[1])
    dist.all_to_all_single(received, sorted_x.contiguous(), recv_splits, send_splits, group=group)
    grouped, order, local_counts = ops.regroup(received, received_counts)
    computed = ops.ungroup(experts(grouped, local_counts), order)
    returned = computed.new_empty(sorted_x.shape[0], computed.shape[1])
    dist.all_to_all_single(returned, computed.contiguous(), send_splits, recv_splits, group=group)
    return returned


# torch 2.14 renamed all_gather_into_tensor to all_gather_single; torch_npu builds may predate it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def chunk_sizes(rows: int, parts: int) -> list:
    """Contiguous split sizes of `rows` over `parts` ranks, like torch.tensor_split (first ones longer)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if p < extra else 0) for p in range(parts)]


def all_gather_rows(local: torch.Tensor, sizes: list, group) -> torch.Tensor:
    """Concatenate every rank's rows (uneven counts) on every rank, via one padded all-gather."""
    longest = max(sizes)
    padded = local
    if local.shape[0] != longest:
        padded = local.new_zeros(longest, local.shape[1])
        padded[:local.shape[0]] = local
    gathered = local.new_empty(len(sizes) * longest, local.shape[1])
    _all_gather_single(gathered, padded.contiguous(), group=group)
    if all(size == longest for size in sizes):
        return gathered
    gathered = gathered.view(len(sizes), longest, -1)
    return torch.cat([gathered[rank, :size] for rank, size in enumerate(sizes)])


# ---------------------------------------------------------------- shared MLP on the side stream

def _launch_shared_mlp(moe, tokens):
    """Start the shared MLP; returns None (no shared MLP) or (output, done_event or None)."""
    shared_mlp = getattr(moe, "shared_mlp", None)
    if shared_mlp is None:
        return None
    stream = moe.shared_mlp_stream
    if stream is None:
        return _shared_mlp_output(shared_mlp, tokens), None
    device = runtime().device
    input_ready = device.new_event()
    input_ready.record(device.current_stream())
    with device.stream_context(stream):
        input_ready.wait(stream)
        output = _shared_mlp_output(shared_mlp, tokens)
        shared_done = device.new_event()
        shared_done.record(stream)
    tokens.record_stream(stream)
    return output, shared_done


def _shared_mlp_output(shared_mlp, tokens):
    # Upstream's HunyuanMLP math on its own weights (checked silu/no bias at __init__), via ops so
    # that the CPU form can keep its intermediate in a reused buffer.
    return ops.shared_mlp(tokens, shared_mlp.gate_and_up_proj.weight, shared_mlp.down_proj.weight)


def _merge_shared(routed, shared):
    if shared is None:
        return routed
    output, shared_done = shared
    if shared_done is not None:
        main = runtime().device.current_stream()
        shared_done.wait(main)
        output.record_stream(main)
    return routed.add_(output)          # routed is this layer's own fresh tensor

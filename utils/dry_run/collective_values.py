"""What a collective hands back in a dry run, where its values are read on the host.

The fake backend moves no data, so a collective's output holds no values. Where the code reads
them (the EP dispatch's exchanged counts, a gathered length) the dry run's stand-in applies: every
other rank holds what this rank holds (ranks are symmetric under uniform routing). So
  all_reduce (sum)        -> input x group size      all_gather   -> the input, once per rank
  reduce_scatter (sum)    -> this rank's chunk x n   all_to_all   -> this rank's own chunk from each
  broadcast               -> unchanged
  all_gather_object       -> this rank's object, once per rank (not sent: the fake backend carries no
  broadcast_object_list      pickles, which torch reads back through .numpy()); the list unchanged
computed on the shadow values (utils/dry_run/fake_mode.py) when the input has them; otherwise the
output keeps none. Tensor shapes and devices are the real collective's either way.
"""
from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist


@contextlib.contextmanager
def symmetric_values(mode):
    saved = {}

    def wrap(name, fill):
        original = getattr(dist, name, None)
        if original is None:
            return
        saved[name] = original

        @functools.wraps(original)
        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            try:
                fill(mode.shadow, *args, **kwargs)
            except (KeyError, RuntimeError, IndexError, TypeError, ValueError):
                pass
            return result
        setattr(dist, name, call)

    def n(group):
        return dist.get_world_size(group)

    def me(group):
        return dist.get_rank(group)

    def all_reduce(shadow, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        value = shadow[tensor]
        shadow[tensor] = value * n(group) if op == dist.ReduceOp.SUM else value.clone()

    def all_gather_into_tensor(shadow, output, input, group=None, async_op=False):
        shadow[output] = torch.cat([shadow[input]] * n(group)).reshape(output.shape)

    def all_gather(shadow, tensor_list, tensor, group=None, async_op=False):
        for out in tensor_list:
            shadow[out] = shadow[tensor].clone()

    def reduce_scatter_tensor(shadow, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        chunk = shadow[input].chunk(n(group))[me(group)]
        shadow[output] = chunk * n(group) if op == dist.ReduceOp.SUM else chunk.clone()

    def all_to_all_single(shadow, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        value, size = shadow[input], n(group)
        splits = input_split_sizes or [value.shape[0] // size] * size
        own = value.split(list(splits))[me(group)]
        shadow[output] = torch.cat([own] * size).reshape(output.shape)

    def broadcast(shadow, tensor, src=None, group=None, async_op=False, group_src=None):
        pass

    for name, fill in (("all_reduce", all_reduce), ("all_gather_into_tensor", all_gather_into_tensor),
                       ("all_gather_single", all_gather_into_tensor), ("reduce_scatter_single", reduce_scatter_tensor),
                       ("all_gather", all_gather), ("reduce_scatter_tensor", reduce_scatter_tensor),
                       ("all_to_all_single", all_to_all_single), ("broadcast", broadcast)):
        wrap(name, fill)
    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [copy.deepcopy(obj) for _ in object_list]

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        pass
    for name, instead in (("all_gather_object", all_gather_object), ("broadcast_object_list", broadcast_object_list)):
        saved[name] = getattr(dist, name)
        setattr(dist, name, instead)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)

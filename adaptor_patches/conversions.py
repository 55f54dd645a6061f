"""transformers-5 checkpoint converters, registered for the length of one `from_pretrained` call.

transformers 5 loads parameters directly and never runs module load hooks; it applies the
`WeightConverter`s registered for a model class instead. The adaptor registers its own (MoE
stacking, attention head sharding) only while loading, and restores what was there after.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def converters_registered(class_name: str, converters: list):
    from transformers import conversion_mapping
    previous = conversion_mapping.get_checkpoint_conversion_mapping(class_name)
    conversion_mapping.register_checkpoint_conversion_mapping(class_name, converters, overwrite=True)
    try:
        yield
    finally:
        conversion_mapping.register_checkpoint_conversion_mapping(class_name, previous or [], overwrite=True)

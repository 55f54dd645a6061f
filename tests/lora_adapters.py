"""PEFT LoRA adapters made by the peft library itself on a tiny checkpoint (tests/test_lora*.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.checkpoints import rewritten_checkpoint


def make_adapter(base: Path, out: Path, targets: list, seed: int = 0) -> tuple:
    """(adapter folder, merged checkpoint): peft's LoRA on upstream's model (random A and B), saved
    with save_pretrained; and a copy of `base` with merge_and_unload()'s weights."""
    import model_adaptor
    from peft import LoraConfig, get_peft_model
    from utils.runtime.engine.rank_model import load_rank_model
    model, _ = load_rank_model(base, "cpu", shims_only=True)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    adapter = out / "adapter"
    peft_model.save_pretrained(str(adapter))
    merged_state = peft_model.merge_and_unload().state_dict()
    model_adaptor.remove()
    def merged_weight(key, value):
        return merged_state[key].to(value.dtype).contiguous() if key in merged_state else value
    merged = rewritten_checkpoint(base, out / "merged", merged_weight)
    return adapter, merged

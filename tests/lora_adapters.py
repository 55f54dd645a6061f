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


LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_mlp.gate_and_up_proj", "mlp.shared_mlp.down_proj")
EXPERTS = ("mlp.experts.{expert}.gate_and_up_proj", "mlp.experts.{expert}.down_proj")     # every routed expert


def random_adapter(model_dir: Path, folder: Path, rank: int = 4, seed: int = 0, targets=LINEARS) -> Path:
    """A PEFT-format LoRA adapter of `model_dir`'s `targets` with random halves, without peft (shapes from
    config.json alone, so a config-only folder such as config/real_model takes one too)."""
    import json
    from safetensors.torch import save_file
    from adaptor_patches.weights.config_shapes import expected_shape
    config = json.loads((Path(model_dir) / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    every = [t.format(expert=e) for t in targets for e in range(config.get("num_experts") or 1)] if any(
        "{expert}" in t for t in targets) else list(targets)
    targets = list(dict.fromkeys(every))
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            module = f"model.layers.{layer}.{target}"
            shape = expected_shape(f"{module}.weight", config)
            if shape is None:
                continue
            out, inp = shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, inp, generator=generator)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": sorted({t.rsplit(".", 1)[-1] for t in targets})}))
    return folder

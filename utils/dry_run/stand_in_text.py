"""The stand-in's text in a dry run: which token a text call "draws".

Fake logits name no token. If every draw were the end-of-text token, the text phase would stop at its
first token and its decode step (text.decode.DecodeStep, the static, captured step) would never run.
So in a dry run, and only there, each text call's tokens are TEXT_TOKENS times an ordinary token
(the tokenizer's "a", else its first non-special id), then the call's own stop token (its first): the loop
runs up to its next stop check (text.decode.CHECK_EVERY tokens), i.e. 7 decode steps.

The value is set on the tokens the static loop commits (text.decode.TextLoop._commit) on every rank
(rank 0's draw and the other ranks' broadcast copy alike, as on the device); a draw outside it
(transformers' own loop) is `fake_mode.DryRunMode.stand_in_token`, the end-of-text token.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

TEXT_TOKENS = 4


def ordinary_token(weights_dir: Path) -> int:
    """The id of "a" in the tokenizer's vocabulary, else the smallest id that is no added token."""
    data = json.loads((Path(weights_dir) / "tokenizer.json").read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict) and isinstance(vocab.get("a"), int):
        return vocab["a"]
    special = {t["id"] for t in data.get("added_tokens", [])}
    return next(i for i in range(len(special) + 1) if i not in special)


@contextlib.contextmanager
def stand_in_draws(mode, token: int, count: int = TEXT_TOKENS):
    """While open, token n of each text call (text.decode.TextLoop._commit, every rank) is `token` for
    n < count, then the call's first stop token."""
    from adaptor_patches.text import decode as text_decode
    original = text_decode.TextLoop._commit

    def commit(self, index, tokens, step):
        stop = self.eos.reshape(-1)
        value = token if index < count or stop.numel() == 0 else mode.shadow.get(stop, torch.tensor([token]))[0].item()
        mode.shadow[tokens] = torch.full(tokens.shape, value, dtype=tokens.dtype)
        return original(self, index, tokens, step)
    text_decode.TextLoop._commit = commit
    try:
        yield
    finally:
        text_decode.TextLoop._commit = original

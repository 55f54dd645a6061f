"""A batch's text phases decoded together (adaptor_patches/text_batch.py, text_rows.py): issue 36.

Fast (no model):
- a batched call's rows each draw from their own request's sampler (text_sampling.RowSamplers):
  the tokens of B rows equal each row's own DeviceChoice alone, sampled and greedy; swapping two
  rows' samplers changes them;
- the processors see a right-padded row as it is alone: its last prompt token triggers upstream's
  ratio slice / stage transitions at the first token, a repetition penalty sees its own tokens;
- which text calls share one call (text_rows.share_key).
Slow (the tiny checkpoints, in this process and on 2 gloo ranks):
- B = 3 / 4 requests with different prompts, seeds and bot tasks (base: think, recaption, the ratio
  of `auto`; Instruct: think_recaption with its forced transitions and ratio, edits with images,
  greedy) hand off exactly what each hands off alone: every text call's tokens, the text, the ratio,
  upstream's image-call arguments;
- a row that stops early emits pad and does not hold the others; the decode forwards of a batched
  call are the longest row's, not the sum (counted at the text model);
- a request whose text phase raises (a prompt beyond the context; upstream's unknown ratio token)
  gets its exception in its place, the others their texts;
- MoE EP2: the same on every rank, batched = alone there too.
Broken on purpose: the rows' samplers reversed in text_rows.BatchPhase -> every batched-vs-alone
test above fails (the sampled tokens differ from the first draw on).
"""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

import model_adaptor
from adaptor_patches.text_phase import SharedTokenSampler, call_sampler
from adaptor_patches.text_rows import TextAsk, share_key
from adaptor_patches.text_sampling import DeviceChoice, RowSamplers
from multirank import run_ranks

VOCAB = 40
SIZE, PAD = 35, 0


def _choices(processors, samplers, lengths):
    """The batched choice over right-padded rows, and one choice per row alone."""
    batched = DeviceChoice.from_processors([*processors(), RowSamplers(samplers, torch.tensor(lengths))],
                                           len(samplers), VOCAB, 0, False, "cpu")
    alone = [DeviceChoice.from_processors([*processors(), SharedTokenSampler(s.seed, s.do_sample)], 1, VOCAB, 0,
                                          False, "cpu") for s in samplers]
    return batched, alone


def _decode(processors, samplers, prompts, steps=24, seed=0):
    """Drive a batched choice as text_decode's loop does (right-padded prompts, new tokens in the
    columns after the longest) and each row alone over the same scores: [batched rows], [alone rows]."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.tensor([p + [PAD] * (width - len(p)) for p in prompts])
    batched, alone = _choices(processors, samplers, lengths)
    rows = [torch.tensor([p]) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        scores = torch.randn(len(prompts), VOCAB, generator=gen) * 3
        ids = torch.cat([ids, batched(ids, scores.clone())[:, None]], dim=1)
        rows = [torch.cat([row, choice(row, scores[r:r + 1].clone())[:, None]], dim=1)
                for r, (row, choice) in enumerate(zip(rows, alone))]
    together = [ids[r, width:].tolist() for r in range(len(prompts))]
    return together, [row[0, n:].tolist() for row, n in zip(rows, lengths)]


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_each_row_draws_from_its_own_sampler_as_alone(do_sample):
    samplers = [call_sampler(seed, 1, do_sample) for seed in (7, 8, 9)]
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
    batched, alone = _decode(lambda: [TopKLogitsWarper(10)], samplers, prompts)
    assert batched == alone
    if do_sample:
        swapped = [samplers[1], samplers[0], samplers[2]]
        assert _decode(lambda: [TopKLogitsWarper(10)], swapped, prompts)[0][:2] != batched[:2]


def test_the_processors_see_a_padded_row_as_it_is_alone():
    from hunyuan_image_3.modeling_hunyuan_image_3 import HunyuanImage3ForCausalMM as M

    def processors():
        return [RepetitionPenaltyLogitsProcessor(1.5), M._StageTransitionLogitsProcessor([(31, [32, SIZE])], 3),
                M._ConditionalSliceVocabLogitsProcessor([SIZE], 10, 20, [], force_greedy=True)]
    samplers = [call_sampler(seed, 1, True) for seed in (1, 2, 3)]
    prompts = [[3, 4, SIZE], [5, 6, 7, 8, 9, 31], [12, 13, 14, 15, 16, 17, 18, 19]]   # ratio next; forced; free
    batched, alone = _decode(processors, samplers, prompts, steps=12)
    assert batched == alone
    assert 10 <= batched[0][0] < 20 and batched[1][:2] == [32, SIZE], batched


def _ask(prompt="a fox", seed=1, index=1, call=None, **prepare):
    return TextAsk(dict(dict(prompt=prompt, mode="gen_text", bot_task="think", system_prompt="s", max_new_tokens=16),
                        **prepare), dict(call or {}, decode_text=False), None, seed, index)


def test_text_calls_share_one_call_when_all_but_the_rows_values_agree():
    from hunyuan_image_3.modeling_hunyuan_image_3 import HunyuanImage3ForCausalMM as M
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor
    ratio = lambda: [M._ConditionalSliceVocabLogitsProcessor([SIZE], 10, 20, [], force_greedy=True)]  # noqa: E731
    key = share_key(_ask(call={"logits_processor": ratio()}))
    same = [_ask("a lighthouse at dusk", seed=9, index=2, system_prompt="other", call={"logits_processor": ratio()}),
            _ask(call={"logits_processor": ratio(), "streamer": object(), "verbose": 2})]   # rank 0's console
    assert all(share_key(a) == key for a in same)
    other = [_ask(bot_task="recaption"), _ask(max_new_tokens=8), _ask(image_size="auto"), _ask(system_prompt=None),
             _ask(cot_text="text"), _ask(image=["a.png"]), _ask(call={"do_sample": False}),
             _ask(call={"stage_transitions": [(31, [32])], "final_stop_tokens": [SIZE]})]
    keys = [share_key(a) for a in other]
    assert key not in keys and len(set(keys)) == len(keys)
    assert share_key(_ask(call={"logits_processor": [NoRepeatNGramLogitsProcessor(2)]})) is None
    assert share_key(_ask(message_list=[{"role": "user"}])) is None


# ---------------------------------------------------------------- the tiny checkpoints

@pytest.fixture(scope="module")
def models(text_model, tiny_instruct):
    """{"base": the base model file on the text checkpoint, "instruct": the Instruct model}, one process."""
    from utils.runtime.rank_model import load_rank_model
    model_adaptor.remove()
    loaded = {}
    for name, folder in (("base", text_model), ("instruct", tiny_instruct)):
        loaded[name], _ = load_rank_model(folder, "cpu")
        loaded[name].text_graph = "off"
    yield loaded
    model_adaptor.remove()


def handed_off(handoff):
    """What a request hands the image phase, comparable: every text call's tokens, text, ratio, arguments."""
    if isinstance(handoff, Exception):
        return type(handoff).__name__, str(handoff)
    phase = handoff.text_phase
    call = dict(handoff.image_call)
    images = call.pop("batch_cond_images", None)
    images = [[(i.vae_image.sum().item(), i.vit_image.sum().item()) for i in row] for row in images or []]
    return [(c.kind, c.prompt_tokens, c.new_token_ids) for c in phase.calls], phase.text, phase.ratio, call, images


def stage(model, requests, counted=False):
    """image_batch.text_stage on `requests` (one stage; keep_going: every exception in its place), and
    how many forwards the text model ran."""
    from adaptor_patches.image_batch import text_stage
    forwards = []
    hook = model.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        return text_stage(model, requests, keep_going=lambda exc: True), len(forwards)
    finally:
        hook.remove()


def alone_and_together(model, requests):
    alone = [stage(model, [r]) for r in requests]
    together, forwards = stage(model, requests)
    assert [handed_off(h) for h in together] == [handed_off(h[0]) for h, _ in alone]
    return [h[0] for h, _ in alone], together, [n for _, n in alone], forwards


BASE = [dict(prompt="a red fox standing in fresh snow", seed=7, image_size="64x64", bot_task="think"),
        dict(prompt="ramen", seed=8, image_size="auto", bot_task="think"),
        dict(prompt="a lighthouse at dusk on a rocky coast", seed=10, image_size="auto", bot_task="recaption"),
        dict(prompt="a cat", seed=9, image_size="auto", bot_task="image")]


@pytest.mark.slow
def test_base_requests_decoded_together_hand_off_what_each_hands_off_alone(models):
    model = models["base"]
    requests = [dict(r, max_new_tokens=16) for r in BASE]
    alone, together, _, _ = alone_and_together(model, requests)
    decodes = [[c.decode for c in h.text_phase.calls] for h in together]
    assert decodes[0][0]["rows"] == 2 and decodes[1][0]["rows"] == 2          # the two think texts: one call
    assert decodes[1][1]["rows"] == 2 and decodes[2][1]["rows"] == 2          # their ratios: one call
    assert "rows" not in decodes[2][0] and "rows" not in decodes[3][0]        # each alone in its group
    assert alone[1].text_phase.ratio["token_id"] is not None and alone[0].text_phase.text


INSTRUCT = dict(image_size="auto", bot_task="think_recaption", use_system_prompt="None", max_new_tokens=40)


@pytest.mark.slow
def test_instruct_rows_stop_apart_and_the_forwards_are_the_longest_rows(models):
    """think_recaption texts of 28 and 2 tokens (this checkpoint, these seeds): the short one stops at its
    ratio token, emits pad, and the call runs the long one's decode steps, not both."""
    model = models["instruct"]
    requests = [dict(INSTRUCT, prompt="a red fox standing in fresh snow", seed=5),
                dict(INSTRUCT, prompt="ramen", seed=2),
                # its think text never reaches a ratio token: upstream raises
                dict(prompt="a dog", seed=4, image_size="auto", bot_task="think", max_new_tokens=40)]
    alone, together, alone_forwards, forwards = alone_and_together(model, requests)
    lengths = [len(h.text_phase.calls[0].new_token_ids) for h in together[:2]]
    assert lengths[0] > 16 and lengths[1] < 8 and all(h.text_phase.ratio["valid"] for h in together[:2]), lengths
    steps = [h.text_phase.calls[0].decode["decode_steps"] for h in alone[:2]]
    batched = together[0].text_phase.calls[0].decode
    assert batched["rows"] == 2 and batched["decode_steps"] == max(steps), (batched, steps)
    assert forwards - alone_forwards[2] == 1 + max(steps) < alone_forwards[0] + alone_forwards[1], forwards
    assert isinstance(together[2], ValueError) and "ratio token" in str(together[2])


@pytest.mark.slow
def test_instruct_edits_and_greedy_texts_decoded_together(models, tmp_path):
    from test_instruct_jobs import write_inputs
    from PIL import Image
    write_inputs(tmp_path, 0)                               # a.png 96x80, b.png 64x64
    a, b = (Image.open(tmp_path / name).convert("RGB") for name in ("a.png", "b.png"))
    model = models["instruct"]
    requests = [dict(INSTRUCT, prompt="make the fox blue", seed=7, image=[a]),
                dict(INSTRUCT, prompt="a red lighthouse in the same style", seed=2, image=[b]),
                dict(INSTRUCT, prompt="a lighthouse", seed=3, bot_task="recaption", do_sample=False,
                     image_size="256x256"),
                dict(INSTRUCT, prompt="a fox in the snow at night", seed=1, bot_task="recaption", do_sample=False,
                     image_size="256x256")]
    _, together, _, _ = alone_and_together(model, requests)
    assert [h.text_phase.calls[0].decode["rows"] for h in together] == [2, 2, 2, 2]


@pytest.mark.slow
def test_a_prompt_beyond_the_context_gets_its_error_in_its_place(models):
    from adaptor_patches.text_phase import ContextTooLongError
    model = models["base"]
    context = model.generation_config.max_length
    model.generation_config.max_length = 200             # the think prompts here: 158-172 tokens
    try:
        requests = [dict(r, max_new_tokens=16) for r in BASE[:2]]
        requests.insert(1, dict(BASE[0], prompt="a long prompt " * 20, seed=3))
        _, together, _, _ = alone_and_together(model, requests)
    finally:
        model.generation_config.max_length = context
    assert isinstance(together[1], ContextTooLongError) and together[0].text_phase.calls[0].decode["rows"] == 2


def on_ranks(rank, world_size, model_dir, layout_kwargs, requests):
    """Each request alone, then all together, on this rank of the layout: what each hands off."""
    from adaptor_patches.parallel.layout import Layout
    from utils.runtime.rank_model import load_rank_model
    model, _ = load_rank_model(model_dir, "cpu", layout=Layout(world_size, **layout_kwargs), rank=rank)
    model.text_graph = "off"
    alone = [handed_off(stage(model, [r])[0][0]) for r in requests]
    together, _ = stage(model, requests)
    rows = [type(h).__name__ if isinstance(h, Exception) else [c.decode.get("rows") for c in h.text_phase.calls]
            for h in together]
    return alone, [handed_off(h) for h in together], rows


@pytest.mark.slow
def test_moe_ep2_ranks_decode_the_batch_alike_and_as_each_alone(tiny_instruct):
    requests = [dict(INSTRUCT, prompt="a red fox standing in fresh snow", seed=5),
                dict(INSTRUCT, prompt="ramen", seed=2),
                dict(INSTRUCT, prompt="a fox in the snow at night", seed=8)]
    ranks = run_ranks(2, on_ranks, tiny_instruct, dict(moe="ep"), requests)
    assert ranks[0] == ranks[1]
    alone, together, rows = ranks[0]
    assert together == alone and rows == [[3], [3], [3]], rows

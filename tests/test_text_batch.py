"""A batch's text phases decoded together (adaptor_patches/text/batch.py, text/rows.py): issue 36.

Fast (no model):
- a batched call's rows each draw from their own request's sampler (text.sampling.RowSamplers):
  the tokens of B rows equal each row's own DeviceChoice alone, sampled and greedy; swapping two
  rows' samplers changes them;
- the processors see a right-padded row as it is alone: its last prompt token triggers upstream's
  ratio slice / stage transitions at the first token, a repetition penalty sees its own tokens;
- which text calls share one call (text.rows.share_key).
Slow (the tiny checkpoints, in this process and on 2 gloo ranks):
- B = 3 / 4 requests with different prompts, seeds and bot tasks (base: think, recaption, the ratio
  of `auto`; Instruct: think_recaption with its forced transitions and ratio, edits with images,
  greedy) hand off what each hands off alone: every text call's tokens, the text, the ratio,
  upstream's image-call arguments. Within rounding, step by step (AloneReference): a row's logits
  together are not bit-equal to alone (the prefill's attention over the batch's padded length rounds
  differently, on some CPUs: AVX-512 and AVX2 here, not ATen's default kernels), and a sampled token
  whose draw is that close to another's can differ (the base "ramen" think text at its 15th token:
  log(p/q) of 530 and 537 0.034 apart, logits 1 bf16 ulp apart). So each row's choices are held to
  its choices alone (the same stream at the same place, the same text read, logits within
  LOGIT_BOUND, a differing token only where the alone choice on the row's logits draws it too), the
  row then takes the token alone, and the handoffs compare exactly;
- a row that stops early emits pad and does not hold the others; the decode forwards of a batched
  call are the longest row's, not the sum (counted at the text model);
- a request whose text phase raises (a prompt beyond the context; upstream's unknown ratio token)
  gets its exception in its place, the others their texts;
- MoE EP2: the same on every rank, batched = alone there too.
Broken on purpose, each fails the base tests (and reversed samplers every batched-vs-alone test above):
the rows' samplers reversed in text.rows.BatchPhase (a row's first choice reads another request's text);
every row drawn from row 0's scores in DeviceChoice (a token the row's own logits do not draw); row 0's
tokens handed to every row (text.rows._split); the decode positions from the padded width, or a mask
that lets a padded row see its pads (text/decode.py: logits 0.38 / 0.10 of the largest apart, the bound
0.016); the processors reading the padded row as it is (_rows_view).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

import model_adaptor
from adaptor_patches.text.phase import SharedTokenSampler, call_sampler
from adaptor_patches.text.rows import TextAsk, share_key
from adaptor_patches.text.sampling import DeviceChoice, RowSamplers
from harness.multirank import run_ranks

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
    """Drive a batched choice as text/decode.py's loop does (right-padded prompts, new tokens in the
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
    from utils.runtime.engine.rank_model import load_rank_model
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


LOGIT_BOUND = 2 ** -6     # of the row's largest |logit| alone: two bf16 ulps of it (seen: up to 1.25, AVX-512 and AVX2)


@dataclass
class Draw:
    """One token choice of a row: its generator's state before it, the raw logits [vocab], the tokens the
    processors read [n], the processors as they were (alone), the sampler, the token."""
    state: torch.Tensor
    logits: torch.Tensor
    tokens: torch.Tensor
    steps: list
    sampler: object
    token: int


class AloneReference:
    """Each request's text alone, the reference its row together is held to, step by step.

    A batched row's logits are not bit-equal to its logits alone: the prefill's attention runs over the
    batch's padded length (the row's pad keys masked), another kernel blocking, so the bf16 values round
    differently, by how much and where depending on the CPU's kernels; a sampled token whose draw is that
    close to another token's then differs and the two texts part. So, with `record()` around the
    requests alone and `together()` around the batch, every token choice (DeviceChoice) of a row
    together is compared to the same sampler's choice alone at the same step (the sampler's generator
    identifies the request and its text call):
      - the generator's state and the tokens the processors read: equal (a row draws from its own
        stream at its own place and sees its own text: bit-exact by construction);
      - the raw logits: within LOGIT_BOUND of the largest;
      - the token: equal, or, where it differs, the alone choice replayed on the row's logits together
        (its processors and generator as they were) draws it: only the logits' rounding parted them;
    and then the row takes the token alone (teacher forcing), so that the texts stay comparable to the
    end and the handoffs compare exactly. `parted` lists the steps where a token differed."""

    def __init__(self):
        self.alone: dict = {}           # generator seed -> [Draw], the choices of that sampler alone
        self.checked: dict = {}         # generator seed -> choices compared together
        self.parted: list = []          # (seed, step, token alone, token together, logit difference)
        self.worst = 0.0                # the largest logit difference / the row's largest logit alone
        self.failures: list = []        # what _check raised (the batch hands a row's exception to its request)

    @contextlib.contextmanager
    def _spying(self, mode):
        original = self.choose = DeviceChoice.__call__
        reference = self

        def spy(choice, input_ids, logits):
            rows = choice.rows if choice.rows is not None else [choice.sampler]
            generators = choice.generators if choice.rows is not None else [choice.generator]
            before = [g.get_state() for g in generators]
            steps = copy.deepcopy(choice.steps) if mode == "record" else None
            logits = logits.detach().clone()
            tokens = original(choice, input_ids, logits.clone())
            seen = choice._rows_view(input_ids) if choice.rows is not None else input_ids
            for r, (sampler, generator) in enumerate(zip(rows, generators)):
                draw = Draw(before[r], logits[r], seen[r].clone(), steps, sampler, int(tokens[r]))
                if mode == "record":
                    reference.alone.setdefault(generator.initial_seed(), []).append(draw)
                    continue
                try:
                    tokens[r] = reference._check(generator.initial_seed(), draw, choice.rank)
                except AssertionError as failed:        # the batch's keep_going would hand it to the request
                    reference.failures.append(str(failed))
                    raise
            return tokens

        DeviceChoice.__call__ = spy
        try:
            yield self
        finally:
            DeviceChoice.__call__ = original

    def record(self):
        return self._spying("record")

    def together(self):
        return self._spying("check")

    def _check(self, seed: int, draw: Draw, rank: int) -> int:
        assert seed in self.alone, f"a row draws from a generator (seed {seed}) no request drew from alone"
        step = self.checked.get(seed, 0)
        self.checked[seed] = step + 1
        if step >= len(self.alone[seed]):
            return draw.token                   # the row stopped alone by now: together it emits pad
        alone = self.alone[seed][step]
        where = f"seed {seed}, step {step}"
        assert torch.equal(draw.state, alone.state), f"{where}: the row draws from another point of a stream"
        n = alone.tokens.numel()             # together the prompt is right-aligned, its first token before it
        assert torch.equal(draw.tokens[-n:], alone.tokens) and bool((draw.tokens[:-n] == alone.tokens[0]).all()), \
            f"{where}: the processors read another text than alone (another request's sampler, or the row seen padded)"
        difference = (draw.logits - alone.logits).abs().max().item() / alone.logits.abs().max().item()
        self.worst = max(self.worst, difference)
        assert difference <= LOGIT_BOUND, f"{where}: logits {difference:.2e} of the largest apart (> {LOGIT_BOUND:.2e})"
        if draw.token != alone.token and rank == 0:         # the other ranks take rank 0's tokens
            generator = torch.Generator().manual_seed(0)
            generator.set_state(alone.state)
            replay = DeviceChoice(copy.deepcopy(alone.steps), alone.sampler, 0, False, "cpu")
            replay.generator = generator
            replayed = int(self.choose(replay, alone.tokens[None], draw.logits[None].clone())[0])
            assert replayed == draw.token, (f"{where}: together drew {draw.token}, alone {alone.token}, and the alone "
                                            f"choice on the row's logits together draws {replayed}")
            self.parted.append((seed, step, alone.token, draw.token, difference))
        return alone.token


def alone_and_together(model, requests):
    """Each request alone, then all together (their rows held to their texts alone: AloneReference): what
    each hands off is the same."""
    reference = AloneReference()
    with reference.record():
        alone = [stage(model, [r]) for r in requests]
    with reference.together():
        together, forwards = stage(model, requests)
    assert not reference.failures, reference.failures[0]
    assert [handed_off(h) for h in together] == [handed_off(h[0]) for h, _ in alone]
    assert reference.checked.keys() == reference.alone.keys(), "a request's text calls were not all made together"
    assert all(reference.checked[k] >= len(v) for k, v in reference.alone.items()), "a row stopped before it did alone"
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
    from adaptor_patches.text.phase import ContextTooLongError
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
    from utils.runtime.engine.rank_model import load_rank_model
    model, _ = load_rank_model(model_dir, "cpu", layout=Layout(world_size, **layout_kwargs), rank=rank)
    model.text_graph = "off"
    reference = AloneReference()
    with reference.record():
        alone = [handed_off(stage(model, [r])[0][0]) for r in requests]
    with reference.together():
        together, _ = stage(model, requests)
    assert not reference.failures, f"rank {rank}: {reference.failures[0]}"
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

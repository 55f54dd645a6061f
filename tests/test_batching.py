"""Which requests share a forward, how the server and a prompts file take them, the metrics, the planner's B.

No model runs here: the server's queue is driven by hand (submit, pull, deliver, the denoise watch's
step callback), as its rank loop would; a batch that runs is tests/test_batches.py's."""
from dataclasses import replace

import pytest
from http_client import metric

from utils.runtime.requests.batching import compatibility_key, take_batch
from utils.runtime.requests.image_requests import ImageRequest, RequestChecker
from utils.runtime.http.image_server import ImageServer
from utils.runtime.engine.rank_loop import ImageResult
from utils.runtime.http.server_metrics import Metrics
from adaptor_patches.step_cache import StepCacheSettings

BASE = ImageRequest(prompt="a fox", seed=1, image_size="64x64", diff_infer_steps=2)


def test_the_compatibility_key_is_the_image_phase_and_nothing_else():
    key = compatibility_key(BASE)
    # what each request keeps its own of
    for change in ({"prompt": "a lighthouse"}, {"seed": 9}, {"bot_task": "think"}, {"save": "x.png"},
                   {"image": ("a.png",), "image_inputs": None}, {"step_cache": StepCacheSettings()}):
        if "image" in change:
            continue
        assert compatibility_key(replace(BASE, **change)) == key, change
    # what a forward shares
    for change in ({"image_size": "32x128"}, {"image_size": "auto"}, {"diff_infer_steps": 3},
                   {"guidance_scale": 7.0}, {"step_cache": StepCacheSettings("taylor")}, {"image": ("a.png",)}):
        assert compatibility_key(replace(BASE, **change)) != key, change
    one, two = replace(BASE, image=("a.png",)), replace(BASE, image=("b.png",), prompt="x")
    assert compatibility_key(one) == compatibility_key(two) != compatibility_key(replace(BASE, image=("a.png", "b.png")))
    # the size after snapping: two sizes of one bucket share a forward
    snap = {"64x64": (64, 64, 1), "60x64": (64, 64, 1), "32x128": (32, 128, 0)}.get
    assert compatibility_key(replace(BASE, image_size="60x64"), snap) == compatibility_key(BASE, snap)
    assert compatibility_key(replace(BASE, image_size="32x128"), snap) != compatibility_key(BASE, snap)


def test_take_batch_keeps_the_order_and_leaves_the_incompatible_waiting():
    lines = [replace(BASE, label=f"line {i}", image_size=size) for i, size in
             enumerate(["64x64", "32x128", "64x64", "64x64", "32x128", "64x64"], 1)]
    batch, rest = take_batch(lines, 3)
    assert [r.label for r in batch] == ["line 1", "line 3", "line 4"]
    assert [r.label for r in rest] == ["line 2", "line 5", "line 6"]
    batch, rest = take_batch(rest, 3)
    assert [r.label for r in batch] == ["line 2", "line 5"] and [r.label for r in rest] == ["line 6"]
    assert take_batch(lines, 1)[0] == lines[:1] and take_batch([], 4) == ([], [])


@pytest.fixture
def server(tiny_model):
    srv = ImageServer("127.0.0.1", 0, BASE, RequestChecker(tiny_model), 8, 4, lambda line: None, max_batch=4,
                      batch_wait_s=0.05)
    srv.loaded.set()
    yield srv
    for job in srv.unanswered:               # no endpoint writes their responses here
        job.answered.set()
    srv.close()


def requests_of(prompt, n=1, **fields):
    return [replace(BASE, prompt=prompt, seed=i, **fields) for i in range(n)]


def made(requests, size):
    return [ImageResult(r, f"image of {r.prompt} {r.seed}", 1.0, batch_size=size) for r in requests]


def test_the_server_batches_compatible_jobs_and_an_incompatible_one_waits_for_its_own(server):
    jobs = [server.submit(requests_of(f"p{i}")) for i in range(3)]
    other = server.submit(requests_of("wide", image_size="32x128"))
    late = server.submit(requests_of("p3", n=2))                 # n = 2: a batch of its own two, with room for none
    kind, batch = server.pull()
    assert kind == "run" and [r.prompt for r in batch] == ["p0", "p1", "p2"]
    assert server.busy and all(server.is_running(job) for job in jobs) and not server.is_running(other)
    assert server.jobs.position(other) == 1 and server.jobs.position(late) == 2
    server.deliver(made(batch, 3))
    assert all(job.done.is_set() and [r.image for r in job.results] == [f"image of p{i} 0"]
               for i, job in enumerate(jobs))
    kind, batch = server.pull()
    assert [r.prompt for r in batch] == ["wide"] and server.is_running(other)
    server.deliver(made(batch, 1))
    kind, batch = server.pull()
    assert [(r.prompt, r.seed) for r in batch] == [("p3", 0), ("p3", 1)]
    server.deliver(made(batch, 2))
    assert late.done.is_set() and not server.busy
    text = server.metrics.prometheus(0, False)
    assert metric(text, "hunyuan_batch_requests_bucket", le="1.0") == 1
    assert metric(text, "hunyuan_batch_requests_bucket", le="2.0") == 2
    assert metric(text, "hunyuan_batch_requests_count") == 3 and metric(text, "hunyuan_batch_requests_sum") == 6
    assert metric(text, "hunyuan_largest_batch") == 3


def test_a_job_of_more_images_than_max_batch_runs_in_several_batches(server):
    big = server.submit(requests_of("many", n=4) + requests_of("many", n=2))   # 6 images, max_batch 4
    small = server.submit(requests_of("one"))
    kind, batch = server.pull()
    assert len(batch) == 4 and not big.done.is_set()
    server.deliver(made(batch, 4))
    assert not big.done.is_set()
    kind, batch = server.pull()                        # the rest of the big job first, and a companion
    assert [r.prompt for r in batch] == ["many", "many", "one"]
    server.deliver(made(batch, 3))
    assert big.done.is_set() and small.done.is_set() and all(r is not None for r in big.results)


def test_a_cancelled_member_leaves_at_the_next_step_and_the_others_go_on(server):
    jobs = [server.submit(requests_of(f"p{i}")) for i in range(3)]
    kind, batch = server.pull()
    watch = server.watch([0, 1, 2], batch)
    watch.on_step(1, 2)
    assert all(job.progress == {"image": 1, "images": 1, "step": 1, "steps": 2, "batch": 3} for job in jobs)
    server.cancel(jobs[1])                             # its client left mid-denoising
    assert not watch.cancelled()                      # the batch goes on for the others
    watch.on_step(2, 2)                               # the next step boundary: it leaves
    assert jobs[1].done.is_set() and jobs[1].refusal.code == 499 and not jobs[0].done.is_set()
    server.deliver(made(batch, 3))
    assert jobs[0].results[0].image == "image of p0 0" and jobs[2].results[0].image == "image of p2 0"
    assert jobs[1].refusal.code == 499 and jobs[1].results == [None]
    for job in jobs:
        server.cancel(job)
    assert not server.jobs.qsize()
    jobs = [server.submit(requests_of(f"q{i}")) for i in range(2)]
    kind, batch = server.pull()
    watch = server.watch([0, 1], batch)
    for job in jobs:
        server.cancel(job)
    assert watch.cancelled()                          # every member left: every rank stops at this step


def test_metrics_count_forward_batches_from_the_images_they_made():
    metrics = Metrics()
    metrics.count_batches([4, 4, 4, 4, 1, 2, 2])       # one forward of 4, one of 1, one of 2
    text = metrics.prometheus(0, False)
    assert metric(text, "hunyuan_batch_requests_count") == 3 and metric(text, "hunyuan_largest_batch") == 4
    assert metric(text, "hunyuan_batch_requests_bucket", le="1.0") == 1
    assert metric(text, "hunyuan_batch_requests_bucket", le="4.0") == 3
    assert "3 forward batch(es), the largest 4" in metrics.summary()


def test_the_planner_scales_activations_and_traffic_with_the_batch(tiny_model):
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import largest_batch, plan, shortfall
    layout = Layout(4, 2, "ep", True)
    one, four = (plan(tiny_model, layout, (64, 64), "cpu", batch=b)[0] for b in (1, 4))
    assert four.params == one.params
    for what in ("KV cache", "VAE decode"):
        assert four.activations[what] == 4 * one.activations[what], what
    assert 3 * one.activations["denoise step"] < four.activations["denoise step"] <= 4 * one.activations["denoise step"]
    sent = {b: sum(r.comm_per_step.values()) for b, r in ((1, one), (4, four))}
    assert 3.5 * sent[1] < sent[4] <= 4 * sent[1], sent
    memory = one.total() + 2.5 * (one.activation_bytes)            # room for about three requests' activations
    fits = largest_batch(tiny_model, layout, (64, 64), [one], memory, 0.0, "cpu")
    assert fits >= 2
    assert shortfall(plan(tiny_model, layout, (64, 64), "cpu", batch=fits), memory, 0.0) is None
    assert shortfall(plan(tiny_model, layout, (64, 64), "cpu", batch=fits + 1), memory, 0.0) is not None


def test_a_batch_is_split_into_forward_batches_by_the_size_each_generates():
    """`auto` requests share a key; their ratio tokens may then choose different sizes: one forward each."""
    from types import SimpleNamespace
    from adaptor_patches.image_batch import TextHandoff, image_batches
    buckets = {(64, 64): (64, 64, 16), "64x64": (64, 64, 16), "60x64": (64, 64, 16), (32, 128): (32, 128, 3)}

    class Processor:
        def build_image_info(self, size):
            height, width, ratio = buckets[size]
            return SimpleNamespace(image_height=height, image_width=width, ratio_index=ratio)

    model = SimpleNamespace(image_processor=Processor())
    handoffs = [TextHandoff({"image_size": size}, None) for size in ((64, 64), (32, 128), "60x64", (32, 128))]
    assert image_batches(model, handoffs) == [[0, 2], [1, 3]]
    assert image_batches(model, [handoffs[0], None, handoffs[2], None]) == [[0, 2]]     # None: failed its text phase

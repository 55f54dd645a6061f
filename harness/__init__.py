"""What the tests (tests/) and the benchmarks (bench/) both use, and neither owns.

multirank.py      a function run on N real gloo ranks, the ranks pooled for the process's life
checkpoints.py    the tiny checkpoints' variants: the text one, the gained one, rewritten copies
host_syncs.py     the calls that make a host wait for an accelerator, counted on any device
comm_counts.py    one image per layout on gloo ranks, its collectives counted and the planner's lines

It imports the project (adaptor_patches/, utils/, model_adaptor.py), never tests/ or bench/. The
hardware doubles (tests/npu_double.py and the others) stay in tests/: a benchmark that needs one
imports it from there and says why.
"""

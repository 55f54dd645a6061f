"""The text phase: think / recaption text and the ratio token, every token chosen on global rank 0.

phase.py (modes, the shared draw, records), decode.py (the adaptor's own token loop), sampling.py (the
processors and the draw on the device), kv_reuse.py (the static KV and the prompt KV the image phase
reuses), rows.py and batch.py (a batch's text calls decoded together as the rows of one call).
docs/TEXT_PHASE.md tells the whole story.
"""

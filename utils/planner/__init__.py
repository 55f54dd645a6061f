"""Will a layout fit? Per-rank memory from the model built on the meta device (`python -m utils.planner`)."""

"""The `--serve` server on rank 0: uvicorn and FastAPI, the OpenAI-style bodies, streams and errors, the
queue (image_server.py), metrics, the model card and the page (web/); imports requests, never engine."""

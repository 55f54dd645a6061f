"""What every rank imports at run time: requests and their checks, the rank loop, the batch job, the
HTTP server, output writing and the checkpoint checks (run_image_gen.py drives them)."""

"""The launcher behind run.sh: YAML -> validated -> planned -> torchrun (`python -m utils.launcher`)."""

"""The node self-check (`bash run.sh --selfcheck`, or `python -m utils.selfcheck`); its sections in checks/."""

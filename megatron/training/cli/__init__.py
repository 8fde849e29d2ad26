"""The command line of ``pretrain_gpt.py``: flags, their start-up checks, the output directories."""

"""The command line of ``pretrain_gpt.py``: flags, their start-up checks, the run config.

:mod:`.arguments` (the flags, Megatron-LM's names, and ``validate_args``), :mod:`.config`
(:class:`RunConfig`, the validated run built once), :mod:`.auto_layout` (``auto`` degrees from
the planner), :mod:`.document_args`, :mod:`.memory_args` and :mod:`.pretrained_args` (the flag
groups with their checks), :mod:`.output_paths` (the directories a run writes to) and
:mod:`.errors` (the one error). Nothing here imports torch at import time, so ``--help`` is fast.
"""

"""Everything that ties ds_q8 to DeepSpeed beyond registering the type names.

* ``params``: clear errors for unknown keys in a JSON ``"optimizer": {"params": ...}`` section;
* ``engine_checks``: refuse ZeRO features that would corrupt 8-bit state (elastic checkpoints,
  NVMe optimizer offload) before any training happens;
* ``checkpoint_files``: refuse truncated or corrupted checkpoint files before any is applied;
* ``zero_layout``: which parameter slices each ZeRO partition holds, and per-parameter state access;
* ``universal``: convert a ZeRO checkpoint so DeepSpeed's universal-checkpoint tools accept it;
* ``grad_norm``: answer the non-finite check with the gradient norm DeepSpeed computed;
* ``embedding_marks``: mark the embeddings of the model ``deepspeed.initialize`` is given (32-bit state by default);
* ``patches``: every place the modules above attach to DeepSpeed, in one table, installed once;
* ``entry``: when the table is installed: the first ``deepspeed.initialize`` that meets a ds_q8 optimizer;
* ``contract``, ``supported``: the DeepSpeed releases supported, and the one error for a release that
  lacks a patched place;
* ``engine_hooks``: how a row of that table attaches (before, after, replace; once per process);
* ``lookup``: what all of them look up the same way (the optimizer in an engine, the checkpoint folder).
"""

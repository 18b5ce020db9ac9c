"""Everything that ties ds_q8 to DeepSpeed beyond registering the type names.

* ``params``: clear errors for unknown keys in a JSON ``"optimizer": {"params": ...}`` section;
* ``engine_checks``: refuse ZeRO features that would corrupt 8-bit state (elastic checkpoints,
  NVMe optimizer offload) before any training happens;
* ``checkpoint_files``: refuse truncated or corrupted checkpoint files before any is applied;
* ``engine_hooks``: how both of those attach to the engine (once per process);
* ``universal``: convert a ZeRO checkpoint so DeepSpeed's universal-checkpoint tools accept it.
"""

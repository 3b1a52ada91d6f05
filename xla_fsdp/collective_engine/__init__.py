"""The explicit pinned-collective engine (`engine="collectives"`, the default).

Every parameter of a unit is sharded on dim 0 and gathered, freed and
reduce-scattered by collectives this engine issues itself:
- `param.py`: `FSDPParam`, one record per parameter (shape, padding, shard);
- `param_group.py`: `FSDPParamGroup`, a unit's parameters, one collective each
  for `unshard()`, `reshard()` and `reduce_grads()`;
- `state.py`: `FSDPState`, the hooks around a unit's forward and backward;
- `collectives.py`: every collective, behind the `Collectives` interface;
- `clip_grad.py`: gradient-norm clipping across shards;
- `model_state.py`, `optimizer_state.py`: model and optimizer state dicts (keys, the single
  controller's unpadded shapes, shard metadata, loads that keep the sharding);
- `sharded_param.py`: `ShardedParameter`, the parameter class of `fully_shard` units;
- `build.py`: building a unit (collectives and layout, parameter group, buffers).

The front doors (`xla_fsdp.api`, `xla_fsdp.fsdp`) call `build.py`; nothing here imports them.
"""

"""The explicit pinned-collective engine (`engine="collectives"`, the default).

Every parameter of a unit is sharded on dim 0 and gathered, freed and
reduce-scattered by collectives this engine issues itself:
- `param.py`: `FSDPParam`, one record per parameter (shape, padding, shard);
- `param_group.py`: `FSDPParamGroup`, a unit's parameters, one collective each
  for `unshard()`, `reshard()` and `reduce_grads()`;
- `state.py`: `FSDPState`, the hooks around a unit's forward and backward;
- `collectives.py`: every collective, behind the `Collectives` interface;
- `clip_grad.py`: gradient-norm clipping across shards;
- `full_shapes.py`, `optimizer_shapes.py`: the single controller's model and optimizer
  state dicts in the unwrapped shapes;
- `build.py`: building a unit (collectives and layout, parameter group, buffers).

The front door (`xla_fsdp.api`) calls `build.py` and hands it the unit class;
nothing here imports the front door.
"""

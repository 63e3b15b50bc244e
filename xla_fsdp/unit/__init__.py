"""A unit's life cycle, below the public wrapper: construction (validate, materialize, adopt
parameters), parameter groups (sharded master, gathered compute copy), the forward schedule,
backward's gradient reduction, gradient usage across ranks, tied parameters, clipping. Nothing
here imports the wrapper: "is this a unit?" is :class:`base.ShardedUnit`."""

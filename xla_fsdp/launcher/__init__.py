"""The launcher behind `python launch/xla_spawn.py` (its usage and behaviour: that file's docstring).

- `command_line.py`: its flags, how the command splits into them, the script and the script's own arguments, its exit
  codes and messages;
- `single_controller.py`: whether the script runs as the single controller (one process drives every local device) or
  one process per chip, from the flags, the environment and what the script declares;
- `plan.py`: the device and how many, what the launcher will do (`LaunchPlan`), and the environment it sets first (XLA's
  log level, libtpu's flags);
- `run_script.py`: running the script: its `_mp_fn(index)`, its own `__main__` (a script that starts itself, or a plain
  one on the single controller), in this process or one per chip;
- `main.py`: the order of it all.

Nothing here imports an engine: the script does, after the launcher set its environment."""

"""Saving and loading sharded models: full and sharded state dicts (`state_dict.py`)."""
from .state_dict import full_state_dict, load_full_state_dict, load_sharded_state_dict, sharded_state_dict

__all__ = ["full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict"]

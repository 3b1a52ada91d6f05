"""The pieces of the GPT-2 causal-LM job (`launch/run_clm.py`): flags, data, model, loop."""

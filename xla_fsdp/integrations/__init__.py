"""Other libraries' training loops on xla_fsdp: `transformers` (Hugging Face Trainer)."""

"""Hugging Face checkpoints: random-init ones for tests (`rose model init`) and imports of
published files (`rose model import`). Everything here writes a local checkpoint directory
(config.json, safetensors, tokenizer files if any); nothing downloads."""

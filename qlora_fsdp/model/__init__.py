"""Building the model: reading checkpoints, the meta skeleton, streaming and quantizing weights, conversion, vision
parts, attention fixes, LoRA."""

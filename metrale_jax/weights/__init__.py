"""Checkpoint readers (Hugging Face safetensors folders, GGUF, Metrale's orbax format) that
load a model into a `Checkpoint` (loaded.py): config, stacked params, tokenizer, template.
May import models, text, families, config and errors; never engine or scheduler.
"""

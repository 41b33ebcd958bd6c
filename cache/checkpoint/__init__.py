"""Checkpoints: read, validate, quantize and synthesize Hugging Face checkpoint directories."""

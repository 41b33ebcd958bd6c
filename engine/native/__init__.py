"""The native engine: the model, its kernels (PyTorch, Triton), the paged KV cache, the scheduler and
CUDA graphs (llm_engine.py is its entry; its weight processor is cache/processors/native.py)."""

"""warmgate engine worker: model, kernels, scheduler and the worker server."""

"""OpenAI Triton kernels for multi-LoRA serving, each beside a plain torch reference.

Kernels know nothing of the engine, the model or Triton Server: tensors in, tensors out.
"""

"""What users would run instead, on the same requests: vLLM with LoRA (vllm_offline.py, a capacity target) and
transformers + PEFT (peft_generate.py, the headline's baseline)."""

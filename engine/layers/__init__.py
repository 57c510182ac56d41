"""The model's layers, as in nano-vllm: linear (with the CPU's packed weights behind its interface), the GGUF linear
layer, RMSNorm and the rotary embedding."""

"""The lossy levers: resident KV quantization (`quantized_cache`) and KV eviction (`eviction`)."""

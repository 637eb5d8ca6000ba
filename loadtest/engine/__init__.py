"""The engine alone, in this process: throughput against HF transformers, perplexity, quantized weights,
fair prefill, the oneDNN cache, a GPU."""

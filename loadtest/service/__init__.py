"""The served system against the engine: what gRPC, Ray and the KV transfer add, HTTP against gRPC,
structured output, TP x PP ranks, memory."""

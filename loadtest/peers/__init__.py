"""Other servers on the same machine: llama.cpp built from source, and disagg against it."""

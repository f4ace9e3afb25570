"""The gateway in front of real inference servers: vLLM CPU and llama.cpp (issue 40)."""

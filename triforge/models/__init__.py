"""Model-level code on triforge kernels: the Qwen2 decode engine and its parity tool."""

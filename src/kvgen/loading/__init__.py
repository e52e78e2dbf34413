"""Reading models from disk: GGUF files and Hugging Face folders."""

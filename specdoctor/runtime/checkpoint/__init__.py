"""Reading checkpoints: safetensors files and headers (files.py), the reader (reader.py), where targets keep
their tensors (keys.py), loading modules from them (loader.py), quantised formats, the tokenizer."""

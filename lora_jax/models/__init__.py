"""Reference decoder models (Llama / Qwen2 / Qwen3 / Mistral shapes) built on lora_jax linears."""

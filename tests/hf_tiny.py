"""A tiny random HF Llama checkpoint for the HF peft oracle tests (needs torch)."""

import numpy as np

V = 96  # its vocabulary


def tiny_llama_dir(tmp_path, tied: bool = False) -> str:
    """Saves a 2-layer GQA Llama (hidden 32, vocab 96) under `tmp_path / "base"`."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = str(tmp_path / "base")
    model.save_pretrained(d, safe_serialization=True)
    return d


def peft_rows(base_dir: str, dirs: dict, ids: np.ndarray, names: list) -> np.ndarray:
    """Each row's logits under its PEFT adapter alone (`"__base__"`: none), one PeftModel
    per adapter: PEFT's mixed batch refuses DoRA, and cannot hold an adapter without
    trainable tokens beside one with them."""
    import peft
    import torch
    import transformers

    out = np.zeros((*ids.shape, V), np.float32)
    for name in set(names):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        m = hf if name == "__base__" else peft.PeftModel.from_pretrained(hf, dirs[name])
        rows = [i for i, n in enumerate(names) if n == name]
        with torch.no_grad():
            x = torch.tensor(ids[rows], dtype=torch.long)
            out[rows] = m.eval()(input_ids=x).logits.float().numpy()
    return out


def peft_sgd_steps(base_dir: str, start: str, ids: np.ndarray, lr: float, steps: int, out):
    """PEFT trains the adapter saved in `start` for `steps` SGD steps of next-token
    cross-entropy on `ids` and saves it to `out`; returns `str(out)`."""
    import peft
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, start, is_trainable=True)
    sgd = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=lr)
    x = torch.tensor(ids, dtype=torch.long)
    for _ in range(steps):
        sgd.zero_grad()
        logits = pm(input_ids=x).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1)).backward()
        sgd.step()
    pm.save_pretrained(str(out), safe_serialization=True)
    return str(out)

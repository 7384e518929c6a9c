"""What a CPU cell trains on, made locally: a tiny random Qwen3-MoE, its tokenizer and prompts.

Nothing comes from a hub. The model has :data:`LAYERS` MoE layers of :data:`EXPERTS` experts
(top-:data:`TOPK`), a word-level tokenizer whose chat template is the Qwen one verl's agent loop
expects ("\\n" one token, ``<|im_end|>`` the end of a turn), and prompts "what is a plus b ?" with
the sum as ground truth for :mod:`.reward`. The assets depend on nothing but :data:`VERSION`, so
they are made once into a folder and shared by every cell (a file lock guards the making).
"""

from __future__ import annotations

import os
from pathlib import Path

#: Bumped whenever what :func:`make` writes changes, so a cached folder is never stale.
VERSION = 1
LAYERS, EXPERTS, TOPK = 2, 8, 2
PROMPTS = 16
_DONE = ".complete"


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ablate" / f"verl-cpu-assets-v{VERSION}"


def paths(folder: Path) -> dict[str, Path]:
    return {"model": folder / "model", "train": folder / "data" / "train.parquet",
            "val": folder / "data" / "val.parquet"}


def ensure(folder: Path) -> dict[str, Path]:
    """The assets in ``folder``, made there first unless a complete set is already there."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / ".lock")):
        if not (folder / _DONE).exists():
            make(folder)
            (folder / _DONE).write_text(f"{VERSION}\n")
    return paths(folder)


def make(folder: Path) -> None:
    import pandas as pd
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    where = paths(folder)
    words = [str(number) for number in range(100)] + "what is plus minus the answer #### = ? . , a b c".split()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "system", "\n"]
    vocab = {token: index for index, token in enumerate(special + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Split(" ", "removed")])
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} \n {{ m['content'] }} <|im_end|> \n "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant \n {% endif %}")
    fast.save_pretrained(where["model"])
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOPK,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None,
        norm_topk_prob=True, torch_dtype="float32",
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(where["model"])
    rows = []
    for index in range(PROMPTS):
        a, b = index % 10, (index * 3) % 10
        rows.append({"data_source": "ablate_cpu_sums", "prompt": [{"role": "user", "content": f"what is {a} plus {b} ?"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": index}})
    where["train"].parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(where["train"])
    pd.DataFrame(rows[:4]).to_parquet(where["val"])

"""The workloads behind the committed traces: a randomly initialised Llama (6 layers, hidden 512,
built from a config: nothing downloaded), on the CPU.

    python llama_workload.py train      # AdamW, four steps at different (batch, sequence) shapes
    python llama_workload.py generate   # greedy generate(): the KV cache grows token by token
    python llama_workload.py mix        # two training steps, then generation, then two more
    python llama_workload.py moe        # a Mixtral-style mixture of experts (4 layers, 8 experts,
                                        # top 2): generate() at batch 4, then at batch 2 with a
                                        # longer prompt (the batch changes between requests)

Record one with: python -m strata.trace record -o train.csv.gz -- python llama_workload.py train
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM


def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config)


def moe_model():
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    return MixtralForCausalLM(config)


def train(m, shapes):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    m.train()
    for batch, seq in shapes:
        ids = torch.randint(0, m.config.vocab_size, (batch, seq))
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def generate(m, batch, prompt, new):
    m.eval()
    with torch.no_grad():
        ids = torch.randint(0, m.config.vocab_size, (batch, prompt))
        m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def main(mode):
    if mode == "moe":
        m = moe_model()
        generate(m, 4, 64, 64)
        generate(m, 2, 160, 48)
        return
    m = model()
    if mode == "train":
        train(m, [(4, 128), (2, 256), (8, 64), (3, 200)])
    elif mode == "generate":
        generate(m, 4, 64, 96)
    elif mode == "mix":
        opt = train(m, [(4, 128), (2, 200)])
        generate(m, 2, 48, 64)
        del opt
        train(m, [(6, 96), (1, 320)])
    else:
        raise SystemExit(f"unknown workload {mode!r} (train, generate, mix, moe)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "train")

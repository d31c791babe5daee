"""Writes tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints for the generation check, with
transformers' own save_pretrained, and what transformers' own greedy generation does with them.

    python make_generation.py [--out DIR]      (default: the folder of this script)

Needs torch and transformers (5.17 wrote the committed files); CI has neither and replays the
committed references (test_hf_generate.py). Each checkpoint goes to DIR/<arch>/ (config.json,
generation_config.json, model.safetensors: BF16 weights, the configs of
hf_models/make_hf_checkpoints.py with two MoE layers and a vocabulary of VOCAB tokens) with
generation.safetensors beside it. For each kind the model runs in ("f32": the checkpoint upcast,
"bf16": as it is), transformers generates NEW_TOKENS tokens greedily after a prompt, and every MoE
block's call of that generation is recorded (values in float32, bf16 ones exactly). The prompt is
the first of seeded candidates whose generations lead by replay.MARGIN at every step, in both kinds
with DISTINCT different tokens (decidable_prompt), in the decoding over a static cache too (generate_static()):
    prompt                          int32 [P]
    <kind>.tokens                   int32 [NEW_TOKENS], the generated tokens
    <kind>.logits                   float32 [NEW_TOKENS, VOCAB], each step's last-position logits
    <kind>.rows                     int32 [NEW_TOKENS], tokens each step ran (P, then 1 each)
    <kind>.<layer>.hidden|out       float32 [sum(rows), d_model]: what the block received and
                                    returned, the steps one after another
    <kind>.<layer>.ids|weights      int32|float32 [sum(rows), k]: its router's choice
    <kind>.tail                     float32 [sum(rows), d_model]: the last layer's residual stream
                                    the last block's output is added to (before the final norm
                                    and the LM head)
"""

import argparse
import pathlib
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import harness  # noqa: E402
import replay  # noqa: E402
from hf_models.make_hf_checkpoints import CONFIGS, SEED, randomise  # noqa: E402

VOCAB = 512
# Two MoE layers each (DeepSeek-V3's first layer is dense). DeepSeek-V3's attention keeps a key per
# head, as its released config says (num_key_value_heads = num_attention_heads): transformers'
# StaticCache sizes itself by num_key_value_heads and fails on fewer.
OVERRIDES = {"mixtral": dict(num_hidden_layers=2), "qwen3_moe": dict(num_hidden_layers=2),
             "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4)}
# Room for the prompt and the tokens; no end-of-sequence token, so that generation never stops
# early (a random model says it as soon as anything else).
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=128, eos_token_id=None)
PROMPT_LENGTH = 8
CANDIDATES = 64
# A generation that repeats a few tokens shows little: the prompt's must hold this many.
DISTINCT = 12


def write_checkpoint(folder, arch):
    torch.manual_seed(SEED)
    config = CONFIGS[arch](**COMMON, **OVERRIDES[arch])
    model = AutoModelForCausalLM.from_config(config)
    randomise(model, SEED + len(arch))
    model.to(torch.bfloat16).save_pretrained(folder)


def candidates():
    """Prompts to try, in order: the beginning-of-sequence token and seeded random tokens."""
    rng = np.random.default_rng(SEED)
    for _ in range(CANDIDATES):
        yield [1] + rng.integers(3, VOCAB, PROMPT_LENGTH - 1).tolist()


def decidable(model, kind, prompt):
    """Whether both of transformers' greedy decodings of prompt (generate(), and generate_static(),
    whose bf16 attention rounds otherwise: they may differ) lead by the margin at every step."""
    tokens, logits = harness.generate(model, prompt)
    return (len(set(tokens.tolist())) >= DISTINCT and
            all((replay.leads(lg.numpy(), kind) >= replay.MARGIN[kind]).all()
                for lg in (logits, harness.generate_static(model, prompt)[1])))


def decidable_prompt(folder):
    """The first candidate whose greedy generation, in every kind, leads by replay.MARGIN or more at
    every step (a token chosen at a near-tie is the last rounding's choice, not the model's) and
    holds DISTINCT different tokens."""
    models = {kind: harness.load(folder, kind) for kind in replay.KINDS}
    for prompt in candidates():
        if all(decidable(m, kind, prompt) for kind, m in models.items()):
            return prompt
    raise SystemExit(f"{folder}: none of {CANDIDATES} prompts generates without a near-tie")


def recording(folder, kind, prompt):
    """The reference tensors of one kind (keys without the kind's prefix)."""
    model = harness.load(folder, kind)
    tokens, logits, calls, tail = harness.record(model, prompt)
    f32 = lambda ts: np.concatenate([t.detach().float().numpy() for t in ts])
    ref = {"tokens": tokens.numpy().astype(np.int32), "logits": logits.numpy(),
           "tail": f32(tail)}
    layers = sorted({c["layer"] for c in calls})
    first = [c for c in calls if c["layer"] == layers[0]]
    ref["rows"] = np.array([c["hidden"].shape[0] for c in first], dtype=np.int32)
    for layer in layers:
        mine = [c for c in calls if c["layer"] == layer]
        assert [c["step"] for c in mine] == list(range(harness.NEW_TOKENS)), (layer, len(mine))
        ref[f"{layer}.hidden"] = f32(c["hidden"] for c in mine)
        ref[f"{layer}.out"] = f32(c["out"] for c in mine)
        ref[f"{layer}.weights"] = f32(c["topk_weights"] for c in mine)
        ref[f"{layer}.ids"] = np.concatenate([c["topk_ids"].numpy() for c in mine]).astype(np.int32)
    return ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=HERE)
    a = ap.parse_args()
    for arch in OVERRIDES:
        folder = a.out / arch
        write_checkpoint(folder, arch)
        prompt = decidable_prompt(folder)
        refs = {"prompt": np.array(prompt, dtype=np.int32)}
        for kind in replay.KINDS:
            refs.update({f"{kind}.{k}": v for k, v in recording(folder, kind, prompt).items()})
            toks = refs[f"{kind}.tokens"].tolist()
            print(f"{arch} {kind}: prompt {prompt}, tokens {toks} ({len(set(toks))} distinct), "
                  f"smallest lead {replay.leads(refs[f'{kind}.logits'], kind).min():.3g}")
        save_file({k: np.ascontiguousarray(v) for k, v in refs.items()},
                  str(folder / "generation.safetensors"))
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()

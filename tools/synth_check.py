#!/usr/bin/env python3
"""Format check of a `lily synth` checkpoint against MLX itself (run with the oracle venv:
`PY=$(scripts/oracle-setup | tail -n1); $PY tools/synth_check.py DIR`).

1. Quantization: for a sample of quantized tensors (or all, --all), dequantize the stored
   codes with the stored bf16 scales/biases in float32 (mx.dequantize) and quantize again with
   mlx.core.quantize (affine, group 64, the tensor's bits). lily's writer makes every group a fixed
   point of MLX's rule, so codes, scales and biases must come back bit-identical.
2. Tokenizer: tokenizer.json loads with Hugging Face `tokenizers` and round-trips text, the Qwen
   added tokens (<|im_start|>, <think>, <tool_call>, ...) are single ids, and transformers'
   AutoTokenizer (as mlx_lm.load uses it) renders the chat template's generation prompt.
3. mlx_lm.load (strict) accepts the directory and a forward pass gives finite logits.

Exit status 0 when everything matches; one line per check on stdout.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)


def load_all(d: Path):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def check_quant(d: Path, all_tensors: bool, max_experts: int) -> bool:
    w = load_all(d)
    mods = sorted(k[: -len(".scales")] for k in w if k.endswith(".scales"))
    if not all_tensors:
        keep = []
        for m in mods:
            if m.endswith(("embed_tokens", "lm_head")) or ".layers.0." in m or ".layers.3." in m:
                keep.append(m)
        mods = keep
    ok = True
    total_groups = 0
    for m in mods:
        wq, sc, bi = w[m + ".weight"], w[m + ".scales"], w[m + ".biases"]
        if wq.ndim == 3 and max_experts:
            wq, sc, bi = wq[:max_experts], sc[:max_experts], bi[:max_experts]
        in_dim = sc.shape[-1] * 64
        bits = wq.shape[-1] * 32 // in_dim
        deq = mx.dequantize(wq, sc.astype(mx.float32), bi.astype(mx.float32), group_size=64, bits=bits)
        assert deq.dtype == mx.float32
        wq2, sc2, bi2 = mx.quantize(deq, group_size=64, bits=bits)
        same_w = bool(mx.array_equal(wq2, wq))
        same_s = bool(mx.array_equal(sc2.astype(mx.bfloat16), sc))
        same_b = bool(mx.array_equal(bi2.astype(mx.bfloat16), bi))
        groups = sc.size
        total_groups += groups
        if not (same_w and same_s and same_b):
            ok = False
            bad = int(mx.sum(mx.any((wq2 != wq).reshape(*sc.shape, -1), axis=-1) | (sc2.astype(mx.bfloat16) != sc) | (bi2.astype(mx.bfloat16) != bi)).item())
            print(f"FAIL quant {m}: {bits}-bit {tuple(sc.shape)} groups, {bad} differ (codes {same_w}, scales {same_s}, biases {same_b})")
        else:
            print(f"ok   quant {m}: {bits}-bit, {groups} groups re-quantize bit-identically")
    print(f"{'ok  ' if ok else 'FAIL'} quant: {len(mods)} tensors, {total_groups} groups")
    return ok


def check_tokenizer(d: Path) -> bool:
    from tokenizers import Tokenizer

    ok = True
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    added = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
    text = "<|im_start|>user\nHello, wörld! 12345 <tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>\n<|im_start|>assistant\n<think>\nok</think>\n\nfine<|endoftext|>"
    enc = tok.encode(text, add_special_tokens=False)
    for s in ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"]:
        if added[s] not in enc.ids:
            print(f"FAIL tokenizer: {s} (id {added[s]}) not matched as one token")
            ok = False
    if tok.decode(enc.ids, skip_special_tokens=False) != text:
        print("FAIL tokenizer: decode(encode(text)) != text")
        ok = False
    vocab = json.loads((d / "config.json").read_text())["text_config"]["vocab_size"]
    if max(enc.ids) >= vocab:
        print(f"FAIL tokenizer: id {max(enc.ids)} >= vocab_size {vocab}")
        ok = False
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(d))
    prompt = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    if not prompt.endswith("<|im_start|>assistant\n<think>\n"):
        print(f"FAIL tokenizer: chat template generation prompt {prompt!r}")
        ok = False
    ids = hf.encode(prompt, add_special_tokens=False)
    if ids != tok.encode(prompt, add_special_tokens=False).ids:
        print("FAIL tokenizer: transformers and tokenizers disagree")
        ok = False
    gen = json.loads((d / "generation_config.json").read_text())
    if gen["eos_token_id"] != [added["<|im_end|>"], added["<|endoftext|>"]]:
        print(f"FAIL generation_config eos {gen['eos_token_id']}")
        ok = False
    print(f"{'ok  ' if ok else 'FAIL'} tokenizer: {tok.get_vocab_size(with_added_tokens=True)} tokens, chat prompt {len(ids)} ids")
    return ok


def check_mlx_lm(d: Path) -> bool:
    from mlx_lm.utils import load_model

    model, cfg = load_model(d)  # strict: every tensor present with its shape
    tc = cfg.get("text_config", cfg)
    ids = [(i * 2654435761 % 2**32) % tc["vocab_size"] for i in range(16)]
    logits = model(mx.array([ids]))
    mx.eval(logits)
    finite = bool(mx.all(mx.isfinite(logits)).item())
    print(f"{'ok  ' if finite else 'FAIL'} mlx_lm.load_model + forward: logits {tuple(logits.shape)} finite={finite}")
    return finite


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--all", action="store_true", help="check every quantized tensor (default: embed, lm_head, layers 0 and 3)")
    ap.add_argument("--max-experts", type=int, default=4, help="experts checked per stacked tensor (0 = all)")
    ap.add_argument("--skip-model", action="store_true", help="skip the mlx_lm load + forward (large checkpoints)")
    a = ap.parse_args()
    ok = check_quant(a.dir, a.all, a.max_experts)
    ok &= check_tokenizer(a.dir)
    if not a.skip_model:
        ok &= check_mlx_lm(a.dir)
    print("synth_check:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

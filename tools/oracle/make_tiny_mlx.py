#!/usr/bin/env python3
"""Write a small random qwen3_5_moe checkpoint the way `mlx_lm.convert -q` does.

The model is built by mlx_lm's own class (mlx_lm.models.qwen3_5_moe.Model), given seeded random
weights, cast to bfloat16 (A_log stays float32, as convert's cast_predicate does), quantized by
mlx_lm.utils.quantize_model with the model's own quant_predicate (affine, group 64, 4 bits; the
router `mlp.gate` and `mlp.shared_expert_gate` at 8 bits; embedding and lm_head quantized too) and
saved by mlx_lm.utils.save_model / save_config: config.json + model.safetensors (+ index), names
prefixed `language_model.`. This is the independent check of the on-disk format lily's own
synthetic writer must produce, and a model to test tools/oracle/oracle.py with.

  python tools/oracle/make_tiny_mlx.py --out /tmp/small                 # preset "small"
  python tools/oracle/make_tiny_mlx.py --out /tmp/tiny --preset tiny
  python tools/oracle/make_tiny_mlx.py --out /tmp/s --hf-out /tmp/s-hf  # also a raw HF bf16 copy

--hf-out also writes the same (unquantized, bf16) weights in the raw Hugging Face layout of
Qwen3_5MoeForConditionalGeneration (prefix `model.language_model.`, zero-centred norms stored as
w - 1, conv1d [C, 1, K], fused experts `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], plus dummy `mtp.*` and `model.visual.*` tensors that a text
loader must drop), so loaders can be tested on mlx_lm's sanitize path. --no-quantize writes the
MLX-layout directory unquantized (bf16).
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import mlx.core as mx

mx.set_default_device(mx.cpu)

import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten  # noqa: E402
from mlx_lm.models import qwen3_5_moe  # noqa: E402
from mlx_lm.utils import quantize_model, save_config, save_model  # noqa: E402

PRESETS = {
    # name: (hidden, layers, attn heads, kv heads, head_dim, k heads, v heads, k/v head dim,
    #        experts, top-k, expert width, shared width, vocab)
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=64, shared_expert_intermediate_size=64, vocab_size=512),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=256, shared_expert_intermediate_size=256, vocab_size=4096),
}

NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
         ".q_norm.weight", ".k_norm.weight")


def make_config(preset: dict) -> dict:
    """A config.json shaped like the published Qwen3.6-35B-A3B one (nested text_config)."""
    tc = dict(preset)
    n = tc["num_hidden_layers"]
    fai = 4
    tc.update(
        model_type="qwen3_5_moe_text",
        attention_bias=False,
        attn_output_gate=True,
        dtype="bfloat16",
        full_attention_interval=fai,
        hidden_act="silu",
        layer_types=["full_attention" if (i + 1) % fai == 0 else "linear_attention" for i in range(n)],
        linear_conv_kernel_dim=4,
        max_position_embeddings=262144,
        mlp_only_layers=[],
        mtp_num_hidden_layers=1,
        rms_norm_eps=1e-6,
        rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                         "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": tc,
        "tie_word_embeddings": False,
    }


def randomize(model: nn.Module, seed: int, lm_head_scale: float, router_scale: float):
    """Seeded random weights with realistic ranges (mlx's default init is kept for the rest)."""
    mx.random.seed(seed + 1)
    new = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith(NORMS) or k.endswith("linear_attn.norm.weight"):
            v = mx.random.uniform(0.8, 1.2, v.shape)          # stored as 1 + w: values near 1
        elif k.endswith("dt_bias"):
            v = mx.random.uniform(-1.0, 2.0, v.shape)
        elif k.endswith("A_log"):
            v = mx.log(mx.random.uniform(0.5, 16.0, v.shape))
        elif k.endswith("lm_head.weight"):
            v = v * lm_head_scale                              # logits spread enough for greedy tests
        elif k.endswith("mlp.gate.weight"):
            v = v * router_scale                               # decisive routing, as in trained models
        elif k.endswith("embed_tokens.weight"):
            v = mx.random.normal(v.shape) * 0.5
        new[k] = v
    model.update(tree_unflatten(list(new.items())))
    mx.eval(model.parameters())


def cast_like_convert(model: nn.Module, dtype=mx.bfloat16):
    """mlx_lm.convert's dtype step: floating params to dtype except where cast_predicate says no (A_log)."""
    keep = model.cast_predicate

    def f(k, v):
        return v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(f, model.parameters()))
    mx.eval(model.parameters())


def write_hf(model: nn.Module, config: dict, out: Path):
    """The same weights in the raw HF Qwen3_5MoeForConditionalGeneration layout (inverse of sanitize)."""
    out.mkdir(parents=True, exist_ok=True)
    w = dict(tree_flatten(model.parameters()))
    hf = {}
    layers = {}
    for k, v in w.items():
        assert k.startswith("language_model."), k
        k = k[len("language_model."):]
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        if k.endswith(NORMS) and v.ndim == 1:
            v = v - 1.0                                        # HF stores the zero-centred w
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)                               # [C, K, 1] -> [C, 1, K]
        if ".mlp.switch_mlp." in k:
            pre, proj = k.split(".switch_mlp.")
            layers.setdefault(pre, {})[proj.split(".")[0]] = v
            continue
        hf[k] = v
    for pre, p in layers.items():
        hf[f"{pre}.experts.gate_up_proj"] = mx.concatenate([p["gate_proj"], p["up_proj"]], axis=1)
        hf[f"{pre}.experts.down_proj"] = p["down_proj"]
    H = config["text_config"]["hidden_size"]
    hf["mtp.fc.weight"] = mx.zeros((H, 2 * H), mx.bfloat16)  # must be dropped by a text loader
    hf["mtp.layers.0.input_layernorm.weight"] = mx.zeros((H,), mx.bfloat16)
    hf["model.visual.patch_embed.proj.weight"] = mx.zeros((8, 3, 2, 2, 2), mx.bfloat16)
    mx.save_safetensors(str(out / "model.safetensors"), hf, metadata={"format": "pt"})
    cfg = copy.deepcopy(config)
    cfg["vision_config"] = {"depth": 1}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (MLX layout)")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, help="override the preset's vocab_size")
    ap.add_argument("--layers", type=int, help="override the preset's num_hidden_layers")
    ap.add_argument("--lm-head-scale", type=float, default=6.0)
    ap.add_argument("--router-scale", type=float, default=4.0)
    ap.add_argument("--tie-embeddings", action="store_true", help="tie_word_embeddings (no lm_head; not Qwen3.6)")
    ap.add_argument("--no-quantize", action="store_true", help="save the MLX layout unquantized (bf16)")
    ap.add_argument("--hf-out", help="also write the raw Hugging Face layout (bf16, unquantized) here")
    args = ap.parse_args()

    preset = dict(PRESETS[args.preset])
    if args.vocab:
        preset["vocab_size"] = args.vocab
    if args.layers:
        preset["num_hidden_layers"] = args.layers
    config = make_config(preset)
    if args.tie_embeddings:
        config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True

    # ModelArgs mutates rope_parameters (rope_type -> type): build from a copy, save the original.
    mx.random.seed(args.seed)  # the class's own init draws too: seed before building
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(copy.deepcopy(config)))
    randomize(model, args.seed, args.lm_head_scale, args.router_scale)
    cast_like_convert(model, mx.bfloat16)

    if args.hf_out:
        write_hf(model, config, Path(args.hf_out))

    if not args.no_quantize:
        model, config = quantize_model(model, config, group_size=64, bits=4, mode="affine",
                                       quant_predicate=model.quant_predicate)
    out = Path(args.out)
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"wrote {out} ({args.preset}, seed {args.seed}, {n} stored elements)"
          + (f" and {args.hf_out}" if args.hf_out else ""), file=sys.stderr)


if __name__ == "__main__":
    main()

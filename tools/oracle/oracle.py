#!/usr/bin/env python3
"""MLX-LM oracle for lily: reference logits, hidden states and greedy tokens of a qwen3_5_moe checkpoint.

The checkpoint is loaded by mlx_lm itself (mlx_lm.utils.load_model: its config parsing, sanitize,
quantization predicate and model classes; pinned version, CPU device), twice:

  f32   every floating parameter (norms, conv, A_log, dt_bias, quantization scales and biases)
        cast to float32, so every activation is float32. This is the reference lily's CPU backend
        is held to.
  bf16  the model as stored (bfloat16 parameters and activations), run by MLX-LM's own code.
        --bf16-mode f32acc (default): quantized matmuls accumulate in float32 and round their output
        to bfloat16, as MLX's GPU (Metal) kernels do. --bf16-mode native: MLX's Linux CPU kernels
        untouched; they accumulate bf16 quantized matmuls *in bfloat16* (every product and partial
        sum rounded), which is neither what MLX does on a GPU nor a fair tolerance, and ~30x slower.

In both f32 and f32acc the only change to mlx_lm's model is that each QuantizedLinear /
QuantizedSwitchLinear is replaced by a module holding its exact float32 dequantization
(w = scale*q + bias) and multiplying in float32 (MLX's CPU quantized kernels are scalar loops, and
its CPU gather_mm has no bf16). Checkpoints whose float32 copy would exceed --dequant-limit-gb
keep the packed weights and use MLX's float32 quantized matmul instead: same math, slower. Routing,
norms, GDN, attention, RoPE, caches and the decode step are mlx_lm's own code.

  python tools/oracle/oracle.py --model DIR --ids 1,2,3 --gen 32 --out OUTDIR
  python tools/oracle/oracle.py --model DIR --ids-file prompt.npy --gen 32 --out OUTDIR

Writes into OUTDIR (T prompt tokens, V vocab, L layers, H hidden, N = --gen):
  ids.npy                     int64 [T]         the prompt, as given (no BOS is added)
  logits_{f32,bf16}.npy       float32 [T, V]    teacher-forced logits: one forward over the prompt
  embed_f32.npy               float32 [T, H]    embedding rows
  hidden_f32.npy              float32 [L, T, H] residual stream after each decoder layer (after the MoE add)
  final_norm_f32.npy          float32 [T, H]    after the final RMSNorm (the input of lm_head)
  gen_{f32,bf16}.npy          int64 [N]         greedy continuation: the prompt forward fills mlx_lm's
                                                cache (KV cache + GDN conv/recurrent state), then one
                                                model(token, cache) call per token, as generate_step does
  gen_top2gap_{f32,bf16}.npy  float32 [N]       top-1 minus top-2 logit of the step that chose gen[i]
  gen_logits_{f32,bf16}.npy   float32 [N, V]    those logits (row 0 = logits[T-1]); skipped if N*V > 2^26
  summary.json                agreement bf16 vs f32, perplexities, greedy match, versions, timings
--only f32|bf16 runs one precision (its taps are then written with its own suffix).
"""

import argparse
import ctypes
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

# Speed only: route MLX's CPU GEMMs to OpenBLAS through the shim scripts/oracle-setup builds (the
# mlx-cpu wheel links the reference Netlib BLAS). Single-threaded BLAS: MLX runs its own threads,
# and a threaded BLAS on 2 cores is 10x slower for the small GEMMs of decode.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_SHIM = Path(sys.prefix) / "lib" / "liblily_cblas_shim.so"
BLAS = "netlib reference (slow: run scripts/oracle-setup to build the OpenBLAS shim)"
if _SHIM.exists():
    try:
        ctypes.CDLL(str(_SHIM), mode=ctypes.RTLD_GLOBAL)
        BLAS = "openblas (scipy-openblas32 via liblily_cblas_shim)"
    except OSError as e:
        print(f"oracle: warning: could not load {_SHIM}: {e}", file=sys.stderr)

import mlx.core as mx  # noqa: E402

mx.set_default_device(mx.cpu)

import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten, tree_map, tree_unflatten  # noqa: E402
from mlx_lm.models.base import create_attention_mask, create_ssm_mask  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

MAX_GEN_LOGITS = 1 << 26


# ----------------------------------------------------------------------------- model preparation


class F32AccLinear(nn.Module):
    """A quantized Linear whose matmul runs in float32 on the exact float32 dequantized weight and
    rounds the output to the input dtype: the numerics of MLX's GPU quantized matmul."""

    def __init__(self, q: nn.QuantizedLinear, dequant: bool):
        super().__init__()
        self.group_size, self.bits, self.mode = q.group_size, q.bits, q.mode
        f32 = {k: q[k].astype(mx.float32) for k in ("scales", "biases") if k in q and q[k] is not None}
        if dequant:
            self.weight = mx.dequantize(q.weight, f32["scales"], f32.get("biases"), q.group_size, q.bits, q.mode)
        else:
            self.qweight, self.scales, self.biases = q.weight, f32["scales"], f32.get("biases")
        if "bias" in q:
            self.bias = q.bias.astype(mx.float32)
        self.dequant = dequant
        self.freeze()

    def __call__(self, x):
        xf = x.astype(mx.float32)
        if self.dequant:
            y = xf @ self.weight.T
        else:
            y = mx.quantized_matmul(xf, self.qweight, self.scales, self.biases, transpose=True,
                                    group_size=self.group_size, bits=self.bits, mode=self.mode)
        if "bias" in self:
            y = y + self.bias
        return y.astype(x.dtype)


class F32AccSwitchLinear(nn.Module):
    """Stacked experts (QuantizedSwitchLinear, or a plain SwitchLinear, whose bf16 gather_mm MLX's CPU
    backend does not implement) with float32 accumulation, output in the input dtype."""

    def __init__(self, q, dequant: bool):
        super().__init__()
        if isinstance(q, SwitchLinear):
            self.weight = q.weight.astype(mx.float32)
            dequant = True
        else:
            self.group_size, self.bits, self.mode = q.group_size, q.bits, q.mode
            s = q.scales.astype(mx.float32)
            b = None if q.biases is None else q.biases.astype(mx.float32)
            if dequant:
                self.weight = mx.dequantize(q.weight, s, b, q.group_size, q.bits, q.mode)
            else:
                self.qweight, self.scales, self.biases = q.weight, s, b
        if "bias" in q:
            self.bias = q.bias.astype(mx.float32)
        self.dequant = dequant
        self.freeze()

    def __call__(self, x, indices, sorted_indices=False):
        xf = x.astype(mx.float32)
        if self.dequant:
            y = mx.gather_mm(xf, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        else:
            y = mx.gather_qmm(xf, self.qweight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                              group_size=self.group_size, bits=self.bits, mode=self.mode,
                              sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y.astype(x.dtype)


class F32AccEmbedding(nn.Module):
    """QuantizedEmbedding: lookups exactly as MLX does them; as_linear (tied lm_head) in float32."""

    def __init__(self, q: nn.QuantizedEmbedding):
        super().__init__()
        self.inner = q
        self.weight = mx.dequantize(q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32),
                                    q.group_size, q.bits, q.mode)
        self.freeze()

    def __call__(self, x):
        return self.inner(x)

    def as_linear(self, x):
        return (x.astype(mx.float32) @ self.weight.T).astype(x.dtype)


def float_bytes_if_dequantized(model) -> int:
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            n += m.weight.size * (32 // m.bits)
    return 4 * n


def prepare(model, precision: str, bf16_mode: str, dequant_limit: float):
    """Turn the model as mlx_lm loaded it into the f32 reference or the bf16 variant; returns notes."""
    dequant = float_bytes_if_dequantized(model) <= dequant_limit * 2**30
    notes = {}
    if precision == "f32":
        def up(p):
            return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p
        model.update(tree_map(up, model.parameters()))
        notes["weights"] = "float32 (quantized matrices dequantized exactly in float32)" if dequant \
            else "quantized, float32 scales/biases"
        notes["matmul_accumulation"] = "float32"
    elif bf16_mode == "f32acc":
        notes["weights"] = "as stored (quantized matmuls on their exact float32 dequantization)" if dequant \
            else "as stored"
        notes["matmul_accumulation"] = "float32, output rounded to the activation dtype (as MLX GPU kernels)"
    else:
        notes["weights"] = "as stored"
        notes["matmul_accumulation"] = "MLX Linux CPU native (bfloat16 quantized matmuls accumulate in bfloat16)"
    if precision == "f32" or bf16_mode == "f32acc":
        tied = text_model(model)[0].args.tie_word_embeddings
        swaps = []
        for name, m in model.named_modules():
            if isinstance(m, nn.QuantizedLinear):
                swaps.append((name, F32AccLinear(m, dequant)))
            elif isinstance(m, (QuantizedSwitchLinear, SwitchLinear)):
                swaps.append((name, F32AccSwitchLinear(m, dequant)))
            elif isinstance(m, nn.QuantizedEmbedding) and tied:
                swaps.append((name, F32AccEmbedding(m)))  # only its as_linear (tied lm_head) changes
        if swaps:
            model.update_modules(tree_unflatten(swaps))
    mx.eval(model.parameters())
    model.eval()
    notes["param_dtypes"] = sorted({str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())})
    return notes


# ----------------------------------------------------------------------------- running


def text_model(model):
    """(TextModel with lm_head, its inner Qwen3_5TextModel) for the qwen3_5 / qwen3_5_moe classes."""
    lm = getattr(model, "language_model", model)
    return lm, lm.model


def prefill_with_taps(model, ids: mx.array, cache):
    """The prompt forward, layer by layer, exactly as Qwen3_5TextModel.__call__ does it (same masks,
    same per-layer cache), keeping the residual stream after every layer."""
    lm, tm = text_model(model)
    h = tm.embed_tokens(ids[None])
    embed = h
    fa_mask = create_attention_mask(h, cache[tm.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[tm.ssm_idx])
    hidden = []
    for layer, c in zip(tm.layers, cache):
        h = layer(h, mask=ssm_mask if layer.is_linear else fa_mask, cache=c)
        mx.eval(h)
        hidden.append(h[0])
    hn = tm.norm(h)
    logits = tm.embed_tokens.as_linear(hn) if lm.args.tie_word_embeddings else lm.lm_head(hn)
    mx.eval(logits)
    return logits[0], embed[0], mx.stack(hidden), hn[0]


def top2_gap(rows: np.ndarray) -> np.ndarray:
    if rows.size == 0:
        return np.zeros(0, np.float32)
    part = np.partition(rows, -2, axis=-1)
    return (part[:, -1] - part[:, -2]).astype(np.float32)


def perplexity(logits: np.ndarray, ids: np.ndarray):
    if len(ids) < 2:
        return None
    x = logits[:-1].astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]
    nll = lse - x[np.arange(len(ids) - 1), ids[1:]]
    return float(math.exp(nll.mean()))


def f32np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def run(args, precision: str, ids_np: np.ndarray, save_taps: bool):
    out = args.out
    t0 = time.perf_counter()
    model, config = load_model(args.model, lazy=False, strict=True)
    notes = prepare(model, precision, args.bf16_mode, args.dequant_limit_gb)
    t1 = time.perf_counter()

    ids = mx.array(ids_np.astype(np.int32))
    cache = make_prompt_cache(model)
    logits, embed, hidden, fnorm = prefill_with_taps(model, ids, cache)
    logits_np = f32np(logits)
    t2 = time.perf_counter()

    # Greedy decode on the filled cache: the _step of mlx_lm.generate.generate_step (model(tok, cache),
    # last position, argmax), without its logits processors / KV quantization (both off by default).
    gen, rows = [], []
    last = logits[-1]
    for i in range(args.gen):
        tok = mx.argmax(last, axis=-1)
        gen.append(int(tok.item()))
        rows.append(f32np(last))
        if i + 1 < args.gen:
            last = model(tok.reshape(1, 1), cache=cache)[0, -1]
    gen = np.array(gen, np.int64)
    rows = np.stack(rows) if rows else np.zeros((0, logits_np.shape[1]), np.float32)
    t3 = time.perf_counter()

    np.save(out / f"logits_{precision}.npy", logits_np)
    hidden_np = f32np(hidden)
    if save_taps:
        np.save(out / f"embed_{precision}.npy", f32np(embed))
        np.save(out / f"hidden_{precision}.npy", hidden_np)
        np.save(out / f"final_norm_{precision}.npy", f32np(fnorm))
    np.save(out / f"gen_{precision}.npy", gen)
    gaps = top2_gap(rows)
    np.save(out / f"gen_top2gap_{precision}.npy", gaps)
    if 0 < rows.size <= MAX_GEN_LOGITS:
        np.save(out / f"gen_logits_{precision}.npy", rows)

    info = dict(notes)
    info.update({
        "load_s": round(t1 - t0, 3),
        "prefill_s": round(t2 - t1, 3),
        "decode_s": round(t3 - t2, 3),
        "activation_dtype": str(logits.dtype).replace("mlx.core.", ""),
        "perplexity": perplexity(logits_np, ids_np),
        "logits_absmax": float(np.abs(logits_np).max()),
        "prompt_min_top2gap": float(top2_gap(logits_np).min()),
        "gen": gen.tolist(),
        "gen_min_top2gap": float(gaps.min()) if gaps.size else None,
    })
    if args.check:
        # the layer-by-layer prefill must be the model's own forward (no cache, one call)
        direct = f32np(model(ids[None])[0])
        info["layerwise_vs_model_call_max_abs"] = float(np.abs(direct - logits_np).max())
    arrays = {"logits": logits_np, "gen": gen, "hidden": hidden_np}
    del model, cache, logits, embed, hidden, fnorm
    gc.collect()
    mx.clear_cache()
    return config, info, arrays


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="qwen3_5_moe checkpoint directory (MLX format, or raw HF)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--ids", help="comma-separated prompt token ids")
    g.add_argument("--ids-file", type=Path, help=".npy file of prompt token ids (any integer dtype, flattened)")
    ap.add_argument("--gen", type=int, default=0, help="greedy tokens to generate after the prompt")
    ap.add_argument("--out", required=True, type=Path, help="output directory (created)")
    ap.add_argument("--only", choices=["f32", "bf16"], help="run one precision only")
    ap.add_argument("--bf16-mode", choices=["f32acc", "native"], default="f32acc",
                    help="f32acc: quantized matmuls accumulate in float32 as on MLX GPUs (default); "
                         "native: MLX's Linux CPU kernels as they are (bf16 accumulation, slow)")
    ap.add_argument("--dequant-limit-gb", type=float, default=8.0,
                    help="dequantize to float32 only if that copy fits in this many GiB (default 8)")
    ap.add_argument("--no-taps", action="store_true", help="skip the embed/hidden/final_norm files")
    ap.add_argument("--check", action="store_true", help="also run model(ids) and compare with the layer-by-layer prefill")
    args = ap.parse_args()

    if args.ids is not None:
        ids = np.array([int(t) for t in args.ids.replace(" ", "").split(",") if t != ""], np.int64)
    else:
        ids = np.load(args.ids_file).reshape(-1).astype(np.int64)
    cfg_path = args.model / "config.json"
    if not cfg_path.is_file():
        sys.exit(f"oracle: {cfg_path} not found")
    cfg = json.loads(cfg_path.read_text())
    vocab = int(cfg.get("text_config", cfg)["vocab_size"])
    if ids.size == 0:
        sys.exit("oracle: empty prompt")
    if ids.min() < 0 or ids.max() >= vocab:
        sys.exit(f"oracle: prompt ids must lie in [0, {vocab})")
    if args.gen < 0:
        sys.exit("oracle: --gen must be >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "ids.npy", ids)

    precisions = [args.only] if args.only else ["f32", "bf16"]
    t0 = time.perf_counter()
    res = {}
    config = None
    for p in precisions:
        save_taps = not args.no_taps and (p == "f32" or args.only == "bf16")
        config, info, arrays = run(args, p, ids, save_taps)
        res[p] = (info, arrays)

    tc = config.get("text_config", config)
    summary = {
        "model": str(args.model.resolve()),
        "T": int(ids.size),
        "vocab": int(res[precisions[0]][1]["logits"].shape[1]),
        "num_layers": int(tc["num_hidden_layers"]),
        "hidden_size": int(tc["hidden_size"]),
        "gen": args.gen,
        "bf16_mode": args.bf16_mode,
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "blas": BLAS,
    }
    if len(precisions) == 2:
        (fi, fa), (bi, ba) = res["f32"], res["bf16"]
        lf, lb = fa["logits"], ba["logits"]
        gf, gb = fa["gen"], ba["gen"]
        first = next((i for i in range(len(gf)) if gf[i] != gb[i]), None)
        summary.update({
            "top1_agreement_bf16_vs_f32": float((lf.argmax(-1) == lb.argmax(-1)).mean()),
            "logits_max_abs_diff_bf16_vs_f32": float(np.abs(lf - lb).max()),
            "logits_rel_diff_bf16_vs_f32": float(np.abs(lf - lb).max() / max(float(np.abs(lf).max()), 1e-30)),
            "perplexity_f32": fi["perplexity"],
            "perplexity_bf16": bi["perplexity"],
            "greedy_match": first is None,
            "greedy_first_diff": first,
            "hidden_max_abs_diff_bf16_vs_f32_per_layer": [
                float(x) for x in np.abs(fa["hidden"] - ba["hidden"]).max(axis=(1, 2))],
            "hidden_absmax_f32_per_layer": [float(x) for x in np.abs(fa["hidden"]).max(axis=(1, 2))],
        })
    summary["precisions"] = {p: res[p][0] for p in precisions}
    summary["total_s"] = round(time.perf_counter() - t0, 3)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    brief = {k: v for k, v in summary.items() if k not in ("precisions",)}
    brief["timing_s"] = {p: {k: res[p][0][k] for k in ("load_s", "prefill_s", "decode_s")} for p in precisions}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()

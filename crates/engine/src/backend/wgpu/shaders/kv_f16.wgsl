// kv_f16.wgsl: the KV cache's element type for attention.wgsl, f16 (`attention_h`, the default:
// half the bytes long-context decode attention reads). The halves are packed two a u32 word
// (pack2x16float / unpack2x16float, core WGSL: no `enable f16`, any adapter, MSL's half2 casts),
// element 2w in the low half of word w; 4 elements are a vec2<u32>. Values are rounded once,
// when written (f32 → f16: 11 significant bits, relative error ≤ 2^-11 rounding to nearest,
// 2^-10 where a driver truncates); every product and sum stays f32. Names as kv_f32.wgsl's.

alias KV1 = u32;
alias KV4 = vec2<u32>;
const KV_PACK: u32 = 2u;

fn kv1(w: KV1, i: u32) -> f32 { return unpack2x16float(w)[i & 1u]; }
fn kv4(w: KV4) -> vec4<f32> { return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)); }
// Clamped to f16's finite range first: pack2x16float of a value past it is indeterminate in WGSL
// (a key past ±65504 is no sane model's; this keeps it finite, never inf or NaN).
fn kv_word(a: f32, b: f32) -> KV1 {
    return pack2x16float(clamp(vec2<f32>(a, b), vec2<f32>(-65504.0), vec2<f32>(65504.0)));
}

// kv_f32.wgsl: the KV cache's element type for attention.wgsl, f32 (`attention`; the CPU's
// type; adapters without f16 or without attn_dec_team, `LILY_WGPU_KV_F16=0`). kv_f16.wgsl is
// the other choice; both
// define the same names, and attention.wgsl reads and writes the cache only through them.
//   KV1: a word of the cache as a scalar view holds KV_PACK = 1 element; kv1(w, i) is element
//     i's value from its word w = cache[i / KV_PACK]; kv_word(a, b) the word of the elements
//     a, b (b is a's next; one element a word here, so b is ignored).
//   KV4: 4 consecutive elements (a vec4 view: rows of hd % 4 == 0); kv4 widens them to f32.

alias KV1 = f32;
alias KV4 = vec4<f32>;
const KV_PACK: u32 = 1u;

fn kv1(w: KV1, i: u32) -> f32 { return w; }
fn kv4(w: KV4) -> vec4<f32> { return w; }
fn kv_word(a: f32, b: f32) -> KV1 { return a; }

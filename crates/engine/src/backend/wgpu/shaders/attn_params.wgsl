// attn_params.wgsl: the attention kernels' parameter block and its decode accessors, shared by
// attention.wgsl and attn_dec_sg.wgsl (each module declares `p: P` at binding 0 itself;
// attention.rs `params` writes the block).
//
// Decode attention specialised to the model and the cache (`LILY_WGPU_SPEC` attn, the default
// since stop 38; attention.rs `decode_attend` sets them, one list for attn_dec_gqa or
// attn_dec_team and attn_combine4): with AD_ON the accessors give the heads, the head size, the
// capacity, the splits and the fewest keys a split takes as pipeline constants (the guards on
// heads and dims in the unrolled loops, the split's range and the records' offsets fold);
// without (`LILY_WGPU_SPEC=none`) they read the parameter block. The position stays the step's,
// on the device. The constants' defaults are never used: the host sets all of them with AD_ON.

struct P {
    rows: u32,
    nh: u32,
    nkv: u32,
    hd: u32,
    pos0: u32,
    cap: u32,
    splits: u32,
    span: u32,
    scale: f32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

override AD_ON: bool = false;
override AD_NH: u32 = 16u;
override AD_NKV: u32 = 2u;
override AD_HD: u32 = 256u;
override AD_CAP: u32 = 4096u;
override AD_SPLITS: u32 = 64u;
override AD_SPAN: u32 = 32u;

fn ad_nh() -> u32 { return select(p.nh, AD_NH, AD_ON); }
fn ad_nkv() -> u32 { return select(p.nkv, AD_NKV, AD_ON); }
fn ad_hd() -> u32 { return select(p.hd, AD_HD, AD_ON); }
fn ad_cap() -> u32 { return select(p.cap, AD_CAP, AD_ON); }
fn ad_splits() -> u32 { return select(p.splits, AD_SPLITS, AD_ON); }
fn ad_span() -> u32 { return select(p.span, AD_SPAN, AD_ON); }

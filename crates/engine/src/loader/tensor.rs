//! Host tensors: memory-mapped safetensors data (or owned bytes after a load-time fix), and the
//! matrix views the kernels read.

use std::sync::Arc;

use anyhow::{bail, Result};
use memmap2::Mmap;

/// Element types found in MLX / Hugging Face checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    U32,
    I32,
    U8,
    I64,
}

impl Dtype {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "U32" => Self::U32,
            "I32" => Self::I32,
            "U8" => Self::U8,
            "I64" => Self::I64,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Self::F32 | Self::U32 | Self::I32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::U8 => 1,
            Self::I64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::U32 => "U32",
            Self::I32 => "I32",
            Self::U8 => "U8",
            Self::I64 => "I64",
        }
    }
}

/// Where a tensor's bytes live.
#[derive(Clone)]
pub enum Storage {
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
    /// Owned, stored as u32 words so any 4-byte type can be viewed without misalignment.
    Owned(Arc<Vec<u32>>, usize),
}

/// One tensor of a checkpoint.
#[derive(Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Storage,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}{:?}", self.name, self.dtype.name(), self.shape)
    }
}

impl HostTensor {
    pub fn from_f32(name: &str, shape: Vec<usize>, v: Vec<f32>) -> Self {
        let len = v.len() * 4;
        let words: Vec<u32> = v.into_iter().map(f32::to_bits).collect();
        Self {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            data: Storage::Owned(Arc::new(words), len),
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Lets the OS drop this tensor's pages of a mapped checkpoint (once a device holds a copy):
    /// a load then keeps about one tensor resident, not the model. Touched again, the pages are
    /// read back from the file unchanged (the map is read-only). Owned tensors are left alone.
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let Storage::Mapped { map, offset, len } = &self.data {
            // SAFETY: a read-only file mapping is never written, so dropping its pages loses
            // nothing: the next access faults them in from the file again.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, *offset, *len)
            };
        }
    }
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Storage::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Storage::Owned(v, len) => {
                // SAFETY: a Vec<u32> is valid as bytes; `len` ≤ 4·v.len() by construction.
                unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, *len) }
            }
        }
    }
    /// A copy into aligned owned storage (used when a mapped tensor is misaligned for its type).
    fn to_owned_aligned(&self) -> Self {
        let b = self.bytes();
        let mut words = vec![0u32; b.len().div_ceil(4)];
        // SAFETY: words has at least b.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), words.as_mut_ptr() as *mut u8, b.len())
        };
        Self {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: Storage::Owned(Arc::new(words), b.len()),
        }
    }
    /// Makes the data aligned for its element type (mapped data is copied only if misaligned).
    pub fn aligned(self) -> Self {
        let a = self.dtype.size().min(4);
        if (self.bytes().as_ptr() as usize) % a == 0 {
            self
        } else {
            self.to_owned_aligned()
        }
    }
    pub fn u32s(&self) -> &[u32] {
        assert_eq!(self.dtype, Dtype::U32);
        cast(self.bytes())
    }
    pub fn u16s(&self) -> &[u16] {
        assert!(matches!(self.dtype, Dtype::BF16 | Dtype::F16));
        cast(self.bytes())
    }
    pub fn f32s(&self) -> &[f32] {
        assert_eq!(self.dtype, Dtype::F32);
        cast(self.bytes())
    }
    /// Any float tensor as a float slice view.
    pub fn floats(&self) -> Result<Floats<'_>> {
        Ok(match self.dtype {
            Dtype::F32 => Floats::F32(self.f32s()),
            Dtype::BF16 => Floats::Bf16(self.u16s()),
            Dtype::F16 => Floats::F16(self.u16s()),
            d => bail!(
                "tensor `{}`: expected a float dtype, found {}",
                self.name,
                d.name()
            ),
        })
    }
    /// Converts a float tensor to a Vec<f32> (small tensors: norms, conv, gates). Reads bytes,
    /// so any alignment works.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let b = self.bytes();
        Ok(match self.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            d => bail!(
                "tensor `{}`: expected a float dtype, found {}",
                self.name,
                d.name()
            ),
        })
    }
}

fn cast<T>(b: &[u8]) -> &[T] {
    let sz = std::mem::size_of::<T>();
    assert_eq!(
        b.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "misaligned tensor data"
    );
    // SAFETY: alignment checked above; T is a plain number type; length rounded down.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, b.len() / sz) }
}

#[inline(always)]
pub fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even (as MLX's and PyTorch's casts, and the CUDA kernels'
/// `cvt.rn.bf16.f32`).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// A slice of floats stored as f32, bf16 or f16.
#[derive(Clone, Copy, Debug)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl<'a> Floats<'a> {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::Bf16(s) | Self::F16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Self::F32(s) => s[i],
            Self::Bf16(s) => bf16_to_f32(s[i]),
            Self::F16(s) => half::f16::from_bits(s[i]).to_f32(),
        }
    }
    pub fn slice(&self, r: std::ops::Range<usize>) -> Self {
        match self {
            Self::F32(s) => Self::F32(&s[r]),
            Self::Bf16(s) => Self::Bf16(&s[r]),
            Self::F16(s) => Self::F16(&s[r]),
        }
    }
}

/// An MLX affine-quantized matrix `[out, in]` (or one expert of a stack): `w = scale·q + bias` per
/// group of `group_size` consecutive inputs of a row; codes packed little-endian into u32 words,
/// lowest bits first (4-bit: element 8j+i is bits [4i, 4i+4) of word j).
#[derive(Clone, Copy, Debug)]
pub struct QuantView<'a> {
    pub out: usize,
    pub inp: usize,
    pub bits: u32,
    pub group_size: usize,
    /// `[out, inp·bits/32]`
    pub w: &'a [u32],
    /// `[out, inp/group_size]`
    pub scales: Floats<'a>,
    pub biases: Floats<'a>,
}

/// A plain (unquantized) matrix `[out, in]`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct DenseView<'a> {
    pub out: usize,
    pub inp: usize,
    pub w: Floats<'a>,
}

/// What the matmul kernels read: one `[out, in]` matrix, quantized or dense.
#[derive(Clone, Copy, Debug)]
pub enum MatView<'a> {
    Quant(QuantView<'a>),
    Dense(DenseView<'a>),
}

impl<'a> MatView<'a> {
    pub fn out(&self) -> usize {
        match self {
            Self::Quant(q) => q.out,
            Self::Dense(d) => d.out,
        }
    }
    pub fn inp(&self) -> usize {
        match self {
            Self::Quant(q) => q.inp,
            Self::Dense(d) => d.inp,
        }
    }
    /// Rows `r` of the matrix (same input width).
    pub fn rows(&self, r: std::ops::Range<usize>) -> Self {
        match self {
            Self::Quant(q) => {
                let wpr = q.inp * q.bits as usize / 32;
                let gpr = q.inp / q.group_size;
                Self::Quant(QuantView {
                    out: r.len(),
                    w: &q.w[r.start * wpr..r.end * wpr],
                    scales: q.scales.slice(r.start * gpr..r.end * gpr),
                    biases: q.biases.slice(r.start * gpr..r.end * gpr),
                    ..*q
                })
            }
            Self::Dense(d) => Self::Dense(DenseView {
                out: r.len(),
                inp: d.inp,
                w: d.w.slice(r.start * d.inp..r.end * d.inp),
            }),
        }
    }
    /// Dequantizes row `r` into `dst` (len = inp). The reference used by tests and by small ops.
    pub fn row_f32(&self, r: usize, dst: &mut [f32]) {
        match self {
            Self::Quant(q) => {
                let per = 32 / q.bits as usize;
                let mask = (1u32 << q.bits) - 1;
                let wpr = q.inp / per;
                let gpr = q.inp / q.group_size;
                for (i, d) in dst.iter_mut().enumerate().take(q.inp) {
                    let word = q.w[r * wpr + i / per];
                    let code = (word >> ((i % per) as u32 * q.bits)) & mask;
                    let g = r * gpr + i / q.group_size;
                    *d = q.scales.get(g) * code as f32 + q.biases.get(g);
                }
            }
            Self::Dense(d) => {
                for (i, x) in dst.iter_mut().enumerate().take(d.inp) {
                    *x = d.w.get(r * d.inp + i);
                }
            }
        }
    }
}

/// A linear layer's weight as loaded: `n` stacked matrices of `[out, in]` (n = 1 for a plain
/// linear, n = num_experts for `switch_mlp`).
#[derive(Clone, Debug)]
pub struct HostLinear {
    pub name: String,
    pub n: usize,
    pub out: usize,
    pub inp: usize,
    pub kind: LinearKind,
}

#[derive(Clone, Debug)]
pub enum LinearKind {
    Quant {
        bits: u32,
        group_size: usize,
        w: HostTensor,
        scales: HostTensor,
        biases: HostTensor,
    },
    Dense(HostTensor),
}

impl HostLinear {
    /// `HostTensor::release_pages` for every tensor of the layer.
    pub fn release_pages(&self) {
        match &self.kind {
            LinearKind::Quant {
                w, scales, biases, ..
            } => {
                w.release_pages();
                scales.release_pages();
                biases.release_pages();
            }
            LinearKind::Dense(t) => t.release_pages(),
        }
    }
    /// Matrix `e` of the stack (0 for a plain linear).
    pub fn view(&self, e: usize) -> MatView<'_> {
        assert!(e < self.n);
        match &self.kind {
            LinearKind::Quant {
                bits,
                group_size,
                w,
                scales,
                biases,
            } => {
                let wpm = self.out * self.inp * *bits as usize / 32;
                let gpm = self.out * self.inp / group_size;
                MatView::Quant(QuantView {
                    out: self.out,
                    inp: self.inp,
                    bits: *bits,
                    group_size: *group_size,
                    w: &w.u32s()[e * wpm..(e + 1) * wpm],
                    scales: scales
                        .floats()
                        .expect("checked at load")
                        .slice(e * gpm..(e + 1) * gpm),
                    biases: biases
                        .floats()
                        .expect("checked at load")
                        .slice(e * gpm..(e + 1) * gpm),
                })
            }
            LinearKind::Dense(t) => {
                let m = self.out * self.inp;
                MatView::Dense(DenseView {
                    out: self.out,
                    inp: self.inp,
                    w: t.floats()
                        .expect("checked at load")
                        .slice(e * m..(e + 1) * m),
                })
            }
        }
    }
    /// Bytes of weight data (for bandwidth figures).
    pub fn nbytes(&self) -> usize {
        match &self.kind {
            LinearKind::Quant {
                w, scales, biases, ..
            } => w.bytes().len() + scales.bytes().len() + biases.bytes().len(),
            LinearKind::Dense(t) => t.bytes().len(),
        }
    }
}

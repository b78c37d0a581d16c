//! The project's one pseudo-random generator (xoshiro256++) and its mixing functions.
//!
//! Synthetic checkpoints use counter-based streams: every row of every tensor has its own, seeded
//! from (seed, tensor, row), so the bytes written never depend on the thread count, the chunking
//! or the order in which rows are produced (`Rng::new`, `Rng::for_row`; that seeding is part of
//! the checkpoint format's reproducibility and must not change). The sampler seeds it the
//! standard SplitMix64 way (`Rng::splitmix`).

/// SplitMix64 finaliser: a strong 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of several words (order matters).
pub fn hash(words: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for &w in words {
        h = mix64(h ^ mix64(w));
    }
    h
}

/// FNV-1a of a string, mixed: the id of a tensor name.
pub fn name_id(s: &str) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix64(h)
}

/// xoshiro256++: fast, good quality, seeded through SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut s = [0u64; 4];
        for x in &mut s {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            *x = mix64(z);
        }
        Self { s }
    }
    /// Standard SplitMix64 seeding (the sampler's; its outputs for a seed are pinned by a test).
    pub fn splitmix(seed: u64) -> Self {
        let mut z = seed;
        let mut s = [0u64; 4];
        for x in &mut s {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut y = z;
            y = (y ^ (y >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            y = (y ^ (y >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            *x = y ^ (y >> 31);
        }
        Self { s }
    }
    /// The four state words (a device generator continues the same stream from them).
    pub fn state(&self) -> [u64; 4] {
        self.s
    }
    /// Uniform in [0, 1), 53 bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// The stream of one row of one tensor.
    pub fn for_row(seed: u64, tensor: u64, row: u64) -> Self {
        Self::new(hash(&[seed, tensor, row]))
    }
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[0]
            .wrapping_add(self.s[3])
            .rotate_left(23)
            .wrapping_add(self.s[0]);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }
    /// Uniform in [0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
    /// Uniform integer in [0, n).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Approximately standard normal: the Irwin–Hall sum of four 16-bit uniforms, centred and
    /// scaled to unit variance. Bounded by ±3.46, which keeps quantization groups free of rare
    /// outliers, and costs one generator step.
    #[inline]
    pub fn normal(&mut self) -> f32 {
        let x = self.next_u64();
        let s = (x & 0xFFFF) + ((x >> 16) & 0xFFFF) + ((x >> 32) & 0xFFFF) + (x >> 48);
        // mean 4·65535/2, variance 4·(65536²−1)/12
        (s as f32 - 131_070.0) * (1.0 / 37_837.23)
    }
    /// Fills `out` with `std`·normal.
    #[inline]
    pub fn fill_normal(&mut self, out: &mut [f32], std: f32) {
        for x in out {
            *x = self.normal() * std;
        }
    }
    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_variance() {
        let mut r = Rng::new(7);
        let n = 200_000;
        let (mut s, mut s2) = (0f64, 0f64);
        for _ in 0..n {
            let x = r.normal() as f64;
            s += x;
            s2 += x * x;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0).abs() < 0.01, "{var}");
    }
}

//! PLACEHOLDER (the lead's, to be replaced by the matmul helper): naive reference matmul.
use crate::loader::tensor::MatView;
use rayon::prelude::*;
pub fn matmul(x: &[f32], rows: usize, w: &MatView, out: &mut [f32]) {
    let (n, k) = (w.out(), w.inp());
    out[..rows * n].par_chunks_mut(n).enumerate().for_each(|(t, o)| {
        let mut row = vec![0.0f32; k];
        for (i, ov) in o.iter_mut().enumerate() {
            w.row_f32(i, &mut row);
            *ov = row.iter().zip(&x[t * k..][..k]).map(|(a, b)| a * b).sum();
        }
    });
}

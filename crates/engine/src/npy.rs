//! Minimal `.npy` (NumPy format 1.0/2.0) reading and writing: float32 logits dumps and the
//! oracle's outputs. Little-endian, C order only; anything else is a clear error.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Writes a float32 array of `shape`.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple}, }}");
    // Pad so the data starts on a 64-byte boundary, header ends with '\n'.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path)
            .with_context(|| format!("{}: cannot create", path.display()))?,
    );
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for v in data {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()?;
    Ok(())
}

/// An array read from `.npy`: its shape and values converted to f64.
pub struct Array {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

/// Reads a `.npy` of f4/f8/i4/i8/u4 (little-endian, C order).
pub fn read(path: &Path) -> Result<Array> {
    let b = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        bail!("{}: not a .npy file", path.display());
    }
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        v => bail!("{}: unsupported .npy version {v}", path.display()),
    };
    let header = std::str::from_utf8(
        b.get(start..start + hlen)
            .context("truncated .npy header")?,
    )?;
    if header.contains("'fortran_order': True") {
        bail!("{}: Fortran-order arrays are not supported", path.display());
    }
    let descr = header
        .split("'descr':")
        .nth(1)
        .and_then(|s| s.split('\'').nth(1))
        .context("no descr in .npy header")?;
    let shape_s = header
        .split("'shape':")
        .nth(1)
        .and_then(|s| s.split('(').nth(1))
        .and_then(|s| s.split(')').next())
        .context("no shape in .npy header")?;
    let shape: Vec<usize> = shape_s
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let n: usize = shape.iter().product();
    let body = &b[start + hlen..];
    let sz = match descr {
        "<f4" | "<i4" | "<u4" => 4,
        "<f8" | "<i8" => 8,
        d => bail!("{}: unsupported dtype {d}", path.display()),
    };
    if body.len() < n * sz {
        bail!("{}: truncated .npy data", path.display());
    }
    let data = (0..n)
        .map(|i| {
            let c = &body[i * sz..(i + 1) * sz];
            match descr {
                "<f4" => f32::from_le_bytes(c.try_into().unwrap()) as f64,
                "<i4" => i32::from_le_bytes(c.try_into().unwrap()) as f64,
                "<u4" => u32::from_le_bytes(c.try_into().unwrap()) as f64,
                "<f8" => f64::from_le_bytes(c.try_into().unwrap()),
                _ => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            }
        })
        .collect();
    Ok(Array { shape, data })
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let v: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        super::write_f32(&p, &[2, 3], &v).unwrap();
        let a = super::read(&p).unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(a.data[5], 2.5);
    }
}

//! Reading safetensors files: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; nothing is copied unless a load-time
//! fix needs it. Every structural problem (missing shard, truncated file, bad header, overlapping or
//! out-of-range offsets) is a one-line error naming the file.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use serde_json::Value;

use super::tensor::{Dtype, HostTensor, Storage};

/// The safetensors files of a checkpoint directory, in a stable order.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        bail!(
            "{}: not a directory (expected a checkpoint with config.json and *.safetensors)",
            dir.display()
        );
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("{}: cannot read", index.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .with_context(|| format!("{}: no `weight_map` object", index.display()))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.exists() {
                bail!(
                    "{}: shard listed in model.safetensors.index.json is missing",
                    p.display()
                );
            }
        }
        return Ok(paths);
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        bail!("{}: no *.safetensors files", dir.display());
    }
    Ok(paths)
}

/// Maps one file and lists its tensors, validating the header against the file size.
pub fn read_file(path: &Path) -> Result<Vec<HostTensor>> {
    let f = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    // SAFETY: the file is opened read-only; a checkpoint changed under a running engine is the
    // user's error, as with every mmap-based loader.
    let map = Arc::new(
        unsafe { Mmap::map(&f) }.with_context(|| format!("{}: cannot map", path.display()))?,
    );
    let total = map.len();
    if total < 8 {
        bail!(
            "{}: truncated safetensors file ({total} bytes, no header)",
            path.display()
        );
    }
    let n = u64::from_le_bytes(map[..8].try_into().unwrap()) as usize;
    if n > total - 8 || n > 100 << 20 {
        bail!(
            "{}: truncated or corrupt safetensors file (header of {n} bytes, file of {total})",
            path.display()
        );
    }
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&map[8..8 + n]).with_context(|| {
            format!(
                "{}: corrupt safetensors header (not a JSON object)",
                path.display()
            )
        })?;
    let base = 8 + n;
    let mut out = Vec::with_capacity(header.len());
    let mut spans = Vec::with_capacity(header.len());
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let dt = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let dtype = Dtype::parse(dt).with_context(|| {
            format!(
                "{}: tensor `{name}` has unsupported dtype {dt}",
                path.display()
            )
        })?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .with_context(|| format!("{}: tensor `{name}` has no valid shape", path.display()))?;
        let offs: Vec<usize> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .with_context(|| {
                format!(
                    "{}: tensor `{name}` has no valid data_offsets",
                    path.display()
                )
            })?;
        if offs.len() != 2 || offs[0] > offs[1] {
            bail!(
                "{}: tensor `{name}` has invalid data_offsets {offs:?}",
                path.display()
            );
        }
        let want = shape.iter().product::<usize>() * dtype.size();
        if offs[1] - offs[0] != want {
            bail!(
                "{}: tensor `{name}` holds {} bytes but shape {shape:?} {dt} needs {want}",
                path.display(),
                offs[1] - offs[0]
            );
        }
        if base + offs[1] > total {
            bail!(
                "{}: truncated: tensor `{name}` ends at byte {} but the file has {total} (re-download or re-convert the checkpoint)",
                path.display(),
                base + offs[1]
            );
        }
        spans.push((offs[0], offs[1], name.clone()));
        out.push(HostTensor {
            name,
            dtype,
            shape,
            data: Storage::Mapped {
                map: map.clone(),
                offset: base + offs[0],
                len: offs[1] - offs[0],
            },
        });
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            bail!(
                "{}: tensors `{}` and `{}` overlap",
                path.display(),
                w[0].2,
                w[1].2
            );
        }
    }
    Ok(out)
}

/// Every tensor of a checkpoint directory by name (duplicates across shards are an error).
pub fn read_dir(dir: &Path) -> Result<HashMap<String, HostTensor>> {
    let mut all = HashMap::new();
    for p in checkpoint_files(dir)? {
        for t in read_file(&p)? {
            if let Some(prev) = all.insert(t.name.clone(), t) {
                bail!(
                    "{}: tensor `{}` appears in more than one file",
                    p.display(),
                    prev.name
                );
            }
        }
    }
    Ok(all)
}

//! Run-time compilation of the kernel files with NVRTC, cached on disk.
//!
//! A kernel file is compiled as `prelude + file` (the prelude is every `kernels/*.cuh`, in name
//! order) with `--gpu-architecture=sm_XY --std=c++17` for the device's compute capability, straight
//! to a cubin (no PTX JIT at load). The cubin is cached under `$LILY_CACHE_DIR` (default
//! `$XDG_CACHE_HOME/lily` or `~/.cache/lily`), in `kernels/<file>-<arch>-<hash>.cubin`, the hash
//! being FNV-1a 64 of the source and options: a changed kernel gets a new file, and with a warm
//! cache NVRTC is not even loaded. `scripts/check-kernels` compiles the same way, without a GPU.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use cudarc::nvrtc::sys;

/// The compiler options every kernel file gets (besides the architecture).
pub const OPTIONS: &[&str] = &["--std=c++17"];

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff; // separator
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are kept.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LILY_CACHE_DIR") {
        return PathBuf::from(d).join("kernels");
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("lily").join("kernels");
    }
    if let Some(d) = std::env::var_os("HOME") {
        return PathBuf::from(d).join(".cache").join("lily").join("kernels");
    }
    std::env::temp_dir().join("lily-cache").join("kernels")
}

/// The cubin of `name` (`src` already holds the prelude) for `arch` (e.g. `sm_90`), from the
/// cache or freshly compiled.
pub fn cubin_cached(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    let arch_opt = format!("--gpu-architecture={arch}");
    let mut parts: Vec<&[u8]> = vec![src.as_bytes(), arch_opt.as_bytes()];
    parts.extend(OPTIONS.iter().map(|o| o.as_bytes()));
    let key = fnv1a(&parts);
    let stem = name.trim_end_matches(".cu");
    let dir = cache_dir();
    let path = dir.join(format!("{stem}-{arch}-{key:016x}.cubin"));
    if let Ok(b) = std::fs::read(&path) {
        if !b.is_empty() {
            return Ok(b);
        }
    }
    let mut opts = vec![arch_opt.clone()];
    opts.extend(OPTIONS.iter().map(|s| s.to_string()));
    let cubin = compile(name, src, &opts)?;
    // Best effort: a read-only cache only costs a recompilation next time.
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = dir.join(format!(".{stem}-{key:016x}.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() && std::fs::rename(&tmp, &path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(cubin)
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        bail!("{what}: {r:?}")
    }
}

/// Compiles one program to a cubin; a compile error carries NVRTC's log.
pub fn compile(name: &str, src: &str, opts: &[String]) -> Result<Vec<u8>> {
    // SAFETY: probing for the library has no preconditions.
    if !unsafe { sys::is_culib_present() } {
        bail!(
            "NVRTC (libnvrtc.so.13) could not be loaded to compile the CUDA kernels: install the CUDA 13 \
             runtime compiler and put its lib directory (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
        );
    }
    let csrc = CString::new(src).context("kernel source holds a NUL byte")?;
    let cname = CString::new(name).context("kernel name holds a NUL byte")?;
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("option"))
        .collect();
    let optp: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: plain NVRTC calls on live C strings; the program is destroyed on every path below.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "nvrtcCreateProgram",
        )?;
        let r = sys::nvrtcCompileProgram(prog, optp.len() as c_int, optp.as_ptr());
        let out = if r != sys::nvrtcResult::NVRTC_SUCCESS {
            let mut n = 0usize;
            sys::nvrtcGetProgramLogSize(prog, &mut n);
            let mut log = vec![0 as c_char; n.max(1)];
            sys::nvrtcGetProgramLog(prog, log.as_mut_ptr());
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            Err(anyhow::anyhow!(
                "NVRTC failed to compile {name} ({r:?}):\n{log}"
            ))
        } else {
            let mut n = 0usize;
            let r = sys::nvrtcGetCUBINSize(prog, &mut n);
            if r != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
                Err(anyhow::anyhow!(
                    "NVRTC produced no cubin for {name} ({r:?})"
                ))
            } else {
                let mut bin = vec![0u8; n];
                check(
                    sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char),
                    "nvrtcGetCUBIN",
                )
                .map(|_| bin)
            }
        };
        sys::nvrtcDestroyProgram(&mut prog);
        out
    }
}

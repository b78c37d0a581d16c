//! The shaders' offline check: naga parses and validates every WGSL file of the backend and
//! translates it to Metal Shading Language, on any machine (no GPU, no Mac): a shader that Metal
//! would reject, or that is invalid WGSL, fails here. The tests call it; `lily wgsl-msl DIR`
//! writes the MSL for review. The files of `NOT_FOR_METAL` are validated only (their reasons
//! are `not_for_metal`'s).

use anyhow::{anyhow, Result};

use super::device::{shaders, NOT_FOR_METAL};

/// Every shader file's name and its MSL (MSL 2.4: Apple Silicon Macs), except those of
/// `NOT_FOR_METAL`, which are validated (with cooperative matrices) but not translated.
pub fn translate_to_msl() -> Result<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    for sh in shaders() {
        let module = naga::front::wgsl::parse_str(sh.src)
            .map_err(|e| anyhow!("{}.wgsl: {}", sh.name, e.emit_to_string(sh.src)))?;
        // SHADER_FLOAT16_IN_FLOAT32: pack2x16float / unpack2x16float (the f16 KV cache,
        // kv_f16.wgsl); wgpu grants it on Vulkan and Metal (llvmpipe: with SHADER_F16).
        let caps = naga::valid::Capabilities::SUBGROUP
            | naga::valid::Capabilities::SHADER_FLOAT16
            | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | naga::valid::Capabilities::COOPERATIVE_MATRIX;
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
            .validate(&module)
            .map_err(|e| anyhow!("{}.wgsl: {}", sh.name, e.emit_to_string(sh.src)))?;
        if NOT_FOR_METAL.iter().any(|(n, _)| *n == sh.name) {
            continue;
        }
        // Pipeline constants at their defaults (gemv_q6s's shape constants; the MSL backend
        // takes a module with its overrides resolved, as wgpu's Metal backend gives it).
        let (module, info) = naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            None,
            &Default::default(),
        )
        .map_err(|e| anyhow!("{}.wgsl overrides: {e:?}", sh.name))?;
        let opts = naga::back::msl::Options {
            lang_version: (2, 4),
            ..Default::default()
        };
        let (msl, _) = naga::back::msl::write_string(
            &module,
            &info,
            &opts,
            &naga::back::msl::PipelineOptions::default(),
        )
        .map_err(|e| anyhow!("{}.wgsl to MSL: {e}", sh.name))?;
        out.push((sh.name, msl));
    }
    Ok(out)
}

/// The shader files `translate_to_msl` validates but does not translate, each with the reason.
pub fn not_for_metal() -> Vec<(&'static str, &'static str)> {
    NOT_FOR_METAL.to_vec()
}

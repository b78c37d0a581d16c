//! The shaders' offline check: naga parses and validates every WGSL file of the backend and
//! translates it to Metal Shading Language, on any machine (no GPU, no Mac): a shader that Metal
//! would reject, or that is invalid WGSL, fails here. The tests call it; `lily wgsl-msl DIR`
//! writes the MSL for review.

use anyhow::{anyhow, Result};

use super::device::shaders;

/// Every shader file's name and its MSL (MSL 2.4: Apple Silicon Macs).
pub fn translate_to_msl() -> Result<Vec<(&'static str, String)>> {
    shaders()
        .iter()
        .map(|sh| {
            let module = naga::front::wgsl::parse_str(sh.src)
                .map_err(|e| anyhow!("{}.wgsl: {}", sh.name, e.emit_to_string(sh.src)))?;
            let caps =
                naga::valid::Capabilities::SUBGROUP | naga::valid::Capabilities::SHADER_FLOAT16;
            let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
                .validate(&module)
                .map_err(|e| anyhow!("{}.wgsl: {}", sh.name, e.emit_to_string(sh.src)))?;
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
            Ok((sh.name, msl))
        })
        .collect()
}

//! The compiled kernels as the Vulkan driver sees them (`lily lab --backend wgpu
//! --pipeline-stats FILE`): register counts, spills, instruction counts and the driver's
//! internal representations (its IR, machine code) of every compute entry point of the backend.
//!
//! Why: wgpu hides the SPIR-V it writes and the pipelines the driver builds from it, so a slow
//! kernel (the GEMVs well under the pure-read bandwidth on an H200) cannot be read at the level
//! where the cause would show (registers, spills, the loads the compiler emitted). This probe
//! rebuilds each pipeline on its own Vulkan device, from the same SPIR-V wgpu 30 would give the
//! driver, and asks the driver what it made of it.
//!
//! How: each shader file of `device::shaders()` is parsed and validated by naga, and each compute
//! entry point written to SPIR-V alone with the options wgpu-hal 30's Vulkan backend uses for our
//! trusted modules (`create_shader_module_trusted` with `ShaderRuntimeChecks::unchecked()`, no
//! zeroed workgroup memory: one entry point a module, SPIR-V version by the device's API version,
//! no bounds checks, no forced loop bounds, no integer-division checks). The device is opened
//! through `ash` with robust buffer access (and `robustBufferAccess2`) where the driver offers
//! them, as wgpu does, since they can change the generated code (`LILY_STATS_ROBUST=0` leaves
//! them off, to see what they cost). Each pipeline is created with
//! `CAPTURE_STATISTICS` and `CAPTURE_INTERNAL_REPRESENTATIONS`, then read back.
//!
//! What it needs of the driver: Vulkan 1.1 or later and `VK_KHR_pipeline_executable_properties`
//! with its `pipelineExecutableInfo` feature (NVIDIA's driver, RADV and ANV have it; Mesa's
//! lavapipe does not, as of Mesa 25.0: there `pipeline_stats(_, true)` only compiles each entry
//! point, which still checks the SPIR-V and the driver's acceptance of it). Float16, int8, 16-bit storage, subgroup size control and integer dot
//! products are enabled where offered, and VK_KHR_cooperative_matrix with the Vulkan memory
//! model where both are (gemm_coop; elsewhere its entry point fails to compile, reported as such). The device is chosen as the backend chooses its adapter:
//! the name containing `LILY_WGPU_ADAPTER` when set, else the first GPU (a CPU one last).

use std::collections::BTreeMap;
use std::ffi::{c_char, CStr, CString};

use anyhow::{anyhow, bail, Context, Result};
use ash::vk;

use super::device::shaders;

/// One statistic of an executable: the driver's name and description, the value formatted.
#[derive(Clone, Debug)]
pub struct Stat {
    pub name: String,
    pub description: String,
    pub value: String,
}

/// One internal representation of an executable (the driver's IR or machine code).
#[derive(Clone, Debug)]
pub struct Repr {
    pub name: String,
    pub description: String,
    /// Text (NUL dropped) when `is_text`, else the driver's bytes.
    pub is_text: bool,
    pub data: Vec<u8>,
}

/// One executable of a pipeline (a compute pipeline has one, on the drivers seen so far).
#[derive(Clone, Debug)]
pub struct Executable {
    pub name: String,
    pub description: String,
    pub subgroup_size: u32,
    pub stats: Vec<Stat>,
    pub reprs: Vec<Repr>,
}

/// One resource of an entry point: its WGSL `@group(g) @binding(b)`, and its Vulkan binding in
/// descriptor set `group` (wgpu numbers a group's bindings 0, 1, … in order of their WGSL
/// numbers, and passes naga that map).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Binding {
    pub group: u32,
    pub binding: u32,
    pub vk_binding: u32,
    pub kind: &'static str,
}

/// One compute entry point of a shader file.
#[derive(Debug)]
pub struct EntryReport {
    pub module: String,
    pub entry: String,
    /// The SPIR-V's words and declared capabilities (empty when the translation failed).
    pub spirv_words: usize,
    pub capabilities: Vec<String>,
    /// The resources the entry point uses, as wgpu lays them out.
    pub bindings: Vec<Binding>,
    /// Whether the driver was asked for statistics (see `Report::stats_offered`).
    pub stats_offered: bool,
    /// The executables, or why this entry point has none (translation or compilation failed).
    pub result: Result<Vec<Executable>, String>,
}

/// The error when the driver lacks `VK_KHR_pipeline_executable_properties` (a test skips on it).
#[derive(Debug)]
pub struct NotOffered(pub String);

impl std::fmt::Display for NotOffered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: the driver does not offer VK_KHR_pipeline_executable_properties, so it cannot \
             report its compiled kernels",
            self.0
        )
    }
}

impl std::error::Error for NotOffered {}

/// The probe's result: the device and each entry point.
#[derive(Debug)]
pub struct Report {
    pub device: String,
    pub driver: String,
    pub api: String,
    pub spirv: (u8, u8),
    /// Features enabled on the device beyond the extension's own.
    pub features: Vec<&'static str>,
    /// Whether the driver reported statistics (false: `pipeline_stats(_, true)` on a driver
    /// without the extension: each entry point was only compiled).
    pub stats_offered: bool,
    pub entries: Vec<EntryReport>,
}

impl EntryReport {
    /// One line: `module entry: Name=value; Name=value; …` (each executable's, prefixed by its
    /// name when there are several), or the failure.
    pub fn summary(&self) -> String {
        let body = match &self.result {
            Err(e) => format!("FAILED: {e}"),
            Ok(_) if !self.stats_offered => "compiled (no statistics from this driver)".to_string(),
            Ok(exes) if exes.is_empty() => "no executables reported".to_string(),
            Ok(exes) => exes
                .iter()
                .map(|x| {
                    let s = x
                        .stats
                        .iter()
                        .map(|s| format!("{}={}", s.name, s.value))
                        .collect::<Vec<_>>()
                        .join("; ");
                    let s = if s.is_empty() {
                        "no statistics".to_string()
                    } else {
                        s
                    };
                    if exes.len() > 1 {
                        format!("[{}] {s}", x.name)
                    } else {
                        s
                    }
                })
                .collect::<Vec<_>>()
                .join(" | "),
        };
        format!("{} {}: {body}", self.module, self.entry)
    }
}

impl Report {
    /// The device in one line.
    pub fn header(&self) -> String {
        format!(
            "{} ({}), Vulkan {}, SPIR-V {}.{}, enabled: {}{}",
            self.device,
            self.driver,
            self.api,
            self.spirv.0,
            self.spirv.1,
            self.features.join(", "),
            if self.stats_offered {
                ""
            } else {
                "; no VK_KHR_pipeline_executable_properties: compiled only, no statistics"
            }
        )
    }

    /// The full dump: per entry point its SPIR-V's capabilities and bindings, each executable's
    /// statistics with their descriptions and each internal representation's text (binary ones
    /// by size only: `binaries` has them).
    pub fn dump(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ = writeln!(o, "lily pipeline statistics: {}\n", self.header());
        for e in &self.entries {
            let _ = writeln!(o, "==== {} {} ====", e.module, e.entry);
            let _ = writeln!(
                o,
                "SPIR-V: {} words; capabilities: {}",
                e.spirv_words,
                e.capabilities.join(", ")
            );
            let b: Vec<String> = e
                .bindings
                .iter()
                .map(|b| {
                    let vk = if b.vk_binding == b.binding {
                        String::new()
                    } else {
                        format!(" (Vulkan binding {})", b.vk_binding)
                    };
                    format!("{}.{} {}{vk}", b.group, b.binding, b.kind)
                })
                .collect();
            let _ = writeln!(o, "bindings (group.binding): {}", b.join(", "));
            match &e.result {
                Err(err) => {
                    let _ = writeln!(o, "FAILED: {err}\n");
                }
                Ok(exes) => {
                    for (i, x) in exes.iter().enumerate() {
                        let _ = writeln!(
                            o,
                            "-- executable {i}: {} ({}), subgroup size {}",
                            x.name, x.description, x.subgroup_size
                        );
                        for s in &x.stats {
                            let _ =
                                writeln!(o, "  {} = {}    ({})", s.name, s.value, s.description);
                        }
                        for r in &x.reprs {
                            if r.is_text {
                                let _ = writeln!(
                                    o,
                                    "-- representation: {} ({}), {} bytes of text\n{}",
                                    r.name,
                                    r.description,
                                    r.data.len(),
                                    String::from_utf8_lossy(&r.data).trim_end()
                                );
                            } else {
                                let _ = writeln!(
                                    o,
                                    "-- representation: {} ({}), binary, {} bytes",
                                    r.name,
                                    r.description,
                                    r.data.len()
                                );
                            }
                        }
                    }
                    let _ = writeln!(o);
                }
            }
        }
        o
    }

    /// The binary representations: a file-name-safe key (`module.entry.exe.repr`) and the bytes.
    pub fn binaries(&self) -> Vec<(String, &[u8])> {
        let safe = |s: &str| -> String {
            s.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect()
        };
        let mut v = Vec::new();
        for e in &self.entries {
            if let Ok(exes) = &e.result {
                for (i, x) in exes.iter().enumerate() {
                    for r in x.reprs.iter().filter(|r| !r.is_text) {
                        v.push((
                            format!("{}.{}.{i}.{}", e.module, e.entry, safe(&r.name)),
                            r.data.as_slice(),
                        ));
                    }
                }
            }
        }
        v
    }
}

/// Probe every compute entry point whose `module entry` contains `filter` (all when `None`).
/// A driver without `VK_KHR_pipeline_executable_properties` is an error (`NotOffered`), unless
/// `compile_only_without`: then each entry point is only compiled (a check of the SPIR-V).
pub fn pipeline_stats(filter: Option<&str>, compile_only_without: bool) -> Result<Report> {
    let vk = Vk::open(compile_only_without)?;
    let mut entries = Vec::new();
    for sh in shaders() {
        let (module, info) = match parse(sh.name, sh.src) {
            Ok(m) => m,
            // A file that does not parse fails all its entry points (shown unless filtered out).
            Err(_) if filter.is_some_and(|f| !f.contains(sh.name) && !sh.name.contains(f)) => {
                continue
            }
            Err(e) => {
                entries.push(EntryReport {
                    module: sh.name.to_string(),
                    entry: "*".to_string(),
                    spirv_words: 0,
                    capabilities: Vec::new(),
                    bindings: Vec::new(),
                    stats_offered: vk.stats,
                    result: Err(format!("{e:#}")),
                });
                continue;
            }
        };
        for (i, ep) in module.entry_points.iter().enumerate() {
            if ep.stage != naga::ShaderStage::Compute {
                continue;
            }
            let key = format!("{} {}", sh.name, ep.name);
            if filter.is_some_and(|f| !key.contains(f)) {
                continue;
            }
            let bindings = bindings_of(&module, &info, i);
            let mut rep = EntryReport {
                module: sh.name.to_string(),
                entry: ep.name.clone(),
                spirv_words: 0,
                capabilities: Vec::new(),
                bindings: bindings.clone(),
                stats_offered: vk.stats,
                result: Err(String::new()),
            };
            rep.result = match to_spirv(&module, &info, &ep.name, &bindings, vk.spirv) {
                Err(e) => Err(format!("{e:#}")),
                Ok(words) => {
                    rep.spirv_words = words.len();
                    rep.capabilities = capabilities(&words);
                    if !vk.coop && rep.capabilities.iter().any(|c| c == "CooperativeMatrixKHR") {
                        // Not given to a driver that was not asked for the extension.
                        Err(
                            "not compiled: the device has no VK_KHR_cooperative_matrix with \
                             the Vulkan memory model"
                                .to_string(),
                        )
                    } else {
                        vk.compile(&words, &bindings, &ep.name)
                            .map_err(|e| format!("{e:#}"))
                    }
                }
            };
            entries.push(rep);
        }
    }
    Ok(Report {
        device: vk.name.clone(),
        driver: vk.driver.clone(),
        api: vk.api.clone(),
        spirv: vk.spirv,
        features: vk.features.clone(),
        stats_offered: vk.stats,
        entries,
    })
}

/// A shader file parsed and validated (all capabilities: the device's are the driver's concern).
fn parse(name: &str, src: &str) -> Result<(naga::Module, naga::valid::ModuleInfo)> {
    let module = naga::front::wgsl::parse_str(src)
        .map_err(|e| anyhow!("{name}.wgsl: {}", e.emit_to_string(src)))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| anyhow!("{name}.wgsl: {}", e.emit_to_string(src)))?;
    Ok((module, info))
}

/// The resources entry point `ep` uses, sorted, numbered as wgpu's derived layout numbers them.
fn bindings_of(module: &naga::Module, info: &naga::valid::ModuleInfo, ep: usize) -> Vec<Binding> {
    let used = info.get_entry_point(ep);
    let mut v: Vec<Binding> = module
        .global_variables
        .iter()
        .filter(|(h, _)| !used[*h].is_empty())
        .filter_map(|(_, g)| {
            let rb = g.binding.as_ref()?;
            let kind = match g.space {
                naga::AddressSpace::Uniform => "uniform",
                naga::AddressSpace::Storage { .. } => "storage",
                _ => "other",
            };
            Some(Binding {
                group: rb.group,
                binding: rb.binding,
                vk_binding: 0,
                kind,
            })
        })
        .collect();
    v.sort();
    for i in 0..v.len() {
        v[i].vk_binding = match i {
            0 => 0,
            _ if v[i - 1].group == v[i].group => v[i - 1].vk_binding + 1,
            _ => 0,
        };
    }
    v
}

/// The SPIR-V of one entry point, written as wgpu-hal 30 writes it for a trusted module
/// (`SEPARATE_ENTRY_POINTS`, which it always sets: the module translated per pipeline).
fn to_spirv(
    module: &naga::Module,
    info: &naga::valid::ModuleInfo,
    entry: &str,
    bindings: &[Binding],
    lang_version: (u8, u8),
) -> Result<Vec<u32>> {
    use naga::back::spv;
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        module,
        info,
        Some((naga::ShaderStage::Compute, entry)),
        &Default::default(),
    )
    .map_err(|e| anyhow!("overrides: {e}"))?;
    let unchecked = naga::proc::BoundsCheckPolicy::Unchecked;
    let opts = spv::Options {
        lang_version,
        // wgpu: DEBUG only with its debug instance flag; LABEL_VARYINGS except on Qualcomm;
        // FORCE_POINT_SIZE always (no effect on a compute shader).
        flags: spv::WriterFlags::LABEL_VARYINGS | spv::WriterFlags::FORCE_POINT_SIZE,
        fake_missing_bindings: false,
        binding_map: bindings
            .iter()
            .map(|b| {
                let rb = naga::ResourceBinding {
                    group: b.group,
                    binding: b.binding,
                };
                let to = spv::BindingInfo {
                    descriptor_set: b.group,
                    binding: b.vk_binding,
                    binding_array_size: None,
                };
                (rb, to)
            })
            .collect(),
        capabilities: None,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: unchecked,
            buffer: unchecked,
            image_load: unchecked,
            binding_array: unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: false,
        ray_query_initialization_tracking: false,
        trace_ray_argument_validation: true,
        use_storage_input_output_16: false,
        debug_info: None,
        task_dispatch_limits: None,
        mesh_shader_primitive_indices_clamp: false,
        emit_int_div_checks: false,
    };
    let pipe = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    spv::write_vec(&module, &info, &opts, Some(&pipe)).map_err(|e| anyhow!("to SPIR-V: {e}"))
}

/// The SPIR-V of entry point `entry` of the backend's shader file `module` (a name of
/// `device::shaders()`) as wgpu-hal 30 writes it for a trusted module, at SPIR-V `lang_version`,
/// and the capabilities it declares; no device needed. Tests check that naga writes it (its
/// SPIR-V writer can fail where its validator passed: gemm_coop's coopStore arguments), and
/// `spirv-val` can be run on the words.
pub fn spirv_of(
    module: &str,
    entry: &str,
    lang_version: (u8, u8),
) -> Result<(Vec<u32>, Vec<String>)> {
    let sh = shaders()
        .into_iter()
        .find(|s| s.name == module)
        .ok_or_else(|| anyhow!("no shader file named {module}"))?;
    let (m, info) = parse(sh.name, sh.src)?;
    let ep = m
        .entry_points
        .iter()
        .position(|e| e.name == entry && e.stage == naga::ShaderStage::Compute)
        .ok_or_else(|| anyhow!("{module}.wgsl has no compute entry point {entry}"))?;
    let bindings = bindings_of(&m, &info, ep);
    let words = to_spirv(&m, &info, entry, &bindings, lang_version)?;
    let caps = capabilities(&words);
    Ok((words, caps))
}

/// The capabilities a SPIR-V module declares (`OpCapability`), by name.
fn capabilities(words: &[u32]) -> Vec<String> {
    let mut caps = Vec::new();
    let mut i = 5; // the header
    while i < words.len() {
        let (len, op) = ((words[i] >> 16) as usize, words[i] & 0xffff);
        if len == 0 {
            break;
        }
        if op == 17 && i + 1 < words.len() {
            let c = words[i + 1];
            caps.push(match naga::back::spv::Capability::from_u32(c) {
                Some(c) => format!("{c:?}"),
                None => c.to_string(),
            });
        }
        i += len;
    }
    caps
}

/// A string the driver wrote into a fixed `char` array.
fn fixed(s: &[c_char]) -> String {
    let bytes: Vec<u8> = s
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A Vulkan version as `major.minor.patch`.
fn version(v: u32) -> String {
    format!(
        "{}.{}.{}",
        vk::api_version_major(v),
        vk::api_version_minor(v),
        vk::api_version_patch(v)
    )
}

/// The probe's Vulkan instance and device.
struct Vk {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    exec: ash::khr::pipeline_executable_properties::Device,
    /// Whether the extension is enabled (pipelines are captured and queried).
    stats: bool,
    /// `ALLOW_VARYING_SUBGROUP_SIZE` on each stage (wgpu sets it when it has subgroups).
    varying_subgroup: bool,
    /// VK_KHR_cooperative_matrix and the Vulkan memory model are enabled (gemm_coop compiles).
    coop: bool,
    spirv: (u8, u8),
    name: String,
    driver: String,
    api: String,
    features: Vec<&'static str>,
}

impl Drop for Vk {
    fn drop(&mut self) {
        // SAFETY: every object made from them was destroyed (`Objects`), none is in use.
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// The highest Vulkan API the probe asks for (ash's headers are 1.3's).
const API: u32 = vk::API_VERSION_1_3;

impl Vk {
    fn open(without: bool) -> Result<Vk> {
        // SAFETY: loading the system's Vulkan loader; ash checks the entry points it resolves.
        let entry = unsafe { ash::Entry::load() }
            .map_err(|e| anyhow!("cannot load the Vulkan loader (libvulkan): {e}"))?;
        // SAFETY: a plain query of the loader.
        let inst_api = unsafe { entry.try_enumerate_instance_version() }
            .context("vkEnumerateInstanceVersion")?
            .unwrap_or(vk::API_VERSION_1_0);
        if inst_api < vk::API_VERSION_1_1 {
            bail!(
                "the Vulkan loader offers API {}: the probe needs 1.1 or later",
                version(inst_api)
            );
        }
        let app = vk::ApplicationInfo::default()
            .application_name(c"lily pipeline-stats")
            .api_version(API);
        // SAFETY: a valid create info with no layers or extensions.
        let instance = unsafe {
            entry.create_instance(
                &vk::InstanceCreateInfo::default().application_info(&app),
                None,
            )
        }
        .context("vkCreateInstance")?;
        match Self::open_device(&entry, instance.clone(), without) {
            Ok(v) => Ok(v),
            Err(e) => {
                // SAFETY: nothing made from the instance survives the failure; the loader is
                // still loaded (`entry`).
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    fn open_device(entry: &ash::Entry, instance: ash::Instance, without: bool) -> Result<Vk> {
        // SAFETY (this function's calls): queries and creation on a live instance, with structs
        // built by ash's builders that outlive the calls using them.
        let pds = unsafe { instance.enumerate_physical_devices() }
            .context("vkEnumeratePhysicalDevices")?;
        let props = |pd| unsafe { instance.get_physical_device_properties(pd) };
        let want = std::env::var("LILY_WGPU_ADAPTER")
            .ok()
            .filter(|w| !w.is_empty());
        let all: Vec<String> = pds
            .iter()
            .map(|&pd| fixed(&props(pd).device_name))
            .collect();
        let mut cands: Vec<_> = pds
            .iter()
            .copied()
            .filter(|&pd| match &want {
                Some(w) => fixed(&props(pd).device_name)
                    .to_lowercase()
                    .contains(&w.to_lowercase()),
                None => true,
            })
            .collect();
        // The first GPU, a CPU device (lavapipe) last, as the backend ranks its adapters.
        cands.sort_by_key(|&pd| props(pd).device_type == vk::PhysicalDeviceType::CPU);
        let Some(&pd) = cands.first() else {
            bail!(
                "no Vulkan device{} (devices: {})",
                match &want {
                    Some(w) => format!(" named like LILY_WGPU_ADAPTER={w:?}"),
                    None => String::new(),
                },
                if all.is_empty() {
                    "none".to_string()
                } else {
                    all.join(", ")
                }
            );
        };
        let p = props(pd);
        let name = fixed(&p.device_name);
        let api = p.api_version.min(API);
        if api < vk::API_VERSION_1_1 {
            bail!(
                "{name}: Vulkan {}, the probe needs 1.1 or later",
                version(p.api_version)
            );
        }
        let driver = if api >= vk::API_VERSION_1_2 {
            let mut d = vk::PhysicalDeviceDriverProperties::default();
            let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut d);
            unsafe { instance.get_physical_device_properties2(pd, &mut p2) };
            format!("{} {}", fixed(&d.driver_name), fixed(&d.driver_info))
                .trim()
                .to_string()
        } else {
            format!("driver version {:#x}", p.driver_version)
        };

        let exts = unsafe { instance.enumerate_device_extension_properties(pd) }
            .context("vkEnumerateDeviceExtensionProperties")?;
        let has = |n: &CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(n));
        let pep_name = ash::khr::pipeline_executable_properties::NAME;
        let stats = has(pep_name);
        if !stats && !without {
            return Err(NotOffered(format!("{name} ({driver})")).into());
        }
        let rb2_name = ash::ext::robustness2::NAME;
        let has_rb2 = has(rb2_name);
        // Cooperative matrices (gemm_coop), as wgpu enables them: the extension, its feature,
        // and the Vulkan memory model (with device scope) that naga declares in such modules.
        let cm_name = ash::khr::cooperative_matrix::NAME;
        let has_cm = has(cm_name) && api >= vk::API_VERSION_1_2;

        // What the device offers.
        let mut q_pep = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
        let mut q_16 = vk::PhysicalDevice16BitStorageFeatures::default();
        let mut q_12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut q_13 = vk::PhysicalDeviceVulkan13Features::default();
        let mut q_rb2 = vk::PhysicalDeviceRobustness2FeaturesEXT::default();
        let mut q_cm = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
        let core = {
            let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut q_16);
            if stats {
                f2 = f2.push_next(&mut q_pep);
            }
            if api >= vk::API_VERSION_1_2 {
                f2 = f2.push_next(&mut q_12);
            }
            if api >= vk::API_VERSION_1_3 {
                f2 = f2.push_next(&mut q_13);
            }
            if has_rb2 {
                f2 = f2.push_next(&mut q_rb2);
            }
            if has_cm {
                f2 = f2.push_next(&mut q_cm);
            }
            unsafe { instance.get_physical_device_features2(pd, &mut f2) };
            f2.features
        };
        if stats && q_pep.pipeline_executable_info == vk::FALSE {
            bail!("{name} ({driver}): VK_KHR_pipeline_executable_properties is listed but its pipelineExecutableInfo feature is not offered");
        }

        // What the probe enables: what wgpu would for lily (subgroups, f16) where offered.
        let mut features = Vec::new();
        let mut on = |offered: vk::Bool32, what: &'static str| -> vk::Bool32 {
            if offered != vk::FALSE {
                features.push(what);
            }
            offered
        };
        // `LILY_STATS_ROBUST=0`: the pipelines as a device without robust buffer access would
        // build them (wgpu always enables it where offered: whether its bounds checks cost the
        // decode kernels code, compare the two runs' instruction counts).
        let robust = std::env::var("LILY_STATS_ROBUST").map_or(true, |v| v != "0");
        let e_core = vk::PhysicalDeviceFeatures::default().robust_buffer_access(
            robust && on(core.robust_buffer_access, "robustBufferAccess") != 0,
        );
        let mut e_pep = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default()
            .pipeline_executable_info(true);
        let mut e_16 = vk::PhysicalDevice16BitStorageFeatures::default()
            .storage_buffer16_bit_access(
                on(q_16.storage_buffer16_bit_access, "storageBuffer16BitAccess") != 0,
            )
            .uniform_and_storage_buffer16_bit_access(
                on(
                    q_16.uniform_and_storage_buffer16_bit_access,
                    "uniformAndStorageBuffer16BitAccess",
                ) != 0,
            );
        let coop = has_cm
            && q_cm.cooperative_matrix != vk::FALSE
            && q_12.vulkan_memory_model != vk::FALSE
            && q_12.vulkan_memory_model_device_scope != vk::FALSE;
        let mut e_12 = vk::PhysicalDeviceVulkan12Features::default()
            .shader_float16(on(q_12.shader_float16, "shaderFloat16") != 0)
            .shader_int8(on(q_12.shader_int8, "shaderInt8") != 0)
            .vulkan_memory_model(coop && on(vk::TRUE, "vulkanMemoryModel") != 0)
            .vulkan_memory_model_device_scope(coop);
        let mut e_cm = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default()
            .cooperative_matrix(coop && on(vk::TRUE, "cooperativeMatrix") != 0);
        let mut e_13 = vk::PhysicalDeviceVulkan13Features::default()
            .subgroup_size_control(on(q_13.subgroup_size_control, "subgroupSizeControl") != 0)
            .shader_integer_dot_product(
                on(q_13.shader_integer_dot_product, "shaderIntegerDotProduct") != 0,
            )
            .shader_zero_initialize_workgroup_memory(
                on(
                    q_13.shader_zero_initialize_workgroup_memory,
                    "shaderZeroInitializeWorkgroupMemory",
                ) != 0,
            );
        let mut e_rb2 = vk::PhysicalDeviceRobustness2FeaturesEXT::default().robust_buffer_access2(
            robust
                && core.robust_buffer_access != 0
                && on(q_rb2.robust_buffer_access2, "robustBufferAccess2") != 0,
        );
        let varying_subgroup = e_13.subgroup_size_control != 0;

        let family = unsafe { instance.get_physical_device_queue_family_properties(pd) }
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .ok_or_else(|| anyhow!("{name}: no compute queue"))? as u32;
        let prio = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&prio)];
        let mut ext_names: Vec<*const c_char> = Vec::new();
        if stats {
            ext_names.push(pep_name.as_ptr());
        }
        if has_rb2 {
            ext_names.push(rb2_name.as_ptr());
        }
        if coop {
            ext_names.push(cm_name.as_ptr());
        }
        let mut f2 = vk::PhysicalDeviceFeatures2::default()
            .features(e_core)
            .push_next(&mut e_16);
        if stats {
            f2 = f2.push_next(&mut e_pep);
        }
        if api >= vk::API_VERSION_1_2 {
            f2 = f2.push_next(&mut e_12);
        }
        if api >= vk::API_VERSION_1_3 {
            f2 = f2.push_next(&mut e_13);
        }
        if has_rb2 {
            f2 = f2.push_next(&mut e_rb2);
        }
        if coop {
            f2 = f2.push_next(&mut e_cm);
        }
        let dci = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&ext_names)
            .push_next(&mut f2);
        let device = unsafe { instance.create_device(pd, &dci, None) }
            .with_context(|| format!("vkCreateDevice on {name}"))?;
        let exec = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        // wgpu-hal's choice: the highest SPIR-V the device's API version guarantees.
        let spirv = match api {
            v if v >= vk::API_VERSION_1_3 => (1, 6),
            v if v >= vk::API_VERSION_1_2 => (1, 5),
            _ => (1, 3),
        };
        Ok(Vk {
            _entry: entry.clone(),
            instance,
            device,
            exec,
            stats,
            varying_subgroup,
            coop,
            spirv,
            name,
            driver,
            api: version(p.api_version),
            features,
        })
    }

    /// One compute pipeline from `words`, with its statistics and representations.
    fn compile(&self, words: &[u32], bindings: &[Binding], entry: &str) -> Result<Vec<Executable>> {
        let d = &self.device;
        let mut o = Objects {
            device: d,
            module: vk::ShaderModule::null(),
            sets: Vec::new(),
            layout: vk::PipelineLayout::null(),
            pipeline: vk::Pipeline::null(),
        };
        // SAFETY (this function's calls): creation and queries on the live device, with create
        // infos that outlive the calls; `o` destroys what was made on every path.
        o.module = unsafe {
            d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(words), None)
        }
        .context("vkCreateShaderModule")?;
        let mut groups: BTreeMap<u32, Vec<vk::DescriptorSetLayoutBinding>> = BTreeMap::new();
        for b in bindings {
            let ty = match b.kind {
                "uniform" => vk::DescriptorType::UNIFORM_BUFFER,
                "storage" => vk::DescriptorType::STORAGE_BUFFER,
                k => bail!(
                    "@group({}) @binding({}): a {k} resource (only buffers are handled)",
                    b.group,
                    b.binding
                ),
            };
            groups.entry(b.group).or_default().push(
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b.vk_binding)
                    .descriptor_type(ty)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE),
            );
        }
        let n_sets = groups.keys().next_back().map_or(0, |g| g + 1);
        for g in 0..n_sets {
            let bs = groups.get(&g).map(Vec::as_slice).unwrap_or(&[]);
            let l = unsafe {
                d.create_descriptor_set_layout(
                    &vk::DescriptorSetLayoutCreateInfo::default().bindings(bs),
                    None,
                )
            }
            .context("vkCreateDescriptorSetLayout")?;
            o.sets.push(l);
        }
        o.layout = unsafe {
            d.create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default().set_layouts(&o.sets),
                None,
            )
        }
        .context("vkCreatePipelineLayout")?;
        let cname = CString::new(entry)?;
        let mut sflags = vk::PipelineShaderStageCreateFlags::empty();
        if self.varying_subgroup {
            sflags |= vk::PipelineShaderStageCreateFlags::ALLOW_VARYING_SUBGROUP_SIZE;
        }
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .flags(sflags)
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(o.module)
            .name(&cname);
        let ci = vk::ComputePipelineCreateInfo::default()
            .flags(if self.stats {
                vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
                    | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR
            } else {
                vk::PipelineCreateFlags::empty()
            })
            .stage(stage)
            .layout(o.layout);
        o.pipeline =
            match unsafe { d.create_compute_pipelines(vk::PipelineCache::null(), &[ci], None) } {
                Ok(p) => p[0],
                Err((p, e)) => {
                    for x in p.into_iter().filter(|x| *x != vk::Pipeline::null()) {
                        unsafe { d.destroy_pipeline(x, None) };
                    }
                    bail!("vkCreateComputePipelines: {e}");
                }
            };

        if !self.stats {
            return Ok(Vec::new());
        }
        let pinfo = vk::PipelineInfoKHR::default().pipeline(o.pipeline);
        let exes = unsafe { self.exec.get_pipeline_executable_properties(&pinfo) }
            .context("vkGetPipelineExecutablePropertiesKHR")?;
        let mut out = Vec::new();
        for (i, x) in exes.iter().enumerate() {
            let xinfo = vk::PipelineExecutableInfoKHR::default()
                .pipeline(o.pipeline)
                .executable_index(i as u32);
            let stats = unsafe { self.exec.get_pipeline_executable_statistics(&xinfo) }
                .context("vkGetPipelineExecutableStatisticsKHR")?
                .iter()
                .map(|s| Stat {
                    name: fixed(&s.name),
                    description: fixed(&s.description),
                    value: stat_value(s),
                })
                .collect();
            out.push(Executable {
                name: fixed(&x.name),
                description: fixed(&x.description),
                subgroup_size: x.subgroup_size,
                stats,
                reprs: self.reprs(&xinfo)?,
            });
        }
        Ok(out)
    }

    /// The internal representations of one executable: their sizes first, then their data.
    fn reprs(&self, xinfo: &vk::PipelineExecutableInfoKHR) -> Result<Vec<Repr>> {
        // SAFETY: the first call fills `heads` with names and sizes (no data pointers); the
        // second writes at most `data_size` bytes into each buffer, which outlive the call.
        let mut heads = unsafe {
            self.exec
                .get_pipeline_executable_internal_representations(xinfo)
        }
        .context("vkGetPipelineExecutableInternalRepresentationsKHR (sizes)")?;
        let mut bufs: Vec<Vec<u8>> = heads.iter().map(|h| vec![0u8; h.data_size]).collect();
        for (h, b) in heads.iter_mut().zip(bufs.iter_mut()) {
            h.p_data = b.as_mut_ptr().cast();
        }
        let mut count = heads.len() as u32;
        let r = unsafe {
            (self
                .exec
                .fp()
                .get_pipeline_executable_internal_representations_khr)(
                self.exec.device(),
                xinfo,
                &mut count,
                heads.as_mut_ptr(),
            )
        };
        if r != vk::Result::SUCCESS && r != vk::Result::INCOMPLETE {
            bail!("vkGetPipelineExecutableInternalRepresentationsKHR: {r}");
        }
        Ok(heads
            .iter()
            .zip(bufs)
            .take(count as usize)
            .map(|(h, mut b)| {
                b.truncate(h.data_size);
                let is_text = h.is_text != vk::FALSE;
                if is_text {
                    if let Some(n) = b.iter().position(|&c| c == 0) {
                        b.truncate(n);
                    }
                }
                Repr {
                    name: fixed(&h.name),
                    description: fixed(&h.description),
                    is_text,
                    data: b,
                }
            })
            .collect())
    }
}

/// A statistic's value by its format.
fn stat_value(s: &vk::PipelineExecutableStatisticKHR) -> String {
    // SAFETY: the union is read as the member `format` names.
    unsafe {
        match s.format {
            vk::PipelineExecutableStatisticFormatKHR::BOOL32 => (s.value.b32 != 0).to_string(),
            vk::PipelineExecutableStatisticFormatKHR::INT64 => s.value.i64.to_string(),
            vk::PipelineExecutableStatisticFormatKHR::UINT64 => s.value.u64.to_string(),
            vk::PipelineExecutableStatisticFormatKHR::FLOAT64 => format!("{}", s.value.f64),
            f => format!("(format {f:?})"),
        }
    }
}

/// The objects of one pipeline, destroyed when dropped (null ones skipped).
struct Objects<'a> {
    device: &'a ash::Device,
    module: vk::ShaderModule,
    sets: Vec<vk::DescriptorSetLayout>,
    layout: vk::PipelineLayout,
    pipeline: vk::Pipeline,
}

impl Drop for Objects<'_> {
    fn drop(&mut self) {
        // SAFETY: made on this device, not in use (no command buffer was recorded).
        unsafe {
            if self.pipeline != vk::Pipeline::null() {
                self.device.destroy_pipeline(self.pipeline, None);
            }
            if self.layout != vk::PipelineLayout::null() {
                self.device.destroy_pipeline_layout(self.layout, None);
            }
            for &s in &self.sets {
                self.device.destroy_descriptor_set_layout(s, None);
            }
            if self.module != vk::ShaderModule::null() {
                self.device.destroy_shader_module(self.module, None);
            }
        }
    }
}

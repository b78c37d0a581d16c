//! The wgpu device under the backend: adapter choice, the shader and pipeline cache, buffers,
//! and the one command encoder every op records into.
//!
//! Ops record compute passes into a shared encoder; nothing reaches the GPU until something
//! needs a result (`to_host`, `step_token`, `sync`) or the encoder has grown long
//! (`FLUSH_EVERY` dispatches), when it is finished and submitted. The `Backend` trait's ops
//! return nothing, so an error inside one (a validation error wgpu reports, a shape past the
//! adapter's limits) is kept and returned by the next call that returns a `Result`, as the CUDA
//! backend does.
//!
//! Parameters reach a kernel as a small uniform block (`binding 0`, u32 words, f32 by bits);
//! storage buffers follow at bindings 1, 2, … in the order the op passes them. The blocks of one
//! submission live in one arena buffer, each at its own aligned offset, written by the queue
//! (its writes land before the submission's commands run, after the earlier submissions'):
//! no buffer is created per dispatch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ::wgpu::util::DeviceExt;
use anyhow::{anyhow, bail, Context, Result};

/// Dispatches recorded before the encoder is submitted on its own: long prefill blocks keep the
/// GPU busy while the host records the rest.
const FLUSH_EVERY: usize = 256;
/// Bytes of the parameter arena a dispatch may use (a QMat and a few words; attention passes its RoPE frequencies).
const PARAM_BYTES: u64 = 2048;

/// One WGSL file: its name (for errors and the MSL check) and its text.
#[derive(Clone, Copy)]
pub struct Shader {
    pub name: &'static str,
    pub src: &'static str,
}

/// Every WGSL file of the backend (the naga check translates each of them).
pub const SHADERS: &[Shader] = &[
    super::norm::SHADER,
    super::matmul::SHADER,
    super::attention::SHADER,
    super::gdn::SHADER,
    super::moe::SHADER,
    super::output::SHADER,
];

/// How the adapter was chosen and what it offers (printed by `lily` when it picks it).
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub subgroup: bool,
    pub f16: bool,
    pub subgroup_min: u32,
    pub subgroup_max: u32,
    pub workgroup_storage: u32,
    pub max_binding: u64,
    pub max_buffer: u64,
    pub storage_buffers: u32,
}

pub(super) struct Ctx {
    pub device: ::wgpu::Device,
    pub queue: ::wgpu::Queue,
    pub report: AdapterReport,
    pipelines: Mutex<HashMap<(&'static str, &'static str), Arc<::wgpu::ComputePipeline>>>,
    modules: Mutex<HashMap<&'static str, Arc<::wgpu::ShaderModule>>>,
    /// The encoder being recorded and its dispatches so far (also the next free arena slot).
    enc: Mutex<Option<(::wgpu::CommandEncoder, usize)>>,
    err: Arc<Mutex<Option<String>>>,
    /// FLUSH_EVERY parameter blocks, `stride` bytes apart (the adapter's uniform offset alignment).
    arena: ::wgpu::Buffer,
    stride: u64,
    /// Scratch buffers of the ops, by name, kept from call to call (`scratch`).
    scratch: Mutex<HashMap<&'static str, ::wgpu::Buffer>>,
}

/// Adapter types in the order `auto` prefers them; software adapters (lavapipe reports `Cpu`)
/// only when asked for: the CPU backend is faster than a CPU emulating a GPU.
fn rank(t: ::wgpu::DeviceType) -> u32 {
    match t {
        ::wgpu::DeviceType::DiscreteGpu => 0,
        ::wgpu::DeviceType::IntegratedGpu => 1,
        ::wgpu::DeviceType::VirtualGpu => 2,
        ::wgpu::DeviceType::Other => 3,
        ::wgpu::DeviceType::Cpu => 4,
    }
}

impl Ctx {
    /// The best adapter: `LILY_WGPU_ADAPTER` (a substring of its name) if set, else by type; a
    /// software adapter only with `allow_software`.
    pub fn new(allow_software: bool) -> Result<Self> {
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            // The Vulkan loader warns on every start without it; any writable folder will do.
            std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
        }
        let mut d = ::wgpu::InstanceDescriptor::new_without_display_handle();
        d.backends = ::wgpu::Backends::VULKAN | ::wgpu::Backends::METAL;
        let inst = ::wgpu::Instance::new(d);
        let adapters = pollster::block_on(inst.enumerate_adapters(d_backends()));
        let want = std::env::var("LILY_WGPU_ADAPTER").ok();
        let mut cands: Vec<_> = adapters
            .into_iter()
            .filter(|a| {
                let i = a.get_info();
                match &want {
                    Some(w) => i.name.to_lowercase().contains(&w.to_lowercase()),
                    None => allow_software || i.device_type != ::wgpu::DeviceType::Cpu,
                }
            })
            .collect();
        cands.sort_by_key(|a| rank(a.get_info().device_type));
        let Some(adapter) = cands.into_iter().next() else {
            bail!(
                "no {}GPU adapter found through Vulkan or Metal{}",
                if allow_software { "" } else { "hardware " },
                match &want {
                    Some(w) => format!(" named like LILY_WGPU_ADAPTER={w:?}"),
                    None => String::new(),
                }
            );
        };
        let info = adapter.get_info();
        let feats = adapter.features();
        let wanted = ::wgpu::Features::SUBGROUP | ::wgpu::Features::SHADER_F16;
        let limits = adapter.limits();
        let (device, queue) =
            pollster::block_on(adapter.request_device(&::wgpu::DeviceDescriptor {
                label: Some("lily"),
                required_features: feats & wanted,
                required_limits: limits.clone(),
                ..Default::default()
            }))
            .with_context(|| format!("opening the wgpu device {}", info.name))?;
        let err = Arc::new(Mutex::new(None::<String>));
        let e2 = err.clone();
        device.on_uncaptured_error(Arc::new(move |e: ::wgpu::Error| {
            let mut g = e2.lock().unwrap();
            if g.is_none() {
                *g = Some(format!("wgpu: {e}"));
            }
        }));
        let report = AdapterReport {
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
            subgroup: feats.contains(::wgpu::Features::SUBGROUP),
            f16: feats.contains(::wgpu::Features::SHADER_F16),
            subgroup_min: info.subgroup_min_size,
            subgroup_max: info.subgroup_max_size,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_binding: limits.max_storage_buffer_binding_size as u64,
            max_buffer: limits.max_buffer_size,
            storage_buffers: limits.max_storage_buffers_per_shader_stage,
        };
        let stride = PARAM_BYTES.max(limits.min_uniform_buffer_offset_alignment as u64);
        let arena = device.create_buffer(&::wgpu::BufferDescriptor {
            label: Some("params"),
            size: stride * FLUSH_EVERY as u64,
            usage: ::wgpu::BufferUsages::UNIFORM | ::wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Self {
            device,
            queue,
            report,
            pipelines: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            enc: Mutex::new(None),
            err,
            arena,
            stride,
            scratch: Mutex::new(HashMap::new()),
        })
    }

    /// Keeps the first error (later ones are usually its consequences).
    pub fn fail(&self, msg: impl Into<String>) {
        let mut g = self.err.lock().unwrap();
        if g.is_none() {
            *g = Some(msg.into());
        }
    }

    /// The first error since the last check, as an `Err` (and cleared).
    pub fn check(&self) -> Result<()> {
        match self.err.lock().unwrap().take() {
            Some(e) => Err(anyhow!(e)),
            None => Ok(()),
        }
    }

    fn pipeline(&self, sh: &Shader, entry: &'static str) -> Arc<::wgpu::ComputePipeline> {
        let key = (sh.name, entry);
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return p.clone();
        }
        let module = {
            let mut m = self.modules.lock().unwrap();
            m.entry(sh.name)
                .or_insert_with(|| {
                    Arc::new(
                        self.device
                            .create_shader_module(::wgpu::ShaderModuleDescriptor {
                                label: Some(sh.name),
                                source: ::wgpu::ShaderSource::Wgsl(sh.src.into()),
                            }),
                    )
                })
                .clone()
        };
        let p = Arc::new(
            self.device
                .create_compute_pipeline(&::wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                }),
        );
        self.pipelines.lock().unwrap().insert(key, p.clone());
        p
    }

    /// Records one dispatch of `entry` in `sh`: `params` as the uniform block at binding 0,
    /// `bufs` at bindings 1.., `groups` workgroups (x may exceed the 65,535 a dimension allows:
    /// it is folded into y, and the kernel reads its flat index from `wg_index`).
    pub fn dispatch(
        &self,
        sh: &Shader,
        entry: &'static str,
        params: &[u32],
        bufs: &[&::wgpu::Buffer],
        groups: u32,
    ) {
        if groups == 0 {
            return;
        }
        let pipe = self.pipeline(sh, entry);
        let mut words = params.to_vec();
        words.resize(words.len().div_ceil(4).max(1) * 4, 0);
        if 4 * words.len() as u64 > PARAM_BYTES {
            self.fail(format!(
                "{entry}: {} bytes of parameters, at most {PARAM_BYTES}",
                4 * words.len()
            ));
            return;
        }
        let (gx, gy) = if groups <= 65535 {
            (groups, 1)
        } else {
            (65535, groups.div_ceil(65535))
        };
        let mut g = self.enc.lock().unwrap();
        let (enc, n) =
            g.get_or_insert_with(|| (self.device.create_command_encoder(&Default::default()), 0));
        let off = *n as u64 * self.stride;
        self.queue.write_buffer(&self.arena, off, as_bytes(&words));
        let mut entries = vec![::wgpu::BindGroupEntry {
            binding: 0,
            resource: ::wgpu::BindingResource::Buffer(::wgpu::BufferBinding {
                buffer: &self.arena,
                offset: off,
                size: ::wgpu::BufferSize::new(4 * words.len() as u64),
            }),
        }];
        for (i, b) in bufs.iter().enumerate() {
            entries.push(::wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        let bg = self.device.create_bind_group(&::wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        });
        {
            let mut cp = enc.begin_compute_pass(&Default::default());
            cp.set_pipeline(&pipe);
            cp.set_bind_group(0, &bg, &[]);
            cp.dispatch_workgroups(gx, gy, 1);
        }
        *n += 1;
        if *n >= FLUSH_EVERY {
            let (enc, _) = g.take().unwrap();
            self.queue.submit([enc.finish()]);
        }
    }

    /// Records a buffer-to-buffer copy (byte offsets and size multiples of 4).
    pub fn copy(&self, src: &::wgpu::Buffer, so: u64, dst: &::wgpu::Buffer, dof: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut g = self.enc.lock().unwrap();
        let (enc, n) =
            g.get_or_insert_with(|| (self.device.create_command_encoder(&Default::default()), 0));
        let _ = n; // copies take no parameter slot
        enc.copy_buffer_to_buffer(src, so, dst, dof, bytes);
    }

    /// Submits whatever is recorded.
    pub fn flush(&self) {
        if let Some((enc, _)) = self.enc.lock().unwrap().take() {
            self.queue.submit([enc.finish()]);
        }
    }

    /// Submits and waits for the GPU to finish; the first error since the last check.
    pub fn sync(&self) -> Result<()> {
        self.flush();
        self.device
            .poll(::wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
        self.check()
    }

    /// A storage buffer of `bytes` (at least 4), zero-filled (wgpu zero-initialises).
    pub fn buffer(&self, bytes: u64) -> Result<::wgpu::Buffer> {
        let bytes = bytes.max(4).next_multiple_of(4);
        self.fits(bytes)?;
        Ok(self.device.create_buffer(&::wgpu::BufferDescriptor {
            label: None,
            size: bytes,
            usage: storage_usage(),
            mapped_at_creation: false,
        }))
    }

    /// The op's scratch buffer `name` of at least `bytes`, kept for the next call (grown to a
    /// power of two when too small): an op's intermediates (the arg-max partials, the experts'
    /// activations, the decode attention's splits) are not allocated again every token. Every
    /// use is a dispatch recorded in order on the one queue, so a later call's writes come after
    /// an earlier call's reads.
    pub fn scratch(&self, name: &'static str, bytes: u64) -> Result<::wgpu::Buffer> {
        let mut m = self.scratch.lock().unwrap();
        if let Some(b) = m.get(name) {
            if b.size() >= bytes {
                return Ok(b.clone());
            }
        }
        let b = self.buffer(
            bytes
                .max(4)
                .next_power_of_two()
                .min(self.report.max_binding),
        )?;
        m.insert(name, b.clone());
        Ok(b)
    }

    /// A storage buffer holding `data` (padded to 4 bytes).
    pub fn upload(&self, data: &[u8]) -> Result<::wgpu::Buffer> {
        let mut owned;
        let data = if data.len() % 4 != 0 || data.is_empty() {
            owned = data.to_vec();
            owned.resize(data.len().max(4).next_multiple_of(4), 0);
            &owned[..]
        } else {
            data
        };
        self.fits(data.len() as u64)?;
        Ok(self
            .device
            .create_buffer_init(&::wgpu::util::BufferInitDescriptor {
                label: None,
                contents: data,
                usage: storage_usage(),
            }))
    }

    fn fits(&self, bytes: u64) -> Result<()> {
        if bytes > self.report.max_binding {
            bail!(
                "a buffer of {bytes} bytes exceeds this adapter's largest storage binding ({} bytes, {})",
                self.report.max_binding,
                self.report.name
            );
        }
        Ok(())
    }

    /// `bytes` bytes of `b` from offset 0, after everything recorded so far.
    pub fn read(&self, b: &::wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        let bytes = bytes.next_multiple_of(4);
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let st = self.device.create_buffer(&::wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage: ::wgpu::BufferUsages::MAP_READ | ::wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.copy(b, 0, &st, 0, bytes);
        self.flush();
        let slot = Arc::new(Mutex::new(None));
        let s2 = slot.clone();
        st.slice(..).map_async(::wgpu::MapMode::Read, move |r| {
            *s2.lock().unwrap() = Some(r);
        });
        self.device
            .poll(::wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
        self.check()?;
        match slot.lock().unwrap().take() {
            Some(Ok(())) => {}
            Some(Err(e)) => bail!("wgpu: mapping a read-back buffer: {e}"),
            None => bail!("wgpu: a read-back buffer was not mapped after the wait"),
        }
        let out = st
            .slice(..)
            .get_mapped_range()
            .map_err(|e| anyhow!("wgpu: reading a mapped buffer: {e:?}"))?
            .to_vec();
        st.unmap();
        Ok(out)
    }
}

fn d_backends() -> ::wgpu::Backends {
    ::wgpu::Backends::VULKAN | ::wgpu::Backends::METAL
}

fn storage_usage() -> ::wgpu::BufferUsages {
    ::wgpu::BufferUsages::STORAGE | ::wgpu::BufferUsages::COPY_SRC | ::wgpu::BufferUsages::COPY_DST
}

pub fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (u32, f32) viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

//! The CUDA backend's plumbing, under every op: graph capture, the first-error state (`fail`,
//! `ensure`), device memory (allocation refused while recording, uploads, the named scratch
//! buffers), kernel launches (`launch`, `launch_ex`: PDL inside recorded steps, clusters, the
//! timing probe's skips), stream copies and reads back (pinned staging for large reads), the
//! weight formats' upload plan, and the operand checks every op makes (`buf_ok`, `act_ok`,
//! `out_ok`, `kv_ok`). mod.rs holds the types, the constructor and the `Backend` impl.

use super::*;

impl Cuda {
    /// Captures `ops` into a graph (nothing runs yet). On any failure the capture is ended and
    /// the error returned; the caller then runs the ops directly.
    pub(super) fn capture(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<CudaGraph> {
        self.ctx.bind_to_thread()?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.trace_capture_begin();
        self.capturing.store(true, Ordering::Relaxed);
        let r = ops();
        self.capturing.store(false, Ordering::Relaxed);
        let g = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        r?;
        if self.failed() {
            bail!("an op failed while its step was recorded");
        }
        g?.ok_or_else(|| anyhow!("the recorded step is empty"))
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    pub(super) fn fail(&self, msg: impl Into<String>) {
        let mut e = self.err.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(msg.into());
        }
    }

    pub(super) fn failed(&self) -> bool {
        self.err.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// `Ok` when `cond`, else records `msg` (the op is then skipped).
    pub(super) fn ensure(&self, cond: bool, msg: impl FnOnce() -> String) -> bool {
        if !cond {
            self.fail(msg());
        }
        cond && !self.failed()
    }

    pub(super) fn alloc(&self, bytes: usize) -> Result<Mem> {
        if self.capturing.load(Ordering::Relaxed) {
            // A record would keep using this memory after a later free; steps are warmed up first.
            bail!("CUDA backend: allocating {bytes} bytes while recording a decode step");
        }
        self.ctx.bind_to_thread()?;
        let s = self
            .stream
            .alloc_zeros::<u8>(bytes.max(16))
            .with_context(|| format!("CUDA backend: allocating {bytes} bytes"))?;
        let ptr = {
            let (ptr, _sync) = s.device_ptr(&self.stream);
            ptr
        };
        Ok(Mem {
            _slice: s,
            ptr,
            bytes,
        })
    }

    pub(super) fn upload_bytes(&self, b: &[u8]) -> Result<Mem> {
        let m = self.alloc(b.len())?;
        if !b.is_empty() {
            // SAFETY: `m` holds at least b.len() bytes; a copy from pageable memory is staged before
            // the call returns, so `b` may go away afterwards.
            unsafe { dr::memcpy_htod_async(m.ptr, b, self.stream.cu_stream()) }
                .context("CUDA backend: upload")?;
        }
        Ok(m)
    }

    /// An activation buffer holding `v` rounded to bf16 (nearest even, as the kernels round):
    /// the input of an op test, or of a model fed from the host.
    pub fn upload_act(&self, v: &[f32]) -> Result<Buf> {
        let bits: Vec<u16> = v.iter().map(|&x| f32_to_bf16(x)).collect();
        // SAFETY: u16 slice viewed as bytes.
        let b = unsafe { std::slice::from_raw_parts(bits.as_ptr() as *const u8, 2 * bits.len()) };
        Ok(Buf {
            mem: self.upload_bytes(b)?,
            len: v.len(),
            elem: 2,
        })
    }

    pub(super) fn upload_f32(&self, v: &[f32]) -> Result<Mem> {
        // SAFETY: f32 slice viewed as bytes.
        let b = unsafe {
            std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
        };
        self.upload_bytes(b)
    }

    /// A scratch buffer of at least `bytes` (kept between calls; grown when needed). Stream
    /// ordering makes reuse safe: work that read the old contents was enqueued before.
    pub(super) fn scratch(
        &self,
        sc: &mut HashMap<&'static str, Mem>,
        name: &'static str,
        bytes: usize,
    ) -> Option<u64> {
        if let Some(m) = sc.get(name) {
            if m.bytes >= bytes {
                return Some(m.ptr);
            }
        }
        match self.alloc(bytes.next_power_of_two()) {
            Ok(m) => {
                let p = m.ptr;
                sc.insert(name, m);
                self.scratch_gen.fetch_add(1, Ordering::Relaxed);
                Some(p)
            }
            Err(e) => {
                self.fail(format!("{e:#}"));
                None
            }
        }
    }

    /// The kernels this backend has loaded, i.e. launched (or recorded) at least once: lets a
    /// test tell that a variant it switched on ran, rather than a fallback with the same bits.
    pub fn loaded_kernels(&self) -> Vec<String> {
        let fs = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        fs.keys().cloned().collect()
    }

    pub(super) fn func(&self, name: &str) -> Option<CudaFunction> {
        let mut fs = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = fs.get(name) {
            return Some(f.clone());
        }
        for m in &self.modules {
            if let Ok(f) = m.load_function(name) {
                if name.contains("tc_")
                    || name.starts_with("sw_")
                    || name.starts_with("moe_sw_")
                    || self.opted_in("carveout_all")
                {
                    // Tensor-core and streaming kernels hold 36–101 KiB of shared memory per block:
                    // ask for the largest shared-memory carveout, so that the split of L1 never
                    // limits the blocks per SM (two of attn_tc_256 need 203 KiB, two staged GEMVs
                    // 177 KiB). The GEMMs measured the same with and without it. `carveout_all`
                    // (opt-in, switches.rs) asks it for every kernel: so that no SM has to drain
                    // and re-split its L1 between two kernels of a decode step.
                    let _ = f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100);
                }
                fs.insert(name.to_string(), f.clone());
                return Some(f);
            }
        }
        self.fail(format!("no kernel named `{name}`"));
        None
    }

    pub(super) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) {
        self.launch_ex(name, grid, block, smem, 0, args)
    }

    /// `launch`, the blocks grouped in thread-block clusters of `cluster` along x (0: none; more
    /// than 8, the non-portable sizes Hopper allows, is allowed on the function first).
    pub(super) fn launch_ex(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        cluster: u32,
        args: &[Arg],
    ) {
        if self.failed() {
            return;
        }
        if self.capturing.load(Ordering::Relaxed) && self.skipped(name) {
            return;
        }
        let Some(f) = self.func(name) else { return };
        if cluster > 8 {
            if let Err(e) = f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1) {
                self.fail(format!("{name}: clusters of {cluster} blocks not allowed: {e}"));
                return;
            }
        }
        if smem > 32 * 1024 {
            // Above 48 KiB of shared memory, static and dynamic together, a kernel must opt in
            // (the streaming kernels hold up to 17 KiB of static reductions besides).
            if let Err(e) = f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32) {
                self.fail(format!("{name}: cannot allow {smem} bytes of shared memory: {e}"));
                return;
            }
        }
        let mut ptrs: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::P(v) => v as *const u64 as *mut c_void,
                Arg::I(v) => v as *const i32 as *mut c_void,
                Arg::F(v) => v as *const f32 as *mut c_void,
                Arg::D(v) => v as *const f64 as *mut c_void,
                Arg::Q(v) => v as *const QMat as *mut c_void,
                Arg::M(v) => &**v as *const Many as *mut c_void,
                Arg::S(v) => &**v as *const decode::SwArgs as *mut c_void,
                Arg::E(v) => &**v as *const decode::SwMoe as *mut c_void,
                Arg::T(v) => &**v as *const decode::SwStep as *mut c_void,
                Arg::R(v) => &**v as *const decode::RaArgs as *mut c_void,
                Arg::A(v) => &**v as *const attention::DecQk as *mut c_void,
            })
            .collect();
        let r = self.ctx.bind_to_thread().and_then(|_| {
            let pdl = self.pdl
                || (self.pdl_ok && self.capturing.load(Ordering::Relaxed) && self.on("pdl_step"));
            if !pdl && cluster == 0 {
                // SAFETY: the argument list matches the kernel's signature (each call site mirrors
                // its .cu declaration); buffers were bounds-checked by the op; `args` outlives the call.
                return unsafe {
                    dr::launch_kernel(
                        f.cu_function(),
                        grid,
                        (block, 1, 1),
                        smem,
                        self.stream.cu_stream(),
                        &mut ptrs,
                    )
                };
            }
            // SAFETY: a zeroed attribute value is valid for this union; only the field of
            // `id` is read by the driver.
            let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
            let mut n = 0;
            if pdl {
                // Programmatic dependent launch (common.cuh, PDL_ENTRY): the kernel may be launched
                // while the previous one runs; it waits for it on the device.
                attrs[n].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if cluster > 0 {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                attrs[n].value.clusterDim.x = cluster;
                attrs[n].value.clusterDim.y = 1;
                attrs[n].value.clusterDim.z = 1;
                n += 1;
            }
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: self.stream.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            // SAFETY: as for launch_kernel above; `cfg` and `attrs` outlive the call.
            unsafe {
                sys::cuLaunchKernelEx(
                    &cfg,
                    f.cu_function(),
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        });
        match r {
            Ok(()) => self.trace_launch(name, grid),
            Err(e) => self.fail(format!(
                "launching {name} (grid {grid:?}, block {block}): {e}"
            )),
        }
    }

    pub(super) fn dtod(&self, src: u64, dst: u64, bytes: usize) {
        if self.failed() || bytes == 0 {
            return;
        }
        // SAFETY: the caller checked both ranges.
        let r = self.ctx.bind_to_thread().and_then(|_| unsafe {
            dr::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        });
        if let Err(e) = r {
            self.fail(format!("device copy: {e}"));
        }
    }

    pub(super) fn memset0(&self, dst: u64, bytes: usize) {
        if self.failed() || bytes == 0 {
            return;
        }
        // SAFETY: the caller owns `bytes` bytes at `dst`.
        let r = self
            .ctx
            .bind_to_thread()
            .and_then(|_| unsafe { dr::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) });
        if let Err(e) = r {
            self.fail(format!("device memset: {e}"));
        }
    }

    /// Copies `n` elements (u32 or u16 bits) from the device after the enqueued work; waits.
    /// Large reads (a step's logits for the host sampler: 1 MB per token) go through a
    /// page-locked staging buffer: a copy into pageable memory measured 0.42 ms for them on the
    /// H200.
    pub(super) fn read<T: cudarc::driver::DeviceRepr + Default + Copy>(
        &self,
        src: u64,
        n: usize,
    ) -> Result<Vec<T>> {
        // One wait per read (a decode step's token is read every step): the copy is queued behind
        // the work it reads, then `check` synchronizes and reports the first error of any op.
        if self.failed() {
            self.check()?;
        }
        self.ctx.bind_to_thread()?;
        let mut v = vec![T::default(); n];
        let bytes = std::mem::size_of_val(&v[..]);
        if bytes < PINNED_MIN {
            // SAFETY: `src` holds n elements (checked by the caller); `check` waits for the copy.
            unsafe { dr::memcpy_dtoh_async(&mut v[..], src, self.stream.cu_stream()) }?;
            self.check()?;
            return Ok(v);
        }
        let mut pin = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        if pin.as_ref().is_none_or(|p| p.len() < bytes) {
            // SAFETY: the contents are written by the copy below before they are read. Flags 0:
            // cached page-locked memory (write-combined memory is slow for the CPU to read).
            *pin = Some(
                unsafe {
                    self.ctx
                        .alloc_pinned_with_flags::<u8>(bytes.next_power_of_two(), 0)
                }
                .context("CUDA backend: page-locked staging buffer")?,
            );
        }
        let dst = pin.as_mut().expect("just made").as_mut_slice()?;
        // SAFETY: `src` holds `bytes` bytes and `dst` at least as many; `check` waits for the copy.
        unsafe { dr::memcpy_dtoh_async(&mut dst[..bytes], src, self.stream.cu_stream()) }?;
        self.check()?;
        // SAFETY: `v` holds `bytes` bytes of plain numbers (DeviceRepr), which any bits are.
        unsafe { std::ptr::copy_nonoverlapping(dst.as_ptr(), v.as_mut_ptr() as *mut u8, bytes) };
        Ok(v)
    }

    /// Begins reading the u32 at `src` after the enqueued work: an asynchronous copy into a
    /// slot's page-locked word, then the slot's event, so that `token_finish` waits for the copy
    /// and not for the work enqueued after it (the next decode step).
    pub(super) fn token_begin(&self, src: u64) -> Result<TokenSlot> {
        if self.failed() {
            self.check()?;
        }
        if self.capturing.load(Ordering::Relaxed) {
            bail!("CUDA backend: a read-back inside a recorded decode step");
        }
        self.ctx.bind_to_thread()?;
        let free = self
            .token_slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let mut slot = match free {
            Some(s) => s,
            None => TokenSlot {
                // SAFETY: the word is written by the copy below before it is read. Flags 0:
                // cached page-locked memory, as `read`'s staging.
                word: unsafe { self.ctx.alloc_pinned_with_flags::<u32>(1, 0) }
                    .context("CUDA backend: page-locked token read")?,
                done: self.ctx.new_event(None)?,
            },
        };
        // `as_mut_slice` waits for the slice's own event, never recorded: at once.
        let dst = slot.word.as_mut_slice()?;
        // SAFETY: `src` holds a u32 (a Step's token); the slot's word lives until `done` has
        // passed (`token_finish`, or TokenSlot's drop).
        unsafe { dr::memcpy_dtoh_async(&mut dst[..1], src, self.stream.cu_stream()) }?;
        slot.done.record(&self.stream)?;
        Ok(slot)
    }

    /// The u32 of a read begun by `token_begin`: waits for its event only, reports the first
    /// error of any op, and keeps the slot for the next read.
    pub(super) fn token_finish(&self, slot: TokenSlot) -> Result<u32> {
        if let Err(e) = slot.done.synchronize() {
            self.fail(format!("device error: {e}"));
        }
        if self.failed() {
            self.check()?;
        }
        let t = slot.word.as_slice()?[0];
        let mut free = self.token_slots.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < TOKEN_READS {
            free.push(slot);
        }
        Ok(t)
    }

    /// The route's ids and weights (tests, debugging).
    pub fn route_to_host(&self, r: &Route, rows: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        if rows * r.k > r.cap {
            bail!(
                "route_to_host: {rows} rows of {} asked of a route of {} entries",
                r.k,
                r.cap
            );
        }
        let ids = self.read::<u32>(r.ids.ptr, rows * r.k)?;
        let w = self.read::<u32>(r.weights.ptr, rows * r.k)?;
        Ok((ids, w.into_iter().map(f32::from_bits).collect()))
    }

    pub(super) fn mat_fmt(&self, m: &HostLinear) -> Result<MatParts> {
        match &m.kind {
            LinearKind::Quant {
                bits,
                group_size,
                w,
                scales,
                biases,
            } => {
                let (bits, gs) = (*bits, *group_size);
                if !(bits == 4 || bits == 8) {
                    bail!("`{}`: {bits}-bit weights are not supported by the CUDA backend (4 and 8 are)", m.name);
                }
                if gs == 0 || gs % 32 != 0 || !m.inp.is_multiple_of(gs) {
                    bail!("`{}`: group size {gs} is not supported by the CUDA backend (a multiple of 32 dividing {})", m.name, m.inp);
                }
                let wb = w.bytes();
                if wb.len() != m.n * m.out * m.inp * bits as usize / 8 {
                    bail!(
                        "`{}`: {} bytes of codes, {} expected",
                        m.name,
                        wb.len(),
                        m.n * m.out * m.inp * bits as usize / 8
                    );
                }
                let ng = m.n * m.out * m.inp / gs;
                let bf16 = scales.dtype == Dtype::BF16 && biases.dtype == Dtype::BF16;
                let up = |t: &HostTensor| -> Result<Mem> {
                    if t.numel() != ng {
                        bail!("`{}`: {} scales/biases, {ng} expected", t.name, t.numel());
                    }
                    if bf16 {
                        self.upload_bytes(t.bytes())
                    } else {
                        self.upload_f32(&t.to_f32_vec()?)
                    }
                };
                let (s, b) = (up(scales)?, up(biases)?);
                let fmt = match (bits, bf16) {
                    (4, true) => Fmt::Q4Bf16,
                    (8, true) => Fmt::Q8Bf16,
                    (4, false) => Fmt::Q4F32,
                    _ => Fmt::Q8F32,
                };
                Ok((fmt, self.upload_bytes(wb)?, Some(s), Some(b), gs))
            }
            LinearKind::Dense(t) => {
                let v = t.to_f32_vec()?;
                if v.len() != m.n * m.out * m.inp {
                    bail!(
                        "`{}`: {} values, {} expected",
                        m.name,
                        v.len(),
                        m.n * m.out * m.inp
                    );
                }
                Ok((Fmt::Dense, self.upload_f32(&v)?, None, None, 1))
            }
        }
    }

    /// An f32 operand (`zeros`, `upload_vec`) of at least `need` elements.
    pub(super) fn buf_ok(&self, b: &Buf, need: usize, what: &str, op: &str) -> bool {
        self.ensure(b.elem == 4, || {
            format!("{op}: `{what}` is a bf16 buffer, f32 needed")
        }) && self.out_ok(b, need, what, op)
    }

    /// An activation operand (bf16: `act_zeros`, `upload_act`) of at least `need` elements.
    pub(super) fn act_ok(&self, b: &Buf, need: usize, what: &str, op: &str) -> bool {
        self.ensure(b.elem == 2, || {
            format!("{op}: `{what}` is an f32 buffer, a bf16 activation needed (act_zeros)")
        }) && self.out_ok(b, need, what, op)
    }

    /// At least `need` elements of either type: a GEMM output (an activation, or f32 for the
    /// logits and router logits: the kernel writes the buffer's type).
    pub(super) fn out_ok(&self, b: &Buf, need: usize, what: &str, op: &str) -> bool {
        self.ensure(b.len >= need, || {
            format!("{op}: `{what}` holds {} values, {need} needed", b.len)
        })
    }

    /// The attention ops' check of a layer's cache: bf16 (from `kv_zeros`), `capacity` rows of `kvd`.
    pub(super) fn kv_ok(&self, kv: &KvCache<Buf>, kvd: usize, op: &str) -> bool {
        self.ensure(kv.k.elem == 2 && kv.v.elem == 2, || {
            format!("{op}: the KV cache is not bf16 (allocate it with kv_zeros)")
        }) && self.ensure(
            kv.k.len >= kv.capacity * kvd && kv.v.len >= kv.capacity * kvd,
            || {
                format!(
                    "{op}: KV cache of {} values for capacity {}",
                    kv.k.len.min(kv.v.len),
                    kv.capacity
                )
            },
        )
    }
}

/// A token read's page-locked word and the event recorded after the copy into it.
pub(super) struct TokenSlot {
    word: cudarc::driver::PinnedHostSlice<u32>,
    done: cudarc::driver::CudaEvent,
}

impl Drop for TokenSlot {
    /// A read dropped unfinished (an error between begin and finish) still has its copy in
    /// flight: the word is freed only after it.
    fn drop(&mut self) {
        let _ = self.done.synchronize();
    }
}

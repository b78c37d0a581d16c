//! The device half of the in-place trace (backend/trace.rs says what it measures and how the
//! records are attributed; kernels/common.cuh, `KTRACE`, how the kernels write them).
//!
//! With `LILY_CUDA_TRACE=1` when the backend is created (`lily bench --trace` sets it), every
//! kernel file is compiled with LILY_TRACE defined and a record buffer is allocated; without it
//! the kernels are the measured ones and none of this exists. Between [`Cuda::trace_begin`] and
//! [`Cuda::trace_end`] every block of every kernel appends a record, and the host logs each
//! launch in the order it runs: launched directly, or replayed in a recorded step (a record keeps
//! the launches it captured).

use super::*;
use crate::backend::trace::{BlockRec, Launch, Traced};

/// Records the buffer holds (48 bytes each: 48 MiB, about 20 decode steps of the full model).
const TRACE_CAP: usize = 1 << 20;

pub(super) struct Tracer {
    /// A u32 cursor padded to 32 bytes, then TRACE_CAP records.
    buf: Mem,
    /// Between trace_begin and trace_end.
    on: AtomicBool,
    /// The launches run while on, in order.
    log: Mutex<Vec<Launch>>,
    /// The launches of the step being captured.
    capture: Mutex<Vec<Launch>>,
}

/// The source every kernel file is compiled from when tracing (LILY_TRACE first).
pub(super) fn traced_source(src: String) -> String {
    format!("#define LILY_TRACE 1\n{src}")
}

impl Cuda {
    /// Makes the tracer (called by the constructor when `LILY_CUDA_TRACE=1`): the buffer, and
    /// every module's capacity set (its `lily_trace_buf` stays 0, off, until trace_begin).
    pub(super) fn make_tracer(&self) -> Result<Tracer> {
        let buf = self.alloc(32 + TRACE_CAP * std::mem::size_of::<BlockRec>())?;
        self.set_trace_globals(0)?;
        Ok(Tracer {
            buf,
            on: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
            capture: Mutex::new(Vec::new()),
        })
    }

    /// Writes `lily_trace_buf` (and the capacity) of every module; waits.
    fn set_trace_globals(&self, buf: u64) -> Result<()> {
        self.ctx.bind_to_thread()?;
        for m in &self.modules {
            for (name, val) in [
                ("lily_trace_buf", buf),
                ("lily_trace_cap", TRACE_CAP as u64),
            ] {
                let g = m.get_global(name, &self.stream).with_context(|| {
                    format!("trace: the kernels have no `{name}` (not built with LILY_TRACE)")
                })?;
                let (ptr, _sync) = g.device_ptr(&self.stream);
                let bytes = if name == "lily_trace_cap" { 4 } else { 8 };
                let v = val.to_le_bytes();
                // SAFETY: `ptr` is the module global's address, `bytes` its size (u64 or u32).
                unsafe { dr::memcpy_htod_async(ptr, &v[..bytes], self.stream.cu_stream()) }?;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Whether this backend was created with the trace (`LILY_CUDA_TRACE=1`).
    pub fn trace_available(&self) -> bool {
        self.tracer.is_some()
    }

    /// Starts tracing: the buffer emptied, every kernel's blocks recording, the launch log cleared.
    pub fn trace_begin(&self) -> Result<()> {
        let Some(t) = &self.tracer else {
            bail!("trace: the backend was created without LILY_CUDA_TRACE=1");
        };
        self.check()?;
        self.memset0(t.buf.ptr, 32);
        t.log.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.set_trace_globals(t.buf.ptr)?;
        t.on.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Stops tracing (after the queued work): the records and the launches they belong to.
    pub fn trace_end(&self) -> Result<Traced> {
        let Some(t) = &self.tracer else {
            bail!("trace: the backend was created without LILY_CUDA_TRACE=1");
        };
        self.check()?;
        t.on.store(false, Ordering::Relaxed);
        self.set_trace_globals(0)?;
        let n = self.read::<u32>(t.buf.ptr, 1)?[0] as usize;
        if n > TRACE_CAP {
            bail!("trace: {n} block records, the buffer holds {TRACE_CAP}: trace fewer steps");
        }
        let words = self.read::<u64>(t.buf.ptr + 32, n * 6)?;
        let recs = words
            .chunks_exact(6)
            .map(|w| BlockRec {
                start: w[0],
                wait: w[1],
                mark1: w[2],
                mark2: w[3],
                end: w[4],
                blocks: w[5] as u32,
                smid: (w[5] >> 32) as u32,
            })
            .collect();
        let log = std::mem::take(&mut *t.log.lock().unwrap_or_else(|e| e.into_inner()));
        Ok((recs, log))
    }

    /// A launch succeeded: logged (into the capture, or the trace log when running directly).
    pub(super) fn trace_launch(&self, name: &str, grid: (u32, u32, u32)) {
        let Some(t) = &self.tracer else { return };
        let l = Launch {
            name: name.to_string(),
            blocks: grid.0 * grid.1 * grid.2,
        };
        if self.capturing.load(Ordering::Relaxed) {
            t.capture.lock().unwrap_or_else(|e| e.into_inner()).push(l);
        } else if t.on.load(Ordering::Relaxed) {
            t.log.lock().unwrap_or_else(|e| e.into_inner()).push(l);
        }
    }

    /// A capture begins: its launch list starts empty.
    pub(super) fn trace_capture_begin(&self) {
        if let Some(t) = &self.tracer {
            t.capture.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// The launches of the step just captured (kept with its graph).
    pub(super) fn trace_captured(&self) -> Vec<Launch> {
        match &self.tracer {
            Some(t) => std::mem::take(&mut *t.capture.lock().unwrap_or_else(|e| e.into_inner())),
            None => Vec::new(),
        }
    }

    /// A recorded step was launched: its launches ran, in its order.
    pub(super) fn trace_replayed(&self, launches: &[Launch]) {
        if let Some(t) = self
            .tracer
            .as_ref()
            .filter(|t| t.on.load(Ordering::Relaxed))
        {
            t.log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(launches);
        }
    }
}

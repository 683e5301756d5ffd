//! A staged job as it runs, on the thread that runs the job. The life of its copies:
//!
//! - [`StagedJob::start`], before anything else: the pinned memory, the whole buffers and the
//!   window (here rather than on the caller's thread, so that issuing an async op allocates
//!   nothing).
//! - [`StagedJob::inputs_ready`], before chunk k of an op runs. The first call makes the
//!   to-host stream wait for [`ISSUED`] (the copies follow the work queued before the
//!   collective) and queues the whole copies of strided tensors. Then it queues the chunk's
//!   copies to the host if they are not queued yet, with an event after them, waits for the
//!   event, and queues the next [`COPY_AHEAD`] chunks' copies, so they run while the host works.
//!   It returns the chunk's op on host memory: whole buffers, or the chunk's window slots.
//! - [`StagedJob::outputs_done`], after chunk k's outputs are final: queues their copies back,
//!   then (windowed chunks) the event that frees the chunk's window set; the copies into that
//!   set [`WINDOW_SETS`] chunks later wait for it.
//! - [`StagedJob::finish`], when every op succeeded: the copies back of strided tensors, then
//!   the event the caller's stream waits for.
//!
//! Ranks copy only what they need: a tensor the job does not read is never copied to the host
//! (a broadcast's receivers), one it does not write never back (a reduce's non-roots).

use crate::buf::{Buf, RawBuf};
use crate::error::{CommError, Result};
use crate::op::Op;
use crate::transport::shm::heap::{HEAP_PAGE, Heaps};
use crate::types::OpKind;

use super::plan::{COPY_AHEAD, OpPlan, Plan, View, WINDOW_SETS};
use super::shared::arena_bytes;
use super::{DeviceCopies, DirectOutput, Event, ISSUED, MappedArena, Pinned, StagedTensor, Toward};

pub struct StagedJob {
    plan: Plan,
    tensors: Vec<StagedTensor>,
    device: Box<dyn DeviceCopies>,
    /// Per tensor: its whole host buffer (tensors that do not go through the window).
    whole: Vec<Option<Pinned>>,
    window: Option<Pinned>,
    /// Per copy number: the event after its copies to the host, once queued.
    copied_in: Vec<Option<Event>>,
    /// Per window set: the event after the copies back of the last chunk that used it.
    set_free: Vec<Option<Event>>,
    /// The first copy number whose copies to the host are not queued yet.
    next_copy_in: usize,
    begun: bool,
    chunk_bytes: usize,
    /// Every op is a broadcast and no tensor is written: a broadcast root's job, which may
    /// stage in its arena (shared.rs).
    root_of_broadcasts: bool,
    /// The chunk whose inputs are ready (op index, chunk), for [`DirectOutput::deliver`].
    current: Option<(usize, usize)>,
    /// Per copy number: its output came onto the device straight from a peer's arena.
    delivered: Vec<bool>,
}

impl StagedJob {
    /// The job of `ops` on `tensors` (plan.rs), copying through `device`.
    pub fn new(ops: &[Op<Buf>], tensors: Vec<StagedTensor>, chunk_bytes: usize, device: Box<dyn DeviceCopies>) -> Result<StagedJob> {
        let plan = Plan::new(ops, &tensors, chunk_bytes)?;
        let root_of_broadcasts = ops.iter().all(|o| o.kind == OpKind::Broadcast) && tensors.iter().all(|t| !t.write);
        Ok(StagedJob {
            copied_in: vec![None; plan.copies.len()],
            delivered: vec![false; plan.copies.len()],
            chunk_bytes,
            root_of_broadcasts,
            current: None,
            set_free: vec![None; WINDOW_SETS],
            whole: vec![None; tensors.len()],
            plan,
            tensors,
            device,
            window: None,
            next_copy_in: 0,
            begun: false,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Allocates the job's pinned memory: in the arena that its group's `heaps` hold, registered
    /// shared memory, where the job is a broadcast root's that fits (shared.rs), else from the
    /// device runtime.
    pub fn start(&mut self, heaps: Option<&mut Heaps>) -> Result<()> {
        if let Some(base) = self.arena(heaps)? {
            let (window_at, whole_at, _) = self.arena_layout();
            if let Some(w) = self.plan.window {
                self.window = Some(self.device.adopt(base + window_at, w.bytes())?);
            }
            for (t, at) in whole_at.into_iter().enumerate() {
                if let Some(at) = at {
                    self.whole[t] = Some(self.device.adopt(base + at, self.tensors[t].bytes)?);
                }
            }
            return Ok(());
        }
        for (t, tensor) in self.tensors.iter().enumerate() {
            if !self.plan.windowed[t] && tensor.bytes > 0 {
                self.whole[t] = Some(self.device.alloc_pinned(tensor.bytes)?);
            }
        }
        if let Some(w) = self.plan.window {
            self.window = Some(self.device.alloc_pinned(w.bytes())?);
        }
        Ok(())
    }

    /// The address of this rank's arena, where the job stages in it: a broadcast root's job
    /// whose buffers fit, on a group whose ranks read each other's heaps.
    fn arena(&mut self, heaps: Option<&mut Heaps>) -> Result<Option<usize>> {
        let bytes = arena_bytes(self.chunk_bytes);
        let Some(heaps) = heaps.filter(|h| h.zero_copy() && self.root_of_broadcasts && self.arena_layout().2 <= bytes) else {
            return Ok(None);
        };
        heaps.staging_arena(bytes, self.device.as_mut())
    }

    /// Where the job's buffers go in an arena: the window's offset, each whole buffer's, and the
    /// bytes they take, every buffer starting on a page.
    fn arena_layout(&self) -> (usize, Vec<Option<usize>>, usize) {
        let mut end = 0;
        let mut place = |bytes: usize| {
            let at = end;
            end += bytes.div_ceil(HEAP_PAGE) * HEAP_PAGE;
            at
        };
        let window_at = place(self.plan.window.map_or(0, |w| w.bytes()));
        let whole_at = (self.tensors.iter().enumerate())
            .map(|(t, tensor)| (!self.plan.windowed[t] && tensor.bytes > 0).then(|| place(tensor.bytes)))
            .collect();
        (window_at, whole_at, end)
    }

    /// Waits until chunk `k` of op `index` is on the host; returns `chunk` (that chunk of the
    /// op, pipeline.rs) on host memory.
    pub fn inputs_ready(&mut self, index: usize, k: usize, chunk: &Op<Buf>) -> Result<Op> {
        self.current = Some((index, k));
        let op = &self.plan.ops[index];
        if !op.views.is_empty() {
            let copy = op.first_copy + k;
            if !self.begun {
                self.begin()?;
            }
            self.queue_copies_in_through(copy)?;
            let event = self.copied_in[copy].expect("queued above");
            self.device.synchronize(event)?;
            self.queue_copies_in_through(copy + COPY_AHEAD)?;
        }
        self.on_host(index, k, chunk)
    }

    /// Chunk `k` of op `index`'s outputs is final on the host: queues its copies back.
    pub fn outputs_done(&mut self, index: usize, k: usize) -> Result<()> {
        let op = &self.plan.ops[index];
        if op.views.is_empty() {
            return Ok(());
        }
        let copy = op.first_copy + k;
        for v in op.views.iter().filter(|v| v.output && !self.delivered[copy]) {
            if self.tensors[v.tensor].write && self.tensors[v.tensor].contiguous {
                let (block, block_offset) = self.host_of(op, v, k, copy);
                let (start, len) = op.chunk_of(v, k);
                if len > 0 {
                    self.device.copy(Toward::Device, v.tensor, v.offset + start, block, block_offset, len)?;
                }
            }
        }
        if let Some(w) = self.plan.window.filter(|_| op.windowed()) {
            // The host is done with this set (it read and wrote it), and its copies back are queued.
            self.set_free[copy % w.sets] = Some(self.device.record(Toward::Device)?);
        }
        Ok(())
    }

    /// The job succeeded: the copies back of strided tensors, then the event the caller waits for.
    pub fn finish(&mut self) -> Result<()> {
        // Also orders the final event after the work queued before the job when nothing else was copied.
        self.device.stream_wait(Toward::Device, ISSUED)?;
        for (t, tensor) in self.tensors.iter().enumerate() {
            if tensor.write && !tensor.contiguous && tensor.bytes > 0 {
                let block = self.whole[t].expect("strided tensors have whole buffers").block;
                self.device.copy(Toward::Device, t, 0, block, 0, tensor.bytes)?;
            }
        }
        self.device.finish()
    }

    /// First chunk of the job: the to-host stream follows the caller's work; strided inputs copy whole.
    fn begin(&mut self) -> Result<()> {
        self.begun = true;
        self.device.stream_wait(Toward::Host, ISSUED)?;
        for (t, tensor) in self.tensors.iter().enumerate() {
            if tensor.read && !tensor.contiguous && tensor.bytes > 0 {
                let block = self.whole[t].expect("strided tensors have whole buffers").block;
                self.device.copy(Toward::Host, t, 0, block, 0, tensor.bytes)?;
            }
        }
        Ok(())
    }

    /// Queues the copies to the host of every chunk up to copy number `last` not queued yet.
    fn queue_copies_in_through(&mut self, last: usize) -> Result<()> {
        while self.next_copy_in <= last && self.next_copy_in < self.plan.copies.len() {
            let copy = self.next_copy_in;
            let (index, k) = self.plan.copies[copy];
            let op = &self.plan.ops[index];
            if let Some(w) = self.plan.window.filter(|_| op.windowed()) {
                if let Some(free) = self.set_free[copy % w.sets] {
                    self.device.stream_wait(Toward::Host, free)?; // its last chunk has been copied back
                }
            }
            for v in &op.views {
                let tensor = self.tensors[v.tensor];
                let (start, len) = op.chunk_of(v, k);
                if tensor.read && tensor.contiguous && len > 0 {
                    let (block, block_offset) = self.host_of(op, v, k, copy);
                    self.device.copy(Toward::Host, v.tensor, v.offset + start, block, block_offset, len)?;
                }
            }
            // Also for chunks with nothing to copy (write-only outputs): the job may overwrite
            // them only after the work queued before it (which may still read them) has run.
            self.copied_in[copy] = Some(self.device.record(Toward::Host)?);
            self.next_copy_in += 1;
        }
        Ok(())
    }

    /// Where chunk `k` (copy number `copy`) of view `v` of `op` is on the host: (block, offset).
    fn host_of(&self, op: &OpPlan, v: &View, k: usize, copy: usize) -> (usize, usize) {
        match (v.slot, self.plan.window, self.window) {
            (Some(slot), Some(w), Some(window)) => (window.block, w.offset(copy, slot)),
            _ => {
                let whole = self.whole[v.tensor].expect("tensors outside the window have whole buffers");
                (whole.block, v.offset + op.chunk_of(v, k).0)
            }
        }
    }

    /// `chunk` (chunk `k` of op `index`) on host memory, marked staged when it has views.
    fn on_host(&self, index: usize, k: usize, chunk: &Op<Buf>) -> Result<Op> {
        let op = &self.plan.ops[index];
        let copy = op.first_copy + k;
        let mut staged = op.views.iter();
        let mut on_host = chunk.map_bufs(|b| match *b {
            Buf::Host(raw) => Ok(raw),
            Buf::Staged { len: 0, .. } => Ok(RawBuf::from_slice(&mut [])),
            Buf::Staged { tensor, offset, len } => {
                // The views are the op's non-empty staged buffers, in the same order.
                let v = staged.next().filter(|v| v.tensor == tensor).ok_or_else(|| mismatch(index, k))?;
                let (start, chunk_len) = op.chunk_of(v, k);
                if offset != v.offset + start || len != chunk_len {
                    return Err(mismatch(index, k));
                }
                let (block, block_offset) = self.host_of(op, v, k, copy);
                let pinned = if v.slot.is_some() { self.window } else { self.whole[tensor] };
                let pinned = pinned.filter(|p| p.block == block && block_offset + len <= p.bytes).ok_or_else(|| mismatch(index, k))?;
                // SAFETY: `[block_offset, block_offset + len)` lies inside the block (checked
                // just above), which this job allocated or adopted from its arena (start) and
                // which stays valid until the job ends (DeviceCopies::alloc_pinned; the group
                // holds the arena until it ends). Only this job's ops use it (peers read an
                // arena block only during the op, which ends after they say they have:
                // broadcast_shm.rs), and a window slot holds one view of one chunk at a time:
                // its next user, WINDOW_SETS chunks later, copies into it only after this
                // chunk's copies back (set_free), or, in a root's arena, after the op that read
                // it ended.
                Ok(unsafe { RawBuf::new((pinned.address + block_offset) as *mut u8, len) })
            }
        })?;
        on_host.staged = !op.views.is_empty();
        Ok(on_host)
    }
}

impl DirectOutput for StagedJob {
    fn deliver(&mut self, source: RawBuf, arena: &MappedArena) -> Result<bool> {
        let Some((index, k)) = self.current else {
            return Ok(false);
        };
        let op = &self.plan.ops[index];
        let copy = op.first_copy + k;
        let [v] = op.views[..] else {
            return Ok(false);
        };
        let tensor = self.tensors[v.tensor];
        let (start, len) = op.chunk_of(&v, k);
        if !v.output || !tensor.write || !tensor.contiguous || len != source.len() || len == 0 {
            return Ok(false);
        }
        if !arena.registered(self.device.as_mut())? {
            return Ok(false);
        }
        let block = self.device.adopt(source.ptr() as usize, len)?;
        self.device.copy(Toward::Device, v.tensor, v.offset + start, block.block, 0, len)?;
        let copied = self.device.record(Toward::Device)?;
        self.device.synchronize(copied)?;
        self.delivered[copy] = true;
        Ok(true)
    }
}

fn mismatch(index: usize, k: usize) -> CommError {
    CommError::invalid(format!("internal error (please report): chunk {k} of op {index} does not match its staging plan"))
}

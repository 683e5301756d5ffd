//! The plan of a staged job, made when it is submitted: for each op its chunks and its views,
//! the order in which the chunks' copies run, and which tensors go through the window.
//!
//! A tensor goes through the window when it is contiguous and only chunked ops use it; the
//! window is used only where it saves memory (a job of one or two chunks keeps whole buffers).
//! Everything else gets a whole pinned buffer of its size. So a 1 GiB all-reduce needs
//! 3 × 16 MiB of pinned memory at 16 MiB chunks.

use crate::buf::Buf;
use crate::error::{CommError, Result};
use crate::op::Op;
use crate::pipeline;

use super::StagedTensor;

/// Window sets: the chunk the host works on, [`COPY_AHEAD`] chunks copying to the host, and
/// the chunk copying back.
pub const WINDOW_SETS: usize = COPY_AHEAD + 2;

/// The copies to the host are queued at most this many chunks ahead of the chunk the host
/// waits for, not all at once: on a device that several processes share, one process's queued
/// copies run in its time slice, and copies queued far ahead delay the other ranks' first
/// chunks, which every rank waits for.
pub const COPY_AHEAD: usize = 1;

/// Slots start at multiples of this.
const SLOT_ALIGN: usize = 64;

/// A byte range of a staged tensor that an op uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    pub tensor: usize,
    /// Bytes from the tensor's start.
    pub offset: usize,
    pub len: usize,
    /// An output of the op (copied back when final), else an input.
    pub output: bool,
    /// Its slot in a window set, when its tensor goes through the window.
    pub slot: Option<usize>,
}

/// One op of the job.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpPlan {
    /// Its chunk size in bytes (`usize::MAX`: one chunk).
    pub chunk: usize,
    pub chunks: usize,
    pub views: Vec<View>,
    /// The copy number of its chunk 0 (meaningful when it has views).
    pub first_copy: usize,
}

impl OpPlan {
    pub fn windowed(&self) -> bool {
        self.views.iter().any(|v| v.slot.is_some())
    }

    /// Chunk `k` of a view: (start within the view, length).
    pub fn chunk_of(&self, view: &View, k: usize) -> (usize, usize) {
        let start = k.saturating_mul(self.chunk).min(view.len);
        (start, (view.len - start).min(self.chunk))
    }
}

/// The window of chunk-sized slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub sets: usize,
    pub slots: usize,
    pub slot_bytes: usize,
}

impl Window {
    pub fn bytes(&self) -> usize {
        self.sets * self.slots * self.slot_bytes
    }

    /// Where chunk number `copy` keeps the view in `slot`, from the window's start.
    pub fn offset(&self, copy: usize, slot: usize) -> usize {
        ((copy % self.sets) * self.slots + slot) * self.slot_bytes
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<OpPlan>,
    /// (op, chunk) of every chunk that has views, in the order the core runs them.
    pub copies: Vec<(usize, usize)>,
    pub window: Option<Window>,
    /// Per tensor: whether it goes through the window (else it has a whole buffer).
    pub windowed: Vec<bool>,
}

impl Plan {
    /// The plan of `ops` on `tensors` with the configured `chunk_bytes`. A staged buffer outside
    /// its tensor is an error (the bridge described it wrongly), never memory to touch.
    pub fn new(ops: &[Op<Buf>], tensors: &[StagedTensor], chunk_bytes: usize) -> Result<Plan> {
        let mut plans = Vec::with_capacity(ops.len());
        let mut copies = Vec::new();
        for (index, op) in ops.iter().enumerate() {
            let (chunk, chunks) = pipeline::plan(op, chunk_bytes);
            let mut views = Vec::new();
            let outputs = op.outputs.iter().map(|b| (b, true));
            for (buf, output) in op.inputs.iter().map(|b| (b, false)).chain(outputs) {
                if let Buf::Staged { tensor, offset, len } = *buf {
                    let whole = tensors.get(tensor).map(|t| t.bytes);
                    if whole.is_none_or(|whole| offset.checked_add(len).is_none_or(|end| end > whole)) {
                        return Err(CommError::invalid(format!(
                            "internal error (please report): bytes [{offset}, +{len}) of staged tensor {tensor} of {} ({:?} bytes)",
                            tensors.len(),
                            whole
                        )));
                    }
                    if len > 0 {
                        views.push(View { tensor, offset, len, output, slot: None });
                    }
                }
            }
            let first_copy = copies.len();
            if !views.is_empty() {
                copies.extend((0..chunks).map(|k| (index, k)));
            }
            plans.push(OpPlan { chunk, chunks, views, first_copy });
        }
        let mut plan = Plan { ops: plans, copies, window: None, windowed: vec![false; tensors.len()] };
        plan.choose_window(tensors);
        Ok(plan)
    }

    /// Puts the contiguous tensors that only chunked ops use through the window, when that
    /// takes less memory than their whole buffers.
    fn choose_window(&mut self, tensors: &[StagedTensor]) {
        let mut candidate = vec![false; tensors.len()];
        let mut excluded = vec![false; tensors.len()];
        for op in &self.ops {
            for v in &op.views {
                let ok = op.chunk != usize::MAX && tensors[v.tensor].contiguous;
                (if ok { &mut candidate } else { &mut excluded })[v.tensor] = true;
            }
        }
        let windowed: Vec<bool> = (0..tensors.len()).map(|t| candidate[t] && !excluded[t]).collect();
        let mut slots = 0;
        let mut slot_bytes = 0;
        for op in &self.ops {
            let in_op = op.views.iter().filter(|v| windowed[v.tensor]).inspect(|v| slot_bytes = slot_bytes.max(v.len.min(op.chunk))).count();
            slots = slots.max(in_op);
        }
        let whole_bytes: usize = (0..tensors.len()).filter(|&t| windowed[t]).map(|t| tensors[t].bytes).sum();
        let window = Window { sets: WINDOW_SETS.min(self.copies.len()), slots, slot_bytes: slot_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN };
        if slots == 0 || window.bytes() >= whole_bytes {
            return;
        }
        for op in &mut self.ops {
            let mut next = 0;
            for v in op.views.iter_mut().filter(|v| windowed[v.tensor]) {
                v.slot = Some(next);
                next += 1;
            }
        }
        self.windowed = windowed;
        self.window = Some(window);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{DType, OpKind};

    fn staged(tensor: usize, offset: usize, len: usize) -> Buf {
        Buf::Staged { tensor, offset, len }
    }

    fn tensor(bytes: usize, contiguous: bool) -> StagedTensor {
        StagedTensor { bytes, contiguous, read: true, write: true }
    }

    fn all_reduce(buf: Buf) -> Op<Buf> {
        let mut op = Op::new(OpKind::AllReduce, DType::Float32);
        op.outputs.push(buf);
        op
    }

    #[test]
    fn large_contiguous_tensors_go_through_a_window_of_three_sets() {
        let plan = Plan::new(&[all_reduce(staged(0, 0, 1000))], &[tensor(1000, true)], 256).unwrap();
        assert_eq!(plan.ops[0].chunks, 4);
        assert_eq!(plan.copies, vec![(0, 0), (0, 1), (0, 2), (0, 3)]);
        assert_eq!(plan.window, Some(Window { sets: 3, slots: 1, slot_bytes: 256 }));
        assert_eq!(plan.windowed, vec![true]);
        assert_eq!(plan.ops[0].views[0].slot, Some(0));
        // Chunk 3 is the last 232 bytes, in set 0 again.
        assert_eq!(plan.ops[0].chunk_of(&plan.ops[0].views[0], 3), (768, 232));
        assert_eq!(plan.window.unwrap().offset(3, 0), 0);
    }

    #[test]
    fn small_strided_and_unchunked_tensors_keep_whole_buffers() {
        // Two chunks: three window sets would take more memory than the tensor.
        let two = Plan::new(&[all_reduce(staged(0, 0, 500))], &[tensor(500, true)], 256).unwrap();
        assert_eq!((two.window, two.windowed.clone()), (None, vec![false]));
        // Strided: copied whole.
        let strided = Plan::new(&[all_reduce(staged(0, 0, 1000))], &[tensor(1000, false)], 256).unwrap();
        assert_eq!(strided.window, None);
        // Also used by an op that is not chunked (a send): whole, for every op.
        let mut send = Op::new(OpKind::Send, DType::Float32);
        send.root = 1;
        send.inputs.push(staged(0, 0, 1000));
        let mixed = Plan::new(&[all_reduce(staged(0, 0, 1000)), send], &[tensor(1000, true)], 256).unwrap();
        assert_eq!((mixed.window, mixed.ops[1].chunks), (None, 1));
        assert_eq!(mixed.copies.len(), 5);
    }

    #[test]
    fn a_range_outside_its_tensor_is_refused() {
        for (buf, tensors) in [(staged(0, 800, 300), 1usize), (staged(1, 0, 10), 1), (staged(0, usize::MAX, 2), 1)] {
            let e = Plan::new(&[all_reduce(buf)], &vec![tensor(1000, true); tensors], 256).unwrap_err();
            assert!(e.message.contains("internal error"), "{buf:?}: {}", e.message);
        }
    }
}
